"""AWQ scores what it stores: its scale search minimises the output error of the weights the layer
will run with (int4's rounding, the runtime's dtype, the fold's 1/s), α = 0 is `-q int4` bit for
bit, and AutoAWQ's own checkpoints (integer zero points) still load."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model, write_tiny_tokenizer

from kvflow import LLM, SamplingParams
from kvflow.quant import int4pack
from kvflow.quant.awq import AWQConfig, _pack_awq, candidate_scale
from kvflow.quant.calibration import ALPHAS, InputStats
from kvflow.quant.int4 import Int4Config

PROMPT = {"prompt_token_ids": [3, 17, 42, 8, 61, 5, 29, 77, 12, 40, 2, 33]}


def _q4_1_grid(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A weight whose every group of 32 is d·q + m, q using 0..15 (as a dequantized Q4_1 block):
    int4 at G32 holds it exactly; an integer zero point shifts each group's grid off it."""
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15
    d = 0.01 + 0.05 * torch.rand(n, k // 32, 1, generator=gen)
    m = -8 * d + 0.3 * torch.randn(n, k // 32, 1, generator=gen)
    return (d * q + m).view(n, k)


def _layer(kind: str, dtype: torch.dtype):
    """A weight (`dtype`'s values, in float32: the search is handed it in `dtype`, as the layer stores
    it), and inputs whose first 4 channels are 20× the others."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 128, generator=gen) if kind == "gaussian" else _q4_1_grid(256, 128, gen)
    x = torch.randn(512, 128, generator=gen)
    x[:, :4] *= 20
    return w.to(dtype).float(), x, InputStats(x.abs().mean(0), x)


def _scale(inputs: InputStats, alpha: float) -> torch.Tensor:
    s = inputs.abs_mean.clamp(min=1e-4).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


def _stored_error(method, w, x, s, dtype) -> float:
    """The layer's output error once s is folded as calibration folds it and the layer is rounded
    and built as it is stored and run: through `quantize` and `runtime`, not the search."""
    scaled = w.to(dtype, copy=True).mul_(s.to(dtype))  # as the fold writes the layer's weight
    run = method.runtime(method.quantize(scaled, "w"), dtype, "w", dense_copy=False).dequantize().float()
    fed = x * (1 / s).to(dtype).float()  # the norm or rows before the layer, times 1/s
    return (fed @ run.t() - x @ w.t()).pow(2).mean().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["gaussian", "q4_1 grid"])
def test_search_minimises_the_error_of_what_is_stored(kind, dtype):
    """The α the search picks has the smallest stored-weight error of the grid, so never more than
    α = 0's (plain int4). Before, it scored a float-minimum grid while `quantize` stored an integer
    zero point: on Q4_1-like groups it kept α = 0, exact on its grid and ~8% RMS off as stored."""
    w, x, inputs = _layer(kind, dtype)
    method = AWQConfig(32).get_quant_method("linear", "w")
    s, alpha = method.search_scale(w.to(dtype), inputs, "w")  # as the layer stores it
    errors = {a: _stored_error(method, w, x, _scale(inputs, a), dtype) for a in ALPHAS}
    assert torch.allclose(s, _scale(inputs, alpha))
    assert errors[alpha] <= min(errors.values()) * (1 + 1e-6), (alpha, errors)
    assert errors[alpha] <= errors[0.0]
    if kind == "gaussian":  # the outlier channels are worth protecting
        assert alpha > 0 and errors[alpha] < 0.8 * errors[0.0]


def test_the_scale_at_alpha_zero_is_exactly_one():
    """α = 0 is plain int4 only if its scale is 1 exactly (x^0 = 1 whatever the channel's mean), so that
    W·s and x/s change nothing: the test below then holds the rest bit for bit."""
    abs_mean = torch.tensor([0.0, 1e-9, 3e-4, 0.7, 1.0, 13.0, 4e5])
    assert torch.equal(candidate_scale(abs_mean, 0.0), torch.ones_like(abs_mean))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_awq_at_alpha_zero_stores_int4_bit_for_bit(dtype):
    """AWQ's rounding is int4's (a float minimum per group), in AWQ's packing: the same weights."""
    w = _q4_1_grid(96, 64, torch.Generator().manual_seed(1)).to(dtype)
    awq, int4 = (cfg.get_quant_method("linear", "w") for cfg in (AWQConfig(32), Int4Config(32)))
    by_awq = awq.runtime(awq.quantize(w, "w"), dtype, "w", dense_copy=False).dequantize()
    by_int4 = int4.runtime(int4.quantize(w, "w"), dtype, "w", dense_copy=False).dequantize()
    assert torch.equal(by_awq, by_int4)
    if dtype == torch.float32:  # (and G32 holds a Q4_1 grid; in bfloat16 to its rounding)
        torch.testing.assert_close(by_int4, w, atol=1e-6, rtol=0)


@pytest.mark.skipif(not int4pack._layout_known(), reason="this CPU's int4 packing is unpacked by the kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_search_dequantizes_as_the_runtime(dtype):
    from kvflow.quant.formats import int4_per_group
    from kvflow.quant.int4 import dequantize_as_run

    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(2)).to(dtype)
    int4 = Int4Config(32).get_quant_method("linear", "w")
    run = int4.runtime(int4.quantize(w, "w"), dtype, "w", dense_copy=False).dequantize()
    assert torch.equal(dequantize_as_run(*int4_per_group(w, 32, "w"), 32, dtype), run)


def _runtime_weights(llm) -> dict[str, torch.Tensor]:
    model = llm.llm_engine.runner.model
    return {name: m.quant_runtime.dequantize() for name, m in model.named_modules() if hasattr(m, "quant_runtime")}


def _prompt_logprobs(llm) -> list[float]:
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], PROMPT["prompt_token_ids"][1:])]


