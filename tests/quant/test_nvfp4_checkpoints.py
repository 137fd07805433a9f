"""compressed-tensors `nvfp4-pack-quantized` checkpoints (llm-compressor's NVFP4A16 and NVFP4): weights
rounded here as compressed-tensors defines the format (a global scale 448·6 / max|W| per checkpoint
layer, an E4M3 scale per 16 input channels, E2M1 codes two per byte, the even channel low), a layer
against the dequantization formula in float32, a tiny Llama loaded by `LLM(dir)` against the same model
on its dequantized float weights, and what cannot load refused by field."""

from __future__ import annotations

import json

import pytest
import torch
from bnb_nvfp4_checkpoints import assert_two_ranks_hold_the_full_layers
from quantized_checkpoints import PROMPT, config_error, logprob_error, write_quantized
from safetensors.torch import load_file, save_file

from kvflow import LLM, SamplingParams
from kvflow.model.layers.linear import MergedColumnParallelLinear
from kvflow.quant.registry import get_quantization_config

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _round(w: torch.Tensor, swap_nibbles: bool = False):
    """w [N, K] → (weight_packed, weight_scale, weight_global_scale) and the weight they hold, float32."""
    n, k = w.shape
    global_scale = (448.0 * 6.0 / w.abs().max()).reshape(1)
    groups = w.view(n, k // 16, 16)
    local = (global_scale * groups.abs().amax(-1) / 6.0).clamp(-448, 448).to(torch.float8_e4m3fn)
    step = local.float() / global_scale  # compressed-tensors: the local scale divided by the global one
    scaled = groups / step[..., None]
    magnitude = (scaled.abs()[..., None] - E2M1).abs().argmin(-1)
    codes = (magnitude | ((scaled < 0).long() << 3)).view(n, k)
    low, high = (codes[:, 1::2], codes[:, 0::2]) if swap_nibbles else (codes[:, 0::2], codes[:, 1::2])
    packed = (low | (high << 4)).to(torch.uint8)
    values = E2M1[magnitude] * torch.where(scaled < 0, -1.0, 1.0)
    return (packed, local, global_scale), (values * step[..., None]).view(n, k)


def _quant_config(activations: bool = False, **weights) -> dict:
    """As llm-compressor writes it for its NVFP4A16 preset (NVFP4 with `activations`)."""
    fp4 = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 16, "num_bits": 4,
           "observer": "minmax", "observer_kwargs": {}, "strategy": "tensor_group", "symmetric": True, "type": "float"}
    group = {"format": "nvfp4-pack-quantized", "input_activations": None, "output_activations": None,
             "targets": ["Linear"], "weights": fp4 | weights}
    if activations:
        group["input_activations"] = fp4 | {"dynamic": "local", "observer": "static_minmax"}
    return {"config_groups": {"group_0": group}, "format": "nvfp4-pack-quantized", "global_compression_ratio": None,
            "ignore": ["lm_head"], "kv_cache_scheme": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {}, "version": "0.12.2"}


def _write(tmp_path, activations: bool = False, swap_nibbles: bool = False):
    def layer(w):
        (packed, scale, global_scale), dequantized = _round(w, swap_nibbles)
        stored = {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": global_scale}
        if activations:
            stored["input_global_scale"] = torch.tensor([123.0])
        return stored, dequantized
    return write_quantized(tmp_path, "llama-mha-tied", layer, _quant_config(activations))


def _greedy(path) -> list[int]:
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, disable_log_stats=True)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return list(llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids)


def test_layer_output_is_the_dequantization_formula():
    """Two checkpoint layers fused in one, each with its own global scale."""
    torch.manual_seed(0)
    config = get_quantization_config(None, None, _quant_config())
    layer = MergedColumnParallelLinear(96, [48, 80], quant_config=config, prefix="mlp.gate_up_proj")
    references = []
    for shard, w in enumerate([torch.randn(48, 96) * 0.05, torch.randn(80, 96) * 3.0]):
        (packed, scale, global_scale), dequantized = _round(w)
        layer.weight_loader(layer.weight_packed, packed, shard)
        layer.weight_loader(layer.weight_scale, scale, shard)
        layer.weight_global_scale.weight_loader(layer.weight_global_scale, global_scale, shard)
        references.append(dequantized)
    layer.quant_method.process_weights_after_loading(layer)
    reference = torch.cat(references)
    for rows in (1, 5, 64):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(layer(x), x @ reference.t(), atol=1e-5, rtol=1e-5)
    assert not hasattr(layer, "weight_packed")  # the runtime's dense weight is all the layer keeps


