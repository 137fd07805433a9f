"""w4a8 and w4a4 (quant/w4a.py): each layer against a float32 reference computed from the
quantization formula, the weights' clipped rounding never worse than plain rounding to nearest,
bad input refused by name, and tiny models generating through `LLM(model, quantization=...)`, with
the rotation and without it."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model, write_tiny_tokenizer

from kvflow import LLM, SamplingParams
from kvflow.model.layers.linear import MergedColumnParallelLinear
from kvflow.quant import registry
from kvflow.quant.registry import get_quantization_config
from kvflow.quant.rotation import OnlineHadamardMethod
from kvflow.quant.w4a import W4A8Config, int4_symmetric

SHAPES = [(960, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M's qkv, gate_up, down
LEVELS = {"w4a8": 127, "w4a4": 7}


def _layer(method: str, n: int, k: int, group: int | None = None):
    config = registry._online_configs()[method](group_size=group)
    layer = MergedColumnParallelLinear(k, [n // 2, n // 2], quant_config=config, prefix=f"{method}.{n}x{k}")
    w = torch.randn(n, k) * 0.05
    layer.weight_loader(layer.weight, w[: n // 2], 0)
    layer.weight_loader(layer.weight, w[n // 2:], 1)
    layer.quant_method.process_weights_after_loading(layer)
    return layer, w


def _reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, levels: int) -> torch.Tensor:
    """The formula in float32: x rounded per row to ±levels, times the weight codes × their group scales."""
    x_scale = x.abs().amax(1, keepdim=True) / levels
    xq = (x / x_scale).round().clamp(-levels, levels)
    n, k = q.shape
    w = (q.float().reshape(n, scale.shape[1], -1) * scale[:, :, None]).reshape(n, k)
    return (xq * x_scale) @ w.t()


@pytest.mark.parametrize("method", ["w4a8", "w4a4"])
@pytest.mark.parametrize("group", [None, 32])
def test_layer_matches_the_formula(method, group):
    torch.manual_seed(0)
    for n, k in SHAPES:
        layer, w = _layer(method, n, k, group)
        q, scale = layer.weight, layer.weight_scale
        assert q.dtype == torch.int8 and int(q.abs().max()) <= 7 and scale.shape == (n, k // (group or k))
        for rows in (1, 3, 100):
            x = torch.randn(rows, k)
            torch.testing.assert_close(layer(x), _reference(x, q, scale, LEVELS[method]), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("group", [576, 32])
def test_clipped_rounding_is_never_worse_than_plain(group):
    """Each group's scale is a clipped max|w| / 7 whose squared error is at most plain rounding's
    (ratio 1); on weights with a heavy tail it is strictly better somewhere."""
    torch.manual_seed(0)
    w = torch.randn(64, 576) * torch.exp(torch.randn(64, 576))
    q, scale = int4_symmetric(w, group, "w")
    g = w.reshape(64, -1, group)
    plain_scale = g.abs().amax(-1, keepdim=True) / 7
    plain_err = ((g / plain_scale).round().clamp(-7, 7) * plain_scale - g).pow(2).sum(-1)
    err = (q.float().reshape(64, -1, group) * scale[:, :, None] - g).pow(2).sum(-1)
    assert bool((err <= plain_err * (1 + 1e-6)).all()) and bool((err < plain_err * 0.99).any())


def test_a_row_of_nan_harms_only_itself():
    layer, _ = _layer("w4a4", 960, 576)
    x = torch.randn(3, 576)
    x[1, 5] = float("nan")
    y = layer(x)
    assert bool(y[1].isnan().all()) and bool(y[[0, 2]].isfinite().all())


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="group_size 64 does not divide its 96 input channels"):
        _layer("w4a8", 64, 96, 64)
    with pytest.raises(ValueError, match="group_size must be a positive"):
        W4A8Config(group_size=0)
    with pytest.raises(ValueError, match="saved as w4a8, which kvflow does not load"):
        get_quantization_config(None, None, {"quant_method": "w4a8"})
    with pytest.raises(ValueError, match="'w4a4' cannot be saved yet"):
        get_quantization_config("w4a4", None, None).to_dict()


def _tiny(tmp_path, arch="llama-mha-tied"):
    make_tiny_model(arch, tmp_path)
    write_tiny_tokenizer(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("method", ["w4a8", "w4a4"])
def test_tiny_model_generates_rotated(method, tmp_path):
    llm = LLM(_tiny(tmp_path), quantization=method, dtype="float32", disable_log_stats=True)
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    model = llm.llm_engine.runner.model
    decoder = model.model
    assert model.lm_head is not decoder.embed_tokens  # untied by the rotation
    assert all(bool((norm.weight == 1).all()) for layer in decoder.layers
               for norm in (layer.input_layernorm, layer.post_attention_layernorm))
    for layer in decoder.layers:
        assert isinstance(layer.mlp.down_proj.quant_method, OnlineHadamardMethod)
        assert hasattr(layer.self_attn.qkv_proj, "quant_runtime") and hasattr(layer.mlp.down_proj, "quant_runtime")


def test_tiny_model_generates_unrotated(tmp_path):
    """`quantization_rotation=False` (--no-quantization-rotation) rounds the model as loaded."""
    llm = LLM(_tiny(tmp_path), quantization="w4a8", quantization_rotation=False, dtype="float32",
              disable_log_stats=True)
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    model = llm.llm_engine.runner.model
    assert model.lm_head is model.model.embed_tokens
    assert not isinstance(model.model.layers[0].mlp.down_proj.quant_method, OnlineHadamardMethod)
    assert not bool((model.model.layers[0].input_layernorm.weight == 1).all())


def test_the_rotation_switch_is_refused_where_it_does_not_apply(tmp_path):
    with pytest.raises(ValueError, match="quantization_rotation applies to w4a8 and w4a4"):
        get_quantization_config("int4", None, None, rotation=False)
    with pytest.raises(ValueError, match="enable_lora: adapters add to the residual stream"):
        LLM(_tiny(tmp_path), quantization="w4a4", enable_lora=True)
