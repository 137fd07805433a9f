"""Every attention backend against the torch reference, on random paged batches."""

from __future__ import annotations

import random
import re

import pytest
import torch
from tiny_models import make_tiny_model

from kvflow import LLM, SamplingParams
from kvflow.attention.metadata import AttentionLayerSpec, AttentionMetadata
from kvflow.attention.torch_reference import TorchReferenceBackend
from kvflow.attention.torch_sdpa import TorchSDPABackend


def random_batch(seed: int, block_size: int, heads: int, kv_heads: int, dtype, window: int | None):
    """A mixed batch (fresh prompts, chunks after a cached prefix, decodes, verifications of 4
    tokens) over shuffled blocks,
    with the cached part of every context already written."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dim = 32
    cases = [(0, rng.randint(2, 40)), (rng.randint(1, 50), rng.randint(2, 20))] + \
            [(rng.randint(1, 90), 1) for _ in range(rng.randint(1, 6))] + [(0, 1)] + \
            [(rng.randint(1, 70), 4) for _ in range(rng.randint(1, 3))]  # speculative verifications
    rng.shuffle(cases)
    total_blocks = sum(-(-(c + n) // block_size) for c, n in cases) + 5
    physical = list(range(total_blocks))
    rng.shuffle(physical)
    cache = torch.randn(2, total_blocks, kv_heads, block_size, dim, generator=gen).to(dtype)
    tables, slots = [], []
    for cached, new in cases:
        table = [physical.pop() for _ in range(-(-(cached + new) // block_size))]
        tables.append(table)
        for p in range(cached, cached + new):
            slots.append(table[p // block_size] * block_size + p % block_size)
    width = max(len(t) for t in tables)
    query_lens = [n for _, n in cases]
    qsl = torch.tensor([0] + query_lens).cumsum(0)
    meta = AttentionMetadata(
        query_start_loc=qsl, seq_lens=torch.tensor([c + n for c, n in cases]),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        slot_mapping=torch.tensor(slots), block_size=block_size,
        query_lens_cpu=query_lens, seq_lens_cpu=[c + n for c, n in cases],
    )
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
    return q, k, v, cache, meta, AttentionLayerSpec(heads, kv_heads, dim, dim**-0.5, window)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 7])
def test_sdpa_backend_matches_reference_fp32(seed, block_size, heads, kv_heads, window):
    q, k, v, cache, meta, layer = random_batch(seed, block_size, heads, kv_heads, torch.float32, window)
    ref_cache = cache.clone()
    expected = TorchReferenceBackend().forward(q, k, v, ref_cache, meta, layer)
    got = TorchSDPABackend().forward(q, k, v, cache, meta, layer)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    assert torch.equal(cache, ref_cache)  # both wrote the new K/V into the same slots


@pytest.mark.parametrize("seed", range(4))
def test_sdpa_backend_matches_reference_bf16(seed):
    q, k, v, cache, meta, layer = random_batch(seed, 16, 8, 2, torch.bfloat16, None)
    expected = TorchReferenceBackend().forward(q, k, v, cache.clone(), meta, layer).float()
    got = TorchSDPABackend().forward(q, k, v, cache, meta, layer).float()
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)  # bf16 has 8 bits of mantissa


def test_the_triton_backend_on_cpu_advises_a_backend_that_runs(tmp_path, monkeypatch):
    """Outside the test suite (no interpreter fixed up by conftest), the advice for a CPU machine
    asking for the triton backend must be one that works when followed: a CPU backend, not
    TRITON_INTERPRET=1, which crashes in triton's interpreter without tests/conftest.py's fixes."""
    pytest.importorskip("triton")
    # Imported under the suite's interpreter first: the kernels are decorated at import, and a
    # later test must not inherit kernels built for a GPU this machine lacks.
    import kvflow.attention.triton_backend  # noqa: F401

    make_tiny_model("llama-gqa-llama3-rope", tmp_path)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    engine = dict(dtype="float32", skip_tokenizer_init=True, device="cpu", num_kv_blocks=16, block_size=16)
    prompt = [{"prompt_token_ids": list(range(1, 20))}]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU") as refused:
        LLM(str(tmp_path), attention_backend="triton", **engine).generate(prompt, greedy, use_tqdm=False)
    assert "TRITON_INTERPRET" not in str(refused.value)
    advised = re.findall(r"attention_backend='(\w+)'", str(refused.value))
    assert advised
    reference = LLM(str(tmp_path), attention_backend="torch_reference", **engine).generate(prompt, greedy, use_tqdm=False)
    for backend in advised:
        followed = LLM(str(tmp_path), attention_backend=backend, **engine).generate(prompt, greedy, use_tqdm=False)
        assert followed[0].outputs[0].token_ids == reference[0].outputs[0].token_ids
