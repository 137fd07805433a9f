"""The rotations (quant/rotation.py) keep the model's function: the rotated float model's logits are
the unrotated one's (float32, to 1e-4) for a tied head, grouped KV heads with llama3 RoPE, and a
q/k/v bias; what they are for, rotated activations lose less to per-token rounding when a few
channels carry outliers; and families they do not reach are refused by name."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model, write_tiny_tokenizer

from kvflow import LLM, SamplingParams
from kvflow.quant.hadamard import HadamardTransform
from kvflow.quant.unquantized import UnquantizedMethod
from kvflow.quant.w4a import W4AMethod, int4_symmetric, quantize_rows

PROMPT = {"prompt_token_ids": [3, 17, 42, 8, 61, 5, 29, 77, 12, 40, 2, 33]}


def _run(path, quantization):
    llm = LLM(str(path), dtype="float32", quantization=quantization, disable_log_stats=True)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=20)
    return llm.generate([PROMPT], params, use_tqdm=False)[0]


@pytest.mark.parametrize("arch", ["llama-mha-tied", "llama-gqa-llama3-rope", "qwen2-bias"])
def test_rotated_float_model_keeps_the_logits(arch, tmp_path, monkeypatch):
    """w4a8's load with its rounding replaced by the float product: only the rotation changes the
    model (norms folded, head untied, residual, value heads and down_proj's input rotated)."""
    make_tiny_model(arch, tmp_path)
    write_tiny_tokenizer(tmp_path)
    plain = _run(tmp_path, None)
    monkeypatch.setattr(W4AMethod, "process_weights_after_loading", lambda self, layer: None)
    monkeypatch.setattr(W4AMethod, "apply", lambda self, layer, x, bias=None: UnquantizedMethod().apply(layer, x, bias))
    rotated = _run(tmp_path, "w4a8")
    assert rotated.outputs[0].token_ids == plain.outputs[0].token_ids
    for want, got in zip(plain.prompt_logprobs[1:], rotated.prompt_logprobs[1:]):
        assert set(want) == set(got)
        torch.testing.assert_close(torch.tensor([got[t].logprob for t in want]),
                                   torch.tensor([want[t].logprob for t in want]), atol=1e-4, rtol=1e-4)


def test_rotation_lowers_the_activation_rounding_error_with_outlier_channels():
    """Activations with 4 of 576 channels 50× the rest (as LLM residual streams have), rounded per
    token to int4 as w4a4 does: through the Hadamard (weights rotated to cancel) the product's error
    is several times smaller than without it."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 576, generator=gen)
    x[:, [7, 100, 300, 511]] *= 50
    w = torch.randn(960, 576, generator=gen) * 0.05
    exact = x @ w.t()

    def rounded_product(xs: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
        xq, x_scale = quantize_rows(xs, 7)
        return (xq.float() * x_scale) @ ws.t()

    h = HadamardTransform(576)
    plain_err = (rounded_product(x, w) - exact).pow(2).mean()
    rotated_err = (rounded_product(h(x), h(w)) - exact).pow(2).mean()
    assert rotated_err < plain_err / 4


def test_rotation_lowers_the_weight_rounding_error_with_outlier_rows():
    """The same for the weights' per-channel int4 rounding, a few input channels of W large."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(960, 576, generator=gen) * 0.05
    w[:, [3, 200]] *= 30
    h = HadamardTransform(576)

    def error(ws: torch.Tensor) -> torch.Tensor:
        q, scale = int4_symmetric(ws, 576, "w")
        return (q.float() * scale - ws).pow(2).mean()

    assert error(h(w)) < error(w) / 4


def test_families_the_rotation_does_not_reach_are_refused(tmp_path):
    make_tiny_model("gemma3", tmp_path)
    write_tiny_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="rotation \\(w4a8/w4a4\\): .*layer 0 .*run it with --quantization int4"):
        LLM(str(tmp_path), dtype="float32", quantization="w4a4", disable_log_stats=True)
