"""What the KV-shrinking layouts buy, measured on the engine: a sliding window bounds the blocks a
long generation holds; layers that share KV shrink the pool and still match their reference."""

from __future__ import annotations

import pytest
import torch
import transformers
from hf_oracle import assert_matches_oracle
from tiny_models import COMMON

from kvflow import LLM, SamplingParams
from kvflow.config import EngineArgs
from kvflow.engine.llm_engine import LLMEngine

WINDOW, BLOCK = 64, 16


def test_a_long_generation_holds_only_its_window(tmp_path):
    small = {**COMMON, "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 32, "max_position_embeddings": 4096}
    config = transformers.MistralConfig(**small, num_attention_heads=2, num_key_value_heads=1, sliding_window=WINDOW)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    # 8 blocks hold 128 positions: far fewer than the 2,005 this request reaches.
    engine = LLMEngine(EngineArgs(str(tmp_path), dtype="float32", skip_tokenizer_init=True, block_size=BLOCK,
                                  num_kv_blocks=8, disable_log_stats=True))
    engine.add_request("long", list(range(5)), SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))
    pool, held, outputs = engine.scheduler.kv_cache.pool, [], []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        held.append(pool.num_blocks - pool.num_free_blocks)
    assert len(outputs[-1].outputs[0].token_ids) == 2000
    assert max(held[1:]) <= -(-WINDOW // BLOCK) + 1  # after the prompt step: the window's blocks and one more


def _shared_kv_oracle(hf, first_shared: int) -> None:
    """Make transformers' Llama read layer first_shared - 1's keys and values in every later layer:
    the plain-torch definition of cross-layer KV sharing."""
    layers = hf.model.layers
    kept = {}
    for name in ("k_proj", "v_proj"):
        getattr(layers[first_shared - 1].self_attn, name).register_forward_hook(
            lambda module, args, out, name=name: kept.__setitem__(name, out))
        for layer in layers[first_shared:]:
            getattr(layer.self_attn, name).register_forward_hook(lambda module, args, out, name=name: kept[name])


@pytest.mark.parametrize("backend", ["torch_reference", "torch_sdpa"])
def test_cross_layer_kv_sharing_matches_its_reference_and_halves_the_pool(backend, tmp_path):
    config = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 4}, num_attention_heads=4, num_key_value_heads=2,
                                      num_kv_shared_layers=2)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    hf.save_pretrained(tmp_path)  # k/v projections of the sharing layers are saved too, and ignored
    _shared_kv_oracle(hf, first_shared=2)
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, attention_backend=backend, block_size=4,
              max_num_batched_tokens=16, num_kv_blocks=40)
    layout = llm.llm_engine.arch.kv_layout
    assert layout.block_bytes(1, 4) == 2 * 2 * 2 * 16 * 4  # 2 of 4 layers keep K and V of 2 heads of 16
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (30, 7)]
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert_matches_oracle(hf, prompt, out, 32)
