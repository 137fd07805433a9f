"""load_format="dummy": a real shape from config.json alone, weights drawn where they live."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import COMMON

from kvflow import LLM, SamplingParams

CONFIG = {**COMMON, "architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 2,
          "tie_word_embeddings": False, "rope_theta": 10000.0}


@pytest.fixture
def config_only_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return tmp_path


def test_dummy_weights_need_only_config_json(config_only_dir):
    llm = LLM(str(config_only_dir), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", device="cpu")
    model = llm.llm_engine.runner.model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # built in bf16, never cast from fp32
    assert model.model.rotary.cos.dtype == torch.float32  # RoPE tables stay exact
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert all(bool((p == 1).all()) for p in norms)
    weights = model.model.layers[0].self_attn.qkv_proj.weight.float()
    assert 0.015 < weights.std().item() < 0.025
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_same_seed_same_dummy_weights(config_only_dir):
    def first_weight(seed):
        llm = LLM(str(config_only_dir), load_format="dummy", skip_tokenizer_init=True, device="cpu", seed=seed)
        return llm.llm_engine.runner.model.model.embed_tokens.weight.clone()

    assert torch.equal(first_weight(3), first_weight(3))
    assert not torch.equal(first_weight(3), first_weight(4))


def test_real_weights_are_still_required_without_dummy(config_only_dir):
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(config_only_dir), skip_tokenizer_init=True, device="cpu")
