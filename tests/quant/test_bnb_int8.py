"""LLM.int8() (bitsandbytes 8-bit): a layer against its formula in float32 (the outlier columns in
float, the rest rounded per row to int8), a tiny model written in transformers' checkpoint format and
loaded by `LLM(dir)` against the same model on its dequantized float weights, `-q bitsandbytes` on the
float checkpoint against that checkpoint, and what cannot load refused by field."""

from __future__ import annotations

import json

import pytest
import torch
from bnb_nvfp4_checkpoints import assert_two_ranks_hold_the_full_layers
from quantized_checkpoints import NEAR_TIE, PROMPT, config_error, logprob_error, write_quantized
from safetensors.torch import load_file, save_file

from kvflow import LLM, SamplingParams
from kvflow.model.layers.linear import MergedColumnParallelLinear
from kvflow.quant.bnb_int8 import OutlierDecomposed
from kvflow.quant.registry import get_quantization_config

# Low enough that the tiny model's hidden states cross it (its largest reach ~4): the model runs
# take both paths. Real checkpoints say 6.0.
MODEL_THRESHOLD = 1.5


def _round(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' int8_vectorwise_quant of a weight: SCB = each row's max|w|, q = round(w·127/SCB)."""
    scb = w.abs().amax(dim=1)
    return (w * (127.0 / scb[:, None])).round().to(torch.int8), scb


def _dequantized(q: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    return q.float() * scb[:, None] / 127


def _reference(x: torch.Tensor, w: torch.Tensor, threshold: float) -> torch.Tensor:
    """LLM.int8()'s product in float32 from its definition: columns with an |x| ≥ threshold times W's
    columns; the others rounded per row (scale max|x|/127) times W's."""
    outlier = (x.abs() >= threshold).any(0) if threshold > 0 else torch.zeros(x.shape[1], dtype=torch.bool)
    ordinary = x.masked_fill(outlier, 0)
    scale = ordinary.abs().amax(1, keepdim=True).clamp(min=1e-30) / 127
    rounded = (ordinary * (1 / scale)).round() * scale
    return rounded @ w.t() + x[:, outlier] @ w[:, outlier].t()


def _checkpoint_layer(threshold: float, w: torch.Tensor, sizes=(48, 80)):
    """A fused [gate; up]-style layer loaded from bitsandbytes' tensors, one shard at a time."""
    config = get_quantization_config(None, None, {"quant_method": "bitsandbytes", "load_in_8bit": True,
                                                  "llm_int8_threshold": threshold})
    layer = MergedColumnParallelLinear(w.shape[1], list(sizes), quant_config=config, prefix="mlp.gate_up_proj")
    q, scb = _round(w)
    for shard, rows in enumerate(torch.arange(w.shape[0]).split(list(sizes))):
        layer.weight_loader(layer.weight, q[rows], shard)
        layer.weight_loader(layer.SCB, scb[rows], shard)
        layer.weight_format.weight_loader(layer.weight_format, torch.tensor(0, dtype=torch.uint8), shard)
    layer.quant_method.process_weights_after_loading(layer)
    return layer, _dequantized(q, scb)


@pytest.mark.parametrize("threshold", [6.0, 0.0])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_layer_output_is_the_decomposition_formula(threshold, rows):
    torch.manual_seed(rows)
    layer, w = _checkpoint_layer(threshold, torch.randn(128, 96) * 0.05)
    x = torch.randn(rows, 96) * 2
    x[0, 5], x[-1, 17] = 30.0, -9.0  # two outlier columns at t = 6
    torch.testing.assert_close(layer(x), _reference(x, w, threshold), atol=2e-4, rtol=1e-4)
    assert isinstance(layer.quant_runtime, OutlierDecomposed) == (threshold > 0)
    assert not hasattr(layer, "weight_format")  # the checkpoint tensors are dropped once the runtime is built


def test_an_outlier_column_takes_the_float_path():
    """A row with one activation of 60 among ordinary ones of ~1: rounded whole to int8 (scale 60/127)
    its ordinary values lose their precision; decomposed, the product is near the exact one."""
    torch.manual_seed(1)
    w = torch.randn(128, 96) * 0.05
    x = torch.randn(4, 96)
    x[2, 40] = 60.0
    decomposed, deq = _checkpoint_layer(6.0, w)
    plain, _ = _checkpoint_layer(0.0, w)
    exact = x @ deq.t()
    error = (decomposed(x) - exact).abs().max().item()
    assert error < 0.1 * (plain(x) - exact).abs().max().item()
    assert error < 0.02
    # and the float path alone is exact on that column: the other rows, with no outlier, are unchanged
    torch.testing.assert_close(decomposed(x[2:3]), _reference(x[2:3], deq, 6.0), atol=2e-4, rtol=1e-4)


def test_bfloat16_layer_stays_near_the_formula():
    torch.manual_seed(2)
    layer, w = _checkpoint_layer(6.0, torch.randn(128, 96) * 0.05)
    x = torch.randn(8, 96)
    x[3, 11] = 40.0
    y = layer(x.bfloat16())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), _reference(x.bfloat16().float(), w, 6.0), atol=0.05, rtol=0.02)


