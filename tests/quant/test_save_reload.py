"""`kvflow quantize` writes a checkpoint that loads without re-quantizing and gives the same
logits as quantizing at load."""

from __future__ import annotations

import json

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.entrypoints.cli import main
from tiny_models import make_tiny_model

PROMPTS = [[1, 5, 9, 22, 40, 3, 7, 8], [11, 12]]
PARAMS = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=3, logprobs=3, ignore_eos=True)


def _run(path, **kw):
    llm = LLM(str(path), skip_tokenizer_init=True, disable_log_stats=True, dtype="float32", **kw)
    return [(o.outputs[0].token_ids, o.prompt_logprobs[1:], o.outputs[0].logprobs)
            for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)], llm


@pytest.mark.parametrize("method", ["int8", "int4", "fp8", "mxfp4", "w8a8"])
def test_saved_checkpoint_reloads_with_identical_logits(method, tmp_path):
    make_tiny_model("qwen2-bias", tmp_path / "float")  # q/k/v biases and a tied head
    assert main(["quantize", str(tmp_path / "float"), str(tmp_path / "q"), "--method", method]) == 0
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == method
    at_load, _ = _run(tmp_path / "float", quantization=method)
    reloaded, llm = _run(tmp_path / "q")
    assert reloaded == at_load
    model = llm.llm_engine.runner.model
    assert not any(p.is_floating_point() and p.dim() == 2 and "proj" in n for n, p in model.named_parameters())


def test_group_size_is_recorded_and_a_mismatch_is_refused(tmp_path):
    make_tiny_model("llama-mqa", tmp_path / "float")
    main(["quantize", str(tmp_path / "float"), str(tmp_path / "q"), "--method", "int4", "--group-size", "32"])
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"] == {
        "quant_method": "int4", "group_size": 32}
    with pytest.raises(ValueError, match="already quantized with 'int4'"):
        LLM(str(tmp_path / "q"), skip_tokenizer_init=True, quantization="int8")


def test_group_size_that_does_not_divide_names_the_layer(tmp_path):
    make_tiny_model("llama-mqa", tmp_path)  # hidden 64
    with pytest.raises(ValueError, match=r"model.embed_tokens: group size 128 does not divide its 64 input channels"):
        LLM(str(tmp_path), skip_tokenizer_init=True, quantization="int4", group_size=128)


def test_unknown_method_is_named(tmp_path):
    make_tiny_model("llama-mqa", tmp_path)
    with pytest.raises(ValueError, match="quantization must be one of int8, int4"):
        LLM(str(tmp_path), skip_tokenizer_init=True, quantization="int3")
