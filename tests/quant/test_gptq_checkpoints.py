"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum): a tiny model rounded here with GPTQ's quantizer,
written in its tensors and config, loaded by `LLM(dir)` and compared with transformers running the
same dequantized weights (float32: every logprob within 1e-4; bfloat16 on int4's kernel: the same
greedy tokens). A checkpoint written with a wrong convention must fail that comparison."""

from __future__ import annotations

import pytest
import torch
from quantized_checkpoints import NEAR_TIE, config_error, greedy_shortfall, logprob_error, pack_int32, write_quantized
from safetensors.torch import load_file, save_file

from kvflow import LLM


def _round(w: torch.Tensor, bits: int, group: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's quantizer per group of input channels: scale = (max − min)/maxq over a range that holds 0
    (symmetric: ±max|w|, zero point (maxq + 1)/2), zero = round(−min/scale); q = clamp(round(w/s) + z).
    Returns q [N, K], z [N, K/G], s [N, K/G] (s already fp16, as stored, so that (q − z)·s is exact)."""
    n, k = w.shape
    maxq = 2**bits - 1
    g = w.view(n, k // group, group)
    low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    if sym:
        high = torch.maximum(-low, high)
        low = -high
    scale = ((high - low) / maxq).clamp(min=1e-4).half().float()
    zero = torch.full_like(scale, (maxq + 1) // 2) if sym else (-low / scale).round().clamp(0, maxq)
    q = ((g / scale[..., None]).round() + zero[..., None]).clamp(0, maxq)
    return q.view(n, k).to(torch.int64), zero.to(torch.int64), scale


def _gptq_tensors(w, bits, group, sym, fmt, order=None) -> tuple[dict, torch.Tensor]:
    """A layer's qweight, qzeros, scales, g_idx as the format stores them, and the weight they hold."""
    n, k = w.shape
    g = group if group > 0 else k
    q, zero, scale = _round(w, bits, g, sym)
    stored_zero = (zero - 1) & (2**bits - 1) if fmt == "gptq" else zero  # v1: z − 1
    tensors = {"qweight": pack_int32(q.t(), bits, 0, order), "qzeros": pack_int32(stored_zero.t(), bits, 1),
               "scales": scale.t().half().contiguous(), "g_idx": (torch.arange(k) // g).to(torch.int32)}
    dequantized = ((q - zero.repeat_interleave(g, 1)) * scale.repeat_interleave(g, 1)).float()
    return tensors, dequantized


def _quant_config(bits, group, sym, fmt, desc_act=False) -> dict:
    """As GPTQModel writes it into config.json (optimum's differs in keys kvflow does not read)."""
    config = {"bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym, "lm_head": False,
              "quant_method": "gptq", "checkpoint_format": fmt, "pack_dtype": "int32", "damp_percent": 0.01,
              "static_groups": False, "true_sequential": True, "meta": {"quantizer": ["gptqmodel:2.2.0"]}}
    if fmt == "gptq":  # optimum's v1 config has no checkpoint_format
        del config["checkpoint_format"]
    return config


def _write(tmp_path, bits=4, group=32, sym=True, fmt="gptq", declared=None, order=None, model="llama-mha-tied"):
    """The checkpoint directory and the HF float32 model holding its dequantized weights.
    `declared`: the format config.json claims (a wrong one for the negative tests)."""
    return write_quantized(tmp_path, model, lambda w: _gptq_tensors(w, bits, group, sym, fmt, order),
                           _quant_config(bits, group, sym, declared or fmt))


CASES = {  # name → (bits, group_size, sym, checkpoint_format[, model])
    "int4-g32-sym-v1": (4, 32, True, "gptq"),
    "int4-g32-asym-v2-qwen2-bias-gqa": (4, 32, False, "gptq_v2", "qwen2-bias"),
    "int4-g32-asym-v1": (4, 32, False, "gptq"),
    "int4-per-channel-asym-v2": (4, -1, False, "gptq_v2"),
    "int8-g32-asym-v1": (8, 32, False, "gptq"),
    "int8-per-channel-sym-v2": (8, -1, True, "gptq_v2"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gptq_checkpoint_matches_transformers(case, tmp_path):
    bits, group, sym, fmt, *model = CASES[case]
    path, hf = _write(tmp_path, bits, group, sym, fmt, model=model[0] if model else "llama-mha-tied")
    assert logprob_error(path, hf) < 1e-4
    assert greedy_shortfall(path, hf) < NEAR_TIE


def test_a_loaded_gptq_layer_holds_only_its_runtime(tmp_path):
    """The checkpoint's tensors are read into int4's planes and then dropped: kept as buffers they were a
    second int4-sized copy of every layer (a GPTQ checkpoint is never saved again, so none reads them)."""
    path, _ = _write(tmp_path)
    model = LLM(str(path), dtype="float32", skip_tokenizer_init=True).llm_engine.runner.model
    layers = [m for m in model.modules() if hasattr(m, "quant_runtime")]
    assert layers
    for layer in layers:
        kept = {name for name, _ in [*layer.named_buffers(recurse=False), *layer.named_parameters(recurse=False)]}
        assert not kept & {"qweight", "qzeros", "scales", "g_idx"}, (layer.prefix, kept)


@pytest.mark.parametrize("wrong", ["v1 declared v2", "v2 declared v1", "bit order"])
def test_a_wrong_convention_fails_the_comparison(wrong, tmp_path):
    """The comparison above can fail: a zero point off by one (v1's z − 1 read as z, or the other
    way), or 4-bit values packed high nibble first."""
    kw = {"v1 declared v2": dict(fmt="gptq", declared="gptq_v2"), "v2 declared v1": dict(fmt="gptq_v2", declared="gptq"),
          "bit order": dict(order=list(range(7, -1, -1)))}[wrong]
    path, hf = _write(tmp_path, sym=False, **kw)
    assert logprob_error(path, hf) > 1e-3
    assert greedy_shortfall(path, hf) > NEAR_TIE


def _config_error(tmp_path, **changes) -> str:
    path, _ = _write(tmp_path)
    return config_error(path, **changes)


@pytest.mark.parametrize("changes, field", [
    (dict(bits=3), "bits=3"), (dict(bits=2), "bits=2"), (dict(checkpoint_format="marlin"), "checkpoint_format"),
    (dict(lm_head=True), "lm_head"), (dict(group_size=16), "group_size=16"),
])
def test_what_gptq_cannot_load_is_refused_by_field(changes, field, tmp_path):
    assert field in _config_error(tmp_path, **changes)


def test_act_order_is_refused_naming_desc_act(tmp_path):
    path, _ = _write(tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = tensors[name][torch.randperm(tensors[name].shape[0], generator=torch.Generator().manual_seed(0))]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="desc_act") as error:
        LLM(str(path), dtype="float32", skip_tokenizer_init=True)
    assert name in str(error.value)


def test_q_gptq_is_accepted_on_a_gptq_checkpoint_and_refused_on_a_float_one(tmp_path):
    path, _ = _write(tmp_path)
    LLM(str(path), quantization="gptq", dtype="float32", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="quantization_config"):
        LLM(str(tmp_path / "float"), quantization="gptq", dtype="float32", skip_tokenizer_init=True)


def test_an_unknown_quant_method_is_refused_by_name(tmp_path):
    assert "quant_method is 'hqq'" in _config_error(tmp_path, quant_method="hqq")
