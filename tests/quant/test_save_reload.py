"""`kvflow quantize` writes a checkpoint that loads without re-quantizing and gives the same
logits as quantizing at load."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import make_tiny_model

from kvflow import LLM, SamplingParams
from kvflow.entrypoints.cli import main
from kvflow.quant.awq import AWQConfig
from kvflow.quant.calibration import InputStats
from kvflow.quant.w8a8 import W8A8Config

PROMPTS = [[1, 5, 9, 22, 40, 3, 7, 8], [11, 12]]
PARAMS = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=3, logprobs=3, ignore_eos=True)


def _run(path, **kw):
    llm = LLM(str(path), skip_tokenizer_init=True, disable_log_stats=True, dtype="float32", **kw)
    return [(o.outputs[0].token_ids, o.prompt_logprobs[1:], o.outputs[0].logprobs)
            for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)], llm


@pytest.mark.parametrize("method", ["int8", "int4", "fp8", "mxfp4"])  # (awq and w8a8 calibrate: below)
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


def _char_tokenizer(directory, vocab_size: int) -> None:
    """A character-level tokenizer (ids < vocab_size), so AWQ can read its calibration text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:'!?-\n"
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars[:vocab_size - 1])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.save(str(directory / "tokenizer.json"))


@pytest.mark.parametrize("method, recorded", [
    ("awq", {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
             "embedding": "int8", "zeros": "float"}),
    ("w8a8", {"quant_method": "w8a8"}),
    ("fp8", {"quant_method": "fp8"}),
])
def test_calibrated_method_reloads_without_calibrating_again(method, recorded, tmp_path):
    """AWQ and w8a8 (SmoothQuant) fold calibration's scales into the norms and rows that feed each
    layer before rounding it, fp8 rounds by its inputs (GPTQ): the saved checkpoint holds the
    result, and reloads to the same numbers as calibrating at load."""
    make_tiny_model("llama-mha-tied", tmp_path / "float")  # one value head per query head: o_proj is scaled too
    _char_tokenizer(tmp_path / "float", 97)
    assert main(["quantize", str(tmp_path / "float"), str(tmp_path / "q"), "--method", method]) == 0
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert config == recorded
    prompts = [{"prompt_token_ids": list(range(1, 60))}]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def nll(path, **kw):
        llm = LLM(str(path), dtype="float32", disable_log_stats=True, **kw)
        out = llm.generate(prompts, params, use_tqdm=False)[0]
        return -sum(lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompts[0]["prompt_token_ids"][1:]))

    assert nll(tmp_path / "q") == nll(tmp_path / "float", quantization=method)


def _outlier_inputs():
    """Weights and inputs whose first 4 channels are 20× the others, as calibration would see them."""
    torch.manual_seed(0)
    w, x = torch.randn(256, 128), torch.randn(512, 128)
    x[:, :4] *= 20
    return w, x, InputStats(x.abs().mean(0), x)


def test_awq_search_protects_salient_channels():
    """Inputs with a few large channels: the searched scale beats plain rounding (α = 0) on the
    layer's output error as stored (quantize, then the runtime's weights), and never loses to it
    (α = 0 is in the grid)."""
    w, x, inputs = _outlier_inputs()
    method = AWQConfig(32).get_quant_method("linear", "w")
    s, alpha = method.search_scale(w, inputs, "w")

    def error(scale):
        run = method.runtime(method.quantize(w * scale, "w"), torch.float32, "w", dense_copy=False)
        return (x @ (run.dequantize() / scale).t() - x @ w.t()).pow(2).mean().item()

    assert alpha > 0 and error(s) < 0.8 * error(torch.ones(128))


