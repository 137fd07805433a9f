"""compressed-tensors `pack-quantized` checkpoints (llm-compressor's W4A16 / W8A16): a tiny model
rounded here with its quantizer, written in its tensors and config, loaded by `LLM(dir)` and compared
with transformers on the same dequantized weights (float32: logprobs within 1e-4; bfloat16 on int4's
kernel: greedy). Checkpoints written with a wrong convention must fail that comparison."""

from __future__ import annotations

import pytest
import torch
from quantized_checkpoints import NEAR_TIE, config_error, greedy_shortfall, logprob_error, pack_int32, write_quantized


def _round(w: torch.Tensor, bits: int, group: int, symmetric: bool):
    """compressed-tensors' quantizer per group: signed q in [−2^(b−1), 2^(b−1) − 1]; symmetric:
    scale = max|w| / ((qmax − qmin)/2), zp = 0; else scale = (max − min)/(qmax − qmin) over a range
    holding 0, zp = round(qmin − min/scale). q = clamp(round(w/scale + zp)). Returns q, zp, scale
    ([N, K], [N, K/G], [N, K/G]; scale bfloat16's values, as stored)."""
    n, k = w.shape
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    g = w.view(n, k // group, group)
    low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    if symmetric:
        scale = torch.maximum(-low, high) / ((qmax - qmin) / 2)
    else:
        scale = (high - low) / (qmax - qmin)
    scale = scale.clamp(min=1e-4).bfloat16().float()
    zero = torch.zeros_like(scale) if symmetric else (qmin - low / scale).round().clamp(qmin, qmax)
    q = (g / scale[..., None] + zero[..., None]).round().clamp(qmin, qmax)
    return q.view(n, k).to(torch.int64), zero.to(torch.int64), scale


def _layer(w, bits, group, symmetric, zero_offset=True, order=None):
    n, k = w.shape
    g = group or k
    q, zero, scale = _round(w, bits, g, symmetric)
    offset = 2 ** (bits - 1)
    tensors = {"weight_packed": pack_int32(q + offset, bits, 1, order), "weight_scale": scale.bfloat16(),
               "weight_shape": torch.tensor([n, k])}
    if not symmetric:  # signed zero points, stored + offset (`zero_offset=False`: the wrong convention)
        tensors["weight_zero_point"] = pack_int32((zero + offset) if zero_offset else zero & (2**bits - 1), bits, 0)
    dequantized = ((q - zero.repeat_interleave(g, 1)) * scale.repeat_interleave(g, 1)).float()
    return tensors, dequantized


def _quant_config(bits, group, symmetric) -> dict:
    """As llm-compressor writes it (its W4A16 preset; strategy "channel" without a group_size)."""
    weights = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": group, "num_bits": bits,
               "observer": "minmax", "observer_kwargs": {}, "strategy": "group" if group else "channel",
               "symmetric": symmetric, "type": "int"}
    return {"config_groups": {"group_0": {"format": "pack-quantized", "input_activations": None,
                                          "output_activations": None, "targets": ["Linear"], "weights": weights}},
            "format": "pack-quantized", "global_compression_ratio": None, "ignore": ["lm_head"],
            "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}, "version": "0.10.2"}


def _write(tmp_path, bits=4, group=32, symmetric=True, model="llama-mha-tied", **wrong):
    return write_quantized(tmp_path, model, lambda w: _layer(w, bits, group, symmetric, **wrong),
                           _quant_config(bits, group, symmetric))


CASES = {  # name → (bits, group_size (None: channel), symmetric, model)
    "w4a16-g32-sym": (4, 32, True, "llama-mha-tied"),
    "w4a16-g32-asym-qwen2-bias-gqa": (4, 32, False, "qwen2-bias"),
    "w4a16-channel-asym": (4, None, False, "llama-mha-tied"),
    "w8a16-channel-sym": (8, None, True, "llama-mha-tied"),
    "w8a16-g32-asym": (8, 32, False, "llama-mha-tied"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_compressed_tensors_checkpoint_matches_transformers(case, tmp_path):
    bits, group, symmetric, model = CASES[case]
    path, hf = _write(tmp_path, bits, group, symmetric, model)
    assert logprob_error(path, hf) < 1e-4
    assert greedy_shortfall(path, hf) < NEAR_TIE


@pytest.mark.parametrize("wrong", ["zero point without its offset", "bit order"])
def test_a_wrong_convention_fails_the_comparison(wrong, tmp_path):
    kw = {"zero point without its offset": dict(zero_offset=False), "bit order": dict(order=list(range(7, -1, -1)))}
    path, hf = _write(tmp_path, symmetric=False, **kw[wrong])
    assert logprob_error(path, hf) > 1e-3
    assert greedy_shortfall(path, hf) > NEAR_TIE


def _group(**weights) -> dict:
    config = _quant_config(4, 32, True)["config_groups"]
    config["group_0"]["weights"] |= weights
    return config


@pytest.mark.parametrize("changes, field", [
    (dict(format="float-quantized"), "format='float-quantized'"), (dict(format="nvfp4-pack-quantized"), "format"),
    (dict(config_groups=_group(num_bits=2)), "weights.num_bits=2"),
    (dict(config_groups=_group(type="float")), "weights.type='float'"),
    (dict(config_groups=_group(actorder="group")), "weights.actorder='group'"),
    (dict(config_groups=_group(strategy="tensor")), "weights.strategy='tensor'"),
    (dict(config_groups=_group(group_size=16)), "group_size=16"),
    (dict(config_groups={"group_0": _group()["group_0"] | {"input_activations": {"num_bits": 8, "type": "int"}}}),
     "input_activations"),
    (dict(ignore=["lm_head", "model.layers.0.mlp.down_proj"]), "ignore"),
    (dict(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config"),
    (dict(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
])
def test_what_compressed_tensors_cannot_load_is_refused_by_field(changes, field, tmp_path):
    path, _ = _write(tmp_path)
    assert field in config_error(path, **changes)


def test_q_compressed_tensors_is_accepted_on_its_checkpoint(tmp_path):
    """vLLM's spelling; on a float checkpoint it is refused (it loads, it does not quantize)."""
    from kvflow import LLM

    path, _ = _write(tmp_path)
    LLM(str(path), quantization="compressed-tensors", dtype="float32", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="quantization_config"):
        LLM(str(tmp_path / "float"), quantization="compressed-tensors", dtype="float32", skip_tokenizer_init=True)
