"""The CPU KV-write op (attention/cpu_kv_write.py) against torch's index_put path of write_kv:
the same bits in the pool (a copy), negative slots skipped, a slot past the pool refused before
anything is written, and the switch back to torch."""

from __future__ import annotations

import pytest
import torch

from kvflow.attention import cpu_kv_write
from kvflow.attention.metadata import AttentionMetadata, write_kv

BLOCKS, KV_HEADS, BLOCK_SIZE, DIM = 6, 3, 4, 18


def meta_for(slots: list[int]) -> AttentionMetadata:
    n = len(slots)
    return AttentionMetadata(query_start_loc=torch.tensor([0, n]), seq_lens=torch.tensor([n]),
                             block_tables=torch.zeros(1, 1, dtype=torch.long), slot_mapping=torch.tensor(slots),
                             block_size=BLOCK_SIZE, query_lens_cpu=[n], seq_lens_cpu=[n])


def projections(tokens: int, dtype: torch.dtype):
    """k and v as the attention front hands them over: strided views of one qkv output."""
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (2 + 2 * KV_HEADS) * DIM, generator=gen).to(dtype)
    _, k, v = qkv.split([2 * DIM, KV_HEADS * DIM, KV_HEADS * DIM], -1)
    return k.unflatten(-1, (KV_HEADS, DIM)), v.unflatten(-1, (KV_HEADS, DIM))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [[5], [0, 1, 2, 3, 4, 23], [9, -1, 13, -1, 20, 2, 3]])
def test_op_writes_the_bits_torch_writes(slots, dtype, monkeypatch):
    k, v = projections(len(slots), dtype)
    pools = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(cpu_kv_write.DISABLE_ENV, switch)
        pool = torch.full((2, BLOCKS, KV_HEADS, BLOCK_SIZE, DIM), float("nan"), dtype=dtype)
        write_kv(k, v, pool, meta_for(slots))
        pools[switch] = pool
    assert cpu_kv_write.load_writer() is None  # "0": the torch path wrote the second pool
    written = pools["1"][~pools["1"].isnan()]
    assert written.numel() == 2 * sum(s >= 0 for s in slots) * KV_HEADS * DIM  # nothing else touched
    assert torch.equal(pools["1"].nan_to_num(7.0), pools["0"].nan_to_num(7.0))


def test_op_is_taken_for_a_cpu_pool(monkeypatch):
    monkeypatch.setenv(cpu_kv_write.DISABLE_ENV, "1")
    k, v = projections(2, torch.float32)
    pool = torch.zeros(2, BLOCKS, KV_HEADS, BLOCK_SIZE, DIM)
    assert cpu_kv_write.try_write(k, v, pool, torch.tensor([0, 5]))
    assert not cpu_kv_write.try_write(k, v, pool.bfloat16(), torch.tensor([0, 5]))  # a cast: torch's
    assert torch.equal(pool[1, 1, :, 1], v[1])


def test_a_slot_past_the_pool_is_refused_and_nothing_is_written(monkeypatch):
    monkeypatch.setenv(cpu_kv_write.DISABLE_ENV, "1")
    k, v = projections(2, torch.float32)
    pool = torch.zeros(2, BLOCKS, KV_HEADS, BLOCK_SIZE, DIM)
    with pytest.raises(RuntimeError, match=f"slot {BLOCKS * BLOCK_SIZE} is past the pool of {BLOCKS * BLOCK_SIZE}"):
        cpu_kv_write.try_write(k, v, pool, torch.tensor([0, BLOCKS * BLOCK_SIZE]))
    assert not pool.any()