def test_awq_with_only_alpha_zero_is_int4(tmp_path, monkeypatch):
    """A whole model: AWQ searching only α = 0 folds nothing and rounds as `-q int4` does, so every
    layer and the logits are identical; with the full grid it can only do better on its sample."""
    make_tiny_model("llama-mha-tied", tmp_path)
    write_tiny_tokenizer(tmp_path)  # AWQ calibrates on text
    monkeypatch.setattr("kvflow.quant.awq.ALPHAS", [0.0])
    kw = dict(dtype="bfloat16", disable_log_stats=True)
    awq, int4 = LLM(str(tmp_path), quantization="awq", **kw), LLM(str(tmp_path), quantization="int4", **kw)
    by_awq, by_int4 = _runtime_weights(awq), _runtime_weights(int4)
    assert by_awq.keys() == by_int4.keys() and len(by_awq) > 4
    for name in by_awq:
        assert torch.equal(by_awq[name], by_int4[name]), name
    assert _prompt_logprobs(awq) == _prompt_logprobs(int4)


def _autoawq_quantize(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """AutoAWQ's GEMM tensors for w [N, K] (integer zero point z, w ≈ (q − z)·s), and that w."""
    n, k = w.shape
    g = w.view(n, k // group, group)
    scale = ((g.amax(-1) - g.amin(-1)) / 15).clamp(min=1e-5)
    zero = (-g.amin(-1) / scale).round().clamp(0, 15)
    q = ((g / scale[..., None]).round() + zero[..., None]).clamp(0, 15)
    stored = {"qweight": _pack_awq(q.view(n, k).to(torch.int32).t()), "qzeros": _pack_awq(zero.to(torch.int32).t()),
              "scales": scale.t().contiguous()}
    return stored, ((q - zero[..., None]) * scale[..., None]).view(n, k)


def test_autoawq_checkpoint_with_integer_zero_points_loads(tmp_path):
    """Its config has no "embedding" (float) nor "zeros" (integer): qzeros are read, w = (q − z)·s."""
    make_tiny_model("llama-mha-tied", tmp_path / "float")
    out = tmp_path / "autoawq"
    out.mkdir()
    tensors, expected = {}, {}
    for name, t in load_file(str(tmp_path / "float" / "model.safetensors")).items():
        if name.endswith("_proj.weight"):
            stored, expected[name] = _autoawq_quantize(t.float(), 32)
            tensors |= {name.replace(".weight", f".{key}"): v for key, v in stored.items()}
        else:
            tensors[name] = t
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(out / "model.safetensors"))
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                     "version": "gemm"}
    (out / "config.json").write_text(json.dumps(config))
    llm = LLM(str(out), dtype="float32", skip_tokenizer_init=True, disable_log_stats=True)
    weights = _runtime_weights(llm)
    for layer in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        parts = {"self_attn.qkv_proj": ["q_proj", "k_proj", "v_proj"], "mlp.gate_up_proj": ["gate_proj", "up_proj"]}
        prefix = f"model.layers.1.{layer.split('.')[0]}."
        want = torch.cat([expected[f"{prefix}{p}.weight"] for p in parts.get(layer, [layer.split(".")[1]])])
        # (the runtime sums (q − 8)·s + (8 − z)·s: float32's rounding, not the same bits)
        torch.testing.assert_close(weights[f"model.layers.1.{layer}"], want, atol=1e-6, rtol=0, msg=layer)
    assert all(torch.isfinite(torch.tensor(_prompt_logprobs(llm))))