def test_online_rounding_is_bitsandbytes():
    """-q bitsandbytes rounds a float weight as bitsandbytes does (a zero row: q = 0), with t = 6."""
    from kvflow.model.layers.linear import ReplicatedLinear

    w = torch.randn(64, 96) * 0.05
    w[7] = 0
    layer = ReplicatedLinear(96, 64, quant_config=get_quantization_config("bitsandbytes", None, None), prefix="o_proj")
    layer.weight_loader(layer.weight, w)
    layer.quant_method.process_weights_after_loading(layer)
    q, scb = _round(w)
    q[7] = 0
    runtime = layer.quant_runtime
    assert runtime.threshold == 6.0
    assert torch.equal(runtime.int8.q, q)
    torch.testing.assert_close(runtime.int8.scale, scb / 127, rtol=0, atol=0)


def _layer_writer(weight_format: int = 0):
    def write(w: torch.Tensor):
        q, scb = _round(w)
        stored = {"weight": q, "SCB": scb, "weight_format": torch.tensor(weight_format, dtype=torch.uint8)}
        return stored, _dequantized(q, scb)
    return write


def _quant_config(threshold: float = MODEL_THRESHOLD, skip=None) -> dict:
    """As transformers' BitsAndBytesConfig.to_dict writes it for load_in_8bit."""
    return {"_load_in_4bit": False, "_load_in_8bit": True, "bnb_4bit_compute_dtype": "float32",
            "bnb_4bit_quant_storage": "uint8", "bnb_4bit_quant_type": "fp4", "bnb_4bit_use_double_quant": False,
            "llm_int8_enable_fp32_cpu_offload": False, "llm_int8_has_fp16_weight": False,
            "llm_int8_skip_modules": skip, "llm_int8_threshold": threshold, "load_in_4bit": False,
            "load_in_8bit": True, "quant_method": "bitsandbytes"}


def _write(tmp_path, threshold: float = MODEL_THRESHOLD, weight_format: int = 0):
    return write_quantized(tmp_path, "llama-mha-tied", _layer_writer(weight_format), _quant_config(threshold))


def _greedy(path, **kw) -> list[int]:
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, disable_log_stats=True, **kw)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return list(llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids)


def test_checkpoint_with_every_column_in_float_generates_what_its_dequantized_model_does(tmp_path):
    """A threshold below every activation sends every column down the float path: the model is then
    its dequantized float weights exactly (the stored format read right, shard by shard)."""
    path, hf = _write(tmp_path, threshold=1e-6)
    hf.save_pretrained(tmp_path / "dequantized", safe_serialization=True)
    assert _greedy(path) == _greedy(tmp_path / "dequantized")


def test_checkpoint_stays_near_its_dequantized_model_and_decomposition_brings_it_nearer(tmp_path):
    """With activations rounded to int8 the logprobs move (a random tiny model's greedy text may swap
    a near-tie): each greedy token is within NEAR_TIE of transformers' best on the dequantized
    weights, and the outlier decomposition halves the logprob error of rounding every column."""
    path, hf = _write(tmp_path / "t", threshold=MODEL_THRESHOLD)
    tokens = _greedy(path)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1:-1].log_softmax(-1)
    assert (ref.amax(-1) - ref[torch.arange(len(tokens)), torch.tensor(tokens)]).max() < NEAR_TIE
    decomposed = logprob_error(path, hf)
    assert decomposed < 0.06
    all_int8, hf0 = _write(tmp_path / "0", threshold=0.0)
    assert decomposed < 0.5 * logprob_error(all_int8, hf0)