def test_smoothquant_search_moves_outliers_into_the_weights():
    """w8a8 on inputs with a few large channels: per-token int8 rounds the small channels to a
    few levels; the searched smoothing beats no smoothing (which is among the candidates)."""
    from kvflow.quant.formats import int8_per_channel
    from kvflow.quant.w8a8 import quantize_rows

    w, x, inputs = _outlier_inputs()
    s, alpha = W8A8Config().get_quant_method("linear", "w").search_scale(w, inputs, "w")

    def error(scale):
        q, w_scale = int8_per_channel(w * scale, "w")
        xq, x_scale = quantize_rows(x / scale)
        return ((xq.float() @ q.float().t()) * x_scale * w_scale - x @ w.t()).pow(2).mean().item()

    assert alpha >= 0 and error(s) < 0.5 * error(torch.ones(128))


def test_group_size_is_recorded_and_a_mismatch_is_refused(tmp_path):
    make_tiny_model("llama-mqa", tmp_path / "float")
    main(["quantize", str(tmp_path / "float"), str(tmp_path / "q"), "--method", "int4", "--group-size", "32"])
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"] == {
        "quant_method": "int4", "group_size": 32}
    with pytest.raises(ValueError, match="already quantized with 'int4'"):
        LLM(str(tmp_path / "q"), skip_tokenizer_init=True, quantization="int8")


def test_group_size_that_does_not_divide_names_the_layer(tmp_path):
    make_tiny_model("llama-mqa", tmp_path)  # hidden 64
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.qkv_proj: group size 128 does not divide its 64"):
        LLM(str(tmp_path), skip_tokenizer_init=True, quantization="int4", group_size=128)


def test_unknown_method_is_named(tmp_path):
    make_tiny_model("llama-mqa", tmp_path)
    with pytest.raises(ValueError, match="quantization must be one of int8, int4"):
        LLM(str(tmp_path), skip_tokenizer_init=True, quantization="int3")


@pytest.mark.parametrize("method", ["awq", "w8a8"])
def test_calibrated_methods_refuse_what_they_cannot_calibrate(method, tmp_path):
    """Without a tokenizer there is no calibration text; under tensor parallelism each rank would
    see its own slices. Both are refused before any worker starts, with the way out named."""
    from kvflow.config import EngineArgs
    from kvflow.engine.llm_engine import LLMEngine

    make_tiny_model("llama-mha-tied", tmp_path)
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        LLMEngine(EngineArgs(str(tmp_path), quantization=method, skip_tokenizer_init=True))
    _char_tokenizer(tmp_path, 97)
    with pytest.raises(ValueError, match=f"kvflow quantize MODEL OUT --method {method}"):
        LLMEngine(EngineArgs(str(tmp_path), quantization=method, tensor_parallel_size=2))


def test_fp8_rounds_to_nearest_where_it_cannot_calibrate(tmp_path, caplog):
    """fp8 without a tokenizer still loads, as vLLM's does, its weights rounded to nearest (the
    uncalibrated E4M3 codes), and says so; with one, calibration's rounding differs from that."""
    from kvflow.quant.formats import fp8_per_channel

    make_tiny_model("llama-mha-tied", tmp_path)
    float_weight = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, disable_log_stats=True
                       ).llm_engine.runner.model.model.layers[0].mlp.down_proj.weight.data.clone()
    nearest = fp8_per_channel(float_weight, "down_proj")[0]
    with caplog.at_level("WARNING", logger="kvflow"):
        llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, quantization="fp8", disable_log_stats=True)
    assert "rounding its weights to nearest" in caplog.text
    codes = llm.llm_engine.runner.model.model.layers[0].mlp.down_proj.weight
    assert torch.equal(codes.view(torch.uint8), nearest.view(torch.uint8))
    _char_tokenizer(tmp_path, 97)
    calibrated = LLM(str(tmp_path), dtype="float32", quantization="fp8", disable_log_stats=True)
    codes = calibrated.llm_engine.runner.model.model.layers[0].mlp.down_proj.weight
    assert codes.dtype == torch.float8_e4m3fn and not torch.equal(codes.view(torch.uint8), nearest.view(torch.uint8))