@pytest.mark.parametrize("activations", [False, True], ids=["NVFP4A16", "NVFP4-weight-only"])
def test_checkpoint_generates_what_its_dequantized_float_model_does(activations, tmp_path):
    """NVFP4's activation scheme runs unquantized: its checkpoint is its weights exactly too."""
    path, hf = _write(tmp_path, activations)
    hf.save_pretrained(tmp_path / "dequantized", safe_serialization=True)
    assert _greedy(path) == _greedy(tmp_path / "dequantized")
    assert logprob_error(path, hf) < 1e-4


def test_the_other_nibble_order_fails_the_comparison(tmp_path):
    path, hf = _write(tmp_path, swap_nibbles=True)
    assert logprob_error(path, hf) > 1e-2


def _weights(**fields) -> dict:
    return _quant_config(**fields)["config_groups"]


@pytest.mark.parametrize("changes, field", [
    (dict(config_groups=_weights(group_size=32)), "weights.group_size=32"),
    (dict(config_groups=_weights(type="int")), "weights.type='int'"),
    (dict(config_groups=_weights(num_bits=8)), "weights.num_bits=8"),
    (dict(config_groups=_weights(strategy="group")), "weights.strategy='group'"),
    (dict(config_groups=_weights(symmetric=False)), "weights.symmetric=False"),
    (dict(config_groups={"group_0": _weights()["group_0"] | {"input_activations": {"num_bits": 8, "type": "int"}}}),
     "input_activations.num_bits=8"),
    (dict(config_groups={"group_0": _weights()["group_0"] | {"output_activations": {"num_bits": 4}}}),
     "output_activations"),
    (dict(config_groups={"group_0": _weights()["group_0"] | {"format": "pack-quantized"}}), "format"),
    (dict(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
])
def test_what_nvfp4_cannot_load_is_refused_by_field(changes, field, tmp_path):
    path, _ = _write(tmp_path)
    assert field in config_error(path, **changes)


@pytest.mark.parametrize("tensor, value, message", [
    ("weight_scale", lambda t: t.float(), "weight_scale' is torch.float32, not torch.float8_e4m3fn"),
    ("weight_packed", lambda t: t.view(torch.int8), "weight_packed' is torch.int8, not torch.uint8"),
    ("weight_global_scale", lambda t: t * 0, "weight_global_scale' is [0.0]; a global scale is one positive"),
    ("weight_global_scale", lambda t: torch.cat([t, t]), "a global scale is one positive finite number"),
])
def test_a_malformed_tensor_is_refused_by_name(tensor, value, message, tmp_path):
    path, _ = _write(tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    name = f"model.layers.1.self_attn.k_proj.{tensor}"
    tensors[name] = value(tensors[name])
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="k_proj") as error:
        LLM(str(path), dtype="float32", skip_tokenizer_init=True)
    assert message in str(error.value)


def test_a_nan_scale_is_refused_naming_the_layer(tmp_path):
    path, _ = _write(tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight_scale"
    tensors[name] = tensors[name].view(torch.uint8).index_fill(1, torch.tensor([2]), 0x7F).view(torch.float8_e4m3fn)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.0.mlp.gate_up_proj: weight_scale / weight_global_scale"):
        LLM(str(path), dtype="float32", skip_tokenizer_init=True)


def test_q_compressed_tensors_loads_its_nvfp4_checkpoint(tmp_path):
    path, _ = _write(tmp_path)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
    LLM(str(path), quantization="compressed-tensors", dtype="float32", skip_tokenizer_init=True)


def test_two_tensor_parallel_ranks_hold_the_full_layers(tmp_path):
    """Each checkpoint layer's global scale stays with its rows, at any rank."""
    def layer(w):
        (packed, scale, global_scale), dequantized = _round(w)
        return {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": global_scale}, dequantized
    path, _ = write_quantized(tmp_path, "llama-gqa-llama3-rope", layer, _quant_config())
    assert assert_two_ranks_hold_the_full_layers(path) == 2 * 4  # qkv, o, gate_up, down per layer
