"""Calibration's folds (quant/calibration.py) keep the model's function: W·diag(s) with its input
divided by s at the source gives the same logits, for every architecture that has the layers
folded (Gemma's MLP input comes from `pre_feedforward_layernorm`, not `post_attention_layernorm`),
and the layers no fold reaches (latent attention, experts) are left alone, not an error."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model, write_tiny_tokenizer

from kvflow import LLM, SamplingParams
from kvflow.quant.awq import AWQMethod
from kvflow.quant.online import CalibratedMethod

PROMPT = {"prompt_token_ids": [3, 17, 42, 8, 61, 5, 29, 77, 12, 40, 2, 33]}


def _prompt_logprobs(path, monkeypatch, scale) -> torch.Tensor:
    """AWQ's calibration with its search replaced by `scale` and its rounding by nothing: only the
    folds change the model."""
    gen = torch.Generator().manual_seed(0)
    monkeypatch.setattr(AWQMethod, "search_scale", lambda self, w, inputs, name: (scale(w.shape[1], gen), 0.0))
    monkeypatch.setattr(CalibratedMethod, "finish_calibration", lambda self, layer, inputs: None)
    llm = LLM(str(path), dtype="float32", quantization="awq", disable_log_stats=True)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return torch.tensor([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], PROMPT["prompt_token_ids"][1:])])


@pytest.mark.parametrize("arch", ["llama-mha-tied", "gemma3", "mixtral", "deepseek-v2"])
def test_folded_scales_keep_the_logits(arch, tmp_path, monkeypatch):
    make_tiny_model(arch, tmp_path)
    write_tiny_tokenizer(tmp_path)
    unscaled = _prompt_logprobs(tmp_path, monkeypatch, lambda k, gen: torch.ones(k))
    scaled = _prompt_logprobs(tmp_path, monkeypatch, lambda k, gen: torch.exp(torch.randn(k, generator=gen)))
    torch.testing.assert_close(scaled, unscaled, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama-mha-tied", "gemma3"])
def test_each_search_sees_the_weight_it_stores(arch, tmp_path, monkeypatch):
    """o_proj's and down_proj's folds rescale rows of qkv_proj and gate_up_proj: searched before
    them, those layers were scored on weights they did not store. Every search's weight, times the
    scale it chose, is what the layer is rounded from."""
    make_tiny_model(arch, tmp_path)
    write_tiny_tokenizer(tmp_path)
    gen, searched, rounded = torch.Generator().manual_seed(0), {}, {}

    def search(self, w, inputs, name):
        scale = torch.exp(torch.randn(w.shape[1], generator=gen))
        searched[name] = w * scale  # float32: as the fold's mul_ computes it
        return scale, 0.0

    monkeypatch.setattr(AWQMethod, "search_scale", search)
    monkeypatch.setattr(CalibratedMethod, "finish_calibration",
                        lambda self, layer, inputs: rounded.update({layer.prefix: layer.weight.data.clone()}))
    LLM(str(tmp_path), dtype="float32", quantization="awq", disable_log_stats=True)
    assert any("down_proj" in name for name in searched) and any("gate_up_proj" in name for name in searched)
    for name, weight in searched.items():
        assert torch.equal(weight, rounded[name]), name