def test_q_bitsandbytes_on_the_float_checkpoint_runs_as_its_checkpoint(tmp_path):
    """Rounded at load with t = 6 (the default), a float checkpoint generates what the bitsandbytes
    checkpoint of the same weights, written with t = 6, does."""
    path, _ = _write(tmp_path, threshold=6.0)
    assert _greedy(tmp_path / "float", quantization="bitsandbytes") == _greedy(path)
    assert _greedy(path, quantization="bitsandbytes") == _greedy(path)  # vLLM's spelling on its checkpoint


def test_skipped_modules_load_float(tmp_path):
    """llm_int8_skip_modules: those layers are float in the checkpoint and stay float."""
    path, hf = _write(tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    float_weights = load_file(str(tmp_path / "float" / "model.safetensors"))
    for name in [n for n in tensors if ".down_proj." in n]:
        del tensors[name]
    for name in [n for n in float_weights if ".down_proj." in n]:
        tensors[name] = float_weights[name]
        hf.get_parameter(name).data.copy_(float_weights[name].float())
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["llm_int8_skip_modules"] = ["lm_head", "down_proj"]
    (path / "config.json").write_text(json.dumps(config))
    hf.save_pretrained(tmp_path / "dequantized", safe_serialization=True)
    assert _greedy(path) == _greedy(tmp_path / "dequantized")


@pytest.mark.parametrize("changes, field", [
    (dict(load_in_4bit=True, load_in_8bit=False), "load_in_4bit=true"),
    (dict(load_in_8bit=False), "load_in_8bit=False"),
    (dict(llm_int8_has_fp16_weight=True), "llm_int8_has_fp16_weight=true"),
    (dict(llm_int8_threshold=-1.0), "llm_int8_threshold=-1.0"),
    (dict(llm_int8_threshold="6"), "llm_int8_threshold='6'"),
    (dict(llm_int8_skip_modules="lm_head"), "llm_int8_skip_modules='lm_head'"),
    (dict(llm_int8_skip_modules=["mlp.(gate"]), "llm_int8_skip_modules entry 'mlp.(gate'"),
])
def test_what_bitsandbytes_cannot_load_is_refused_by_field(changes, field, tmp_path):
    path, _ = _write(tmp_path)
    assert field in config_error(path, **changes)


def test_a_float_layer_kvflow_fuses_with_8bit_ones_is_refused_by_name(tmp_path):
    """q_proj left float (skipped alone) while kvflow's fused qkv_proj is 8-bit: refused, not cast."""
    path, _ = _write(tmp_path)
    tensors = {n: t for n, t in load_file(str(path / "model.safetensors")).items() if ".q_proj." not in n}
    float_weights = load_file(str(tmp_path / "float" / "model.safetensors"))
    save_file(tensors | {n: t for n, t in float_weights.items() if ".q_proj." in n}, str(path / "model.safetensors"))
    message = config_error(path, llm_int8_skip_modules=["q_proj"])
    assert "q_proj.weight' is torch.float32, not int8" in message and "llm_int8_skip_modules" in message


def test_a_tiled_weight_format_is_refused(tmp_path):
    path, _ = _write(tmp_path, weight_format=2)
    with pytest.raises(ValueError, match=r"weight_format' \(weight_format\) is 2 \(col_turing\)"):
        LLM(str(path), dtype="float32", skip_tokenizer_init=True)


def test_a_negative_scb_is_refused_naming_the_layer(tmp_path):
    path, _ = _write(tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.SCB"][3] = -1.0
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj: SCB"):
        LLM(str(path), dtype="float32", skip_tokenizer_init=True)


def test_two_tensor_parallel_ranks_hold_the_full_layers(tmp_path):
    path, _ = write_quantized(tmp_path, "llama-gqa-llama3-rope", _layer_writer(), _quant_config())
    assert assert_two_ranks_hold_the_full_layers(path) == 2 * 4  # qkv, o, gate_up, down per layer
