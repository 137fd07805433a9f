"""The RoPE scalings of real checkpoints (yarn, with DeepSeek's mscale; longrope; dynamic NTK)
against transformers, float32, on the production path (torch_sdpa) and the torch reference.

yarn does not depend on the length: every prompt must match HF. longrope and dynamic do: kvflow
scales once for the engine's max_model_len (`kvflow.model.layers.rotary`), HF for each forward's
sequence. They agree where the choice does not change within max_model_len, and for a sequence of
max_model_len tokens; a shorter sequence under a longer max_model_len is rotated as HF rotates one
of max_model_len tokens (`_AtLength`), which is not how HF rotates the short one.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from hf_oracle import assert_matches_oracle
from tiny_models import ROPE_CONFIGS, make_tiny_model
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvflow import LLM, SamplingParams
from kvflow.model.arch_config import ArchConfig
from kvflow.model.layers.rotary import ROPE_TYPES, RotaryEmbedding, rope_frequencies
from kvflow.model.models import deepseek_v2

BACKENDS = ("torch_sdpa", "torch_reference")
LENGTH_FREE = ("qwen3-yarn", "mistral-yarn-untruncated", "deepseek-v3-yarn", "deepseek-v2-yarn", "gemma3-linear")
STEPS = 16


class _AtLength:
    """HF on the sequence padded to `length` tokens, its logits cut back: causal, so each row is
    what a forward of `length` tokens gives it (longrope and dynamic pick by that length)."""

    def __init__(self, hf, length: int) -> None:
        self.hf, self.length = hf, length

    def __call__(self, ids: torch.Tensor):
        pad = torch.zeros(1, self.length - ids.shape[1], dtype=ids.dtype)
        return SimpleNamespace(logits=self.hf(torch.cat([ids, pad], dim=1)).logits[:, :ids.shape[1]])


def _prompts(vocab: int, lengths) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _generate(path, backend: str, prompts, max_model_len: int | None = None):
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, attention_backend=backend, block_size=4,
              max_num_batched_tokens=64, max_model_len=max_model_len)
    params = SamplingParams(temperature=0, max_tokens=STEPS, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    return llm.generate(prompts, params)


def _arch(path) -> ArchConfig:
    return ArchConfig.from_hf(json.loads((path / "config.json").read_text()))


@pytest.mark.parametrize("name", sorted(ROPE_CONFIGS))
def test_frequencies_and_attention_factor_are_hfs(name, tmp_path):
    hf = make_tiny_model(name, tmp_path)
    arch, kind = _arch(tmp_path), hf.model.rotary_emb.rope_type
    head_dim = arch.mla.qk_rope_head_dim if arch.mla else arch.head_dim
    layer = {}
    if isinstance(kind, dict):  # Gemma 3: one RoPE per layer type; the scaled one is the global layers'
        kind, layer = kind["full_attention"], {"layer_type": "full_attention"}
    for length in (16, arch.max_position_embeddings):  # within and past longrope's / dynamic's original context
        ours, attention = rope_frequencies(head_dim, arch.rope_theta, arch.rope_scaling, length)
        theirs, their_attention = ROPE_INIT_FUNCTIONS[kind](hf.config, seq_len=length, **layer)
        torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=0)
        assert attention == pytest.approx(their_attention, rel=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", LENGTH_FREE)
def test_yarn_and_linear_match_transformers(name, backend, tmp_path):
    hf = make_tiny_model(name, tmp_path)
    if "yarn" in name:  # served: the stretched context, original x factor
        rope = hf.config.rope_parameters
        assert _arch(tmp_path).max_position_embeddings == rope["original_max_position_embeddings"] * rope["factor"]
    # Within and past the original context (for the Qwen3 one: 128, stretched to 512).
    prompts = _prompts(hf.config.vocab_size, (3, 40, 150))
    for prompt, out in zip(prompts, _generate(tmp_path, backend, prompts)):
        assert_matches_oracle(hf, prompt, out, STEPS)


def test_deepseek_softmax_mscale_is_checked(tmp_path, monkeypatch):
    """The oracle sees DeepSeek's mscale_all_dim correction: left out, the same run fails."""
    hf = make_tiny_model("deepseek-v3-yarn", tmp_path)
    scaling = _arch(tmp_path).rope_scaling  # mscale(factor, mscale_all_dim)² = (0.1·mscale_all_dim·ln factor + 1)²
    expected = (0.1 * scaling["mscale_all_dim"] * math.log(scaling["factor"]) + 1) ** 2
    assert deepseek_v2.yarn_softmax_mscale(scaling) == pytest.approx(expected, rel=1e-6)
    monkeypatch.setattr(deepseek_v2, "yarn_softmax_mscale", lambda scaling: 1.0)
    prompt = _prompts(hf.config.vocab_size, (40,))
    with pytest.raises(AssertionError):
        assert_matches_oracle(hf, prompt[0], _generate(tmp_path, "torch_sdpa", prompt)[0], STEPS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_longrope_short_factors_within_the_original_context(backend, tmp_path):
    hf = make_tiny_model("llama-longrope", tmp_path)  # original context 64 of 256
    prompts = _prompts(hf.config.vocab_size, (3, 17, 40))  # at most 56 tokens with the steps
    for prompt, out in zip(prompts, _generate(tmp_path, backend, prompts, max_model_len=64)):
        assert_matches_oracle(hf, prompt, out, STEPS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_longrope_long_factors_when_serving_past_it(backend, tmp_path):
    hf = make_tiny_model("llama-longrope", tmp_path)
    long, short = _prompts(hf.config.vocab_size, (100, 17))
    out_long, out_short = _generate(tmp_path, backend, [long, short])  # max_model_len 256
    assert_matches_oracle(hf, long, out_long, STEPS)  # 116 tokens > 64: HF takes the long factors too
    assert_matches_oracle(_AtLength(hf, 256), short, out_short, STEPS)
    with pytest.raises(AssertionError):  # HF itself rotates a 33-token sequence with the short ones
        assert_matches_oracle(hf, short, out_short, STEPS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dynamic_ntk_within_the_checkpoint_context(backend, tmp_path):
    hf = make_tiny_model("llama-dynamic", tmp_path)  # 64 positions declared, 128 served
    prompts = _prompts(hf.config.vocab_size, (3, 17, 40))
    for prompt, out in zip(prompts, _generate(tmp_path, backend, prompts, max_model_len=64)):
        assert_matches_oracle(hf, prompt, out, STEPS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dynamic_ntk_base_grown_once_for_max_model_len(backend, tmp_path):
    hf = make_tiny_model("llama-dynamic", tmp_path)
    prompts = _prompts(hf.config.vocab_size, (100, 17))
    outputs = _generate(tmp_path, backend, prompts)  # max_model_len 128: the base HF takes at 128 tokens
    # First, while HF's model has not grown its base past 116 (it keeps the largest it has seen).
    with pytest.raises(AssertionError):  # HF grows the base for 116 tokens only
        assert_matches_oracle(hf, prompts[0], outputs[0], STEPS)
    for prompt, out in zip(prompts, outputs):
        assert_matches_oracle(_AtLength(hf, 128), prompt, out, STEPS)


def test_unsupported_scalings_are_refused_by_name():
    with pytest.raises(ValueError, match=r"rope_type 'mrope' is not supported \(supported: " + ", ".join(ROPE_TYPES)):
        RotaryEmbedding(8, 16, 10000.0, {"rope_type": "mrope"})
    scaling = {"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 4,
               "original_max_position_embeddings": 8, "factor": 2.0}
    with pytest.raises(ValueError, match=r"rope_scaling.short_factor has 3 entries; expected head_dim / 2 = 4"):
        RotaryEmbedding(8, 16, 10000.0, scaling)


def _yarn_gguf(path, **extra) -> None:
    import gguf

    w = gguf.GGUFWriter(path, "qwen2")
    for add, value in [("block_count", 1), ("context_length", 128), ("embedding_length", 64),
                       ("feed_forward_length", 96), ("head_count", 4), ("head_count_kv", 2),
                       ("layer_norm_rms_eps", 1e-6), ("vocab_size", 16), ("rope_scaling_type", gguf.RopeScalingType.YARN),
                       ("rope_scaling_factor", 4.0), ("rope_scaling_orig_ctx_len", 32), *extra.items()]:
        getattr(w, f"add_{add}")(value)
    w.add_tensor("token_embd.weight", torch.zeros(16, 64).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_yarn_becomes_hfs_rope_scaling(tmp_path):
    from transformers import Qwen2Config

    from kvflow.model.loader.gguf import load_gguf

    _yarn_gguf(tmp_path / "yarn.gguf", rope_scaling_yarn_beta_fast=16.0, rope_scaling_yarn_beta_slow=2.0)
    config = load_gguf(tmp_path / "yarn.gguf", with_tokenizer=False).hf_config
    assert config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                      "beta_fast": 16.0, "beta_slow": 2.0}
    arch = ArchConfig.from_hf({**config, "architectures": ["Qwen2ForCausalLM"]})
    assert arch.max_position_embeddings == 128  # the file's context is already the stretched one
    theirs = ROPE_INIT_FUNCTIONS["yarn"](Qwen2Config(**{k: v for k, v in config.items() if k != "rope_scaling"},
                                                     rope_parameters={**config["rope_scaling"], "rope_theta": 10000.0}))
    ours = rope_frequencies(arch.head_dim, arch.rope_theta, arch.rope_scaling, 128)
    torch.testing.assert_close(ours[0], theirs[0], rtol=2e-6, atol=0)
    assert ours[1] == pytest.approx(theirs[1])

    _yarn_gguf(tmp_path / "log_mul.gguf", rope_scaling_yarn_log_mul=0.1)
    with pytest.raises(ValueError, match=r"qwen2.rope.scaling.yarn_log_multiplier is not supported"):
        load_gguf(tmp_path / "log_mul.gguf", with_tokenizer=False)
