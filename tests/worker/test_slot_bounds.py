"""A position outside its request's block table is never written silently: the runner refuses
the chunk (an assert, on in every test run), and a negative slot — what such a position maps to,
and a padded row of a captured graph — writes nothing in the torch backends."""

from __future__ import annotations

import pytest
import torch

from kvflow.attention.metadata import AttentionMetadata, write_kv
from kvflow.core.sched_output import ScheduledChunk
from kvflow.sampling_params import SamplingParams
from kvflow.worker.model_runner import ModelRunner


def _chunk(rid: str, start: int, num: int, blocks: list[int]) -> ScheduledChunk:
    return ScheduledChunk(rid, list(range(1, num + 1)), start, (blocks,), True, SamplingParams(), [1] * (start + num),
                          [], frozenset())


def _runner() -> ModelRunner:
    return ModelRunner(None, [], block_size=4, device="cpu", seed=0)


def test_slots_follow_the_block_table_and_reads_pad_with_block_zero():
    batch = _runner().prepare([_chunk("a", 0, 6, [7, 3]), _chunk("b", 2, 1, [5])])
    [attn] = batch.attn  # one KV group
    assert attn.slot_mapping.tolist() == [28, 29, 30, 31, 12, 13, 22]
    assert attn.block_tables.tolist() == [[7, 3], [5, 0]]


def test_a_chunk_past_its_block_table_is_refused():
    with pytest.raises(AssertionError, match="past its block table"):
        _runner().prepare([_chunk("a", 0, 9, [7, 3]), _chunk("b", 0, 12, [1, 2, 4])])


def test_a_negative_slot_writes_nothing():
    cache = torch.zeros(2, 3, 1, 4, 2)  # [k/v, blocks, heads, block_size, dim]
    k = torch.arange(1, 7, dtype=torch.float32).view(3, 1, 2)
    meta = AttentionMetadata(torch.tensor([0, 3]), torch.tensor([3]), torch.tensor([[1]]),
                             torch.tensor([4, -1, 6]), 4, [3], [3])
    write_kv(k, -k, cache, meta)
    assert cache[0, 1, 0].tolist() == [[1, 2], [0, 0], [5, 6], [0, 0]]
    assert cache[1, 1, 0, 2].tolist() == [-5, -6]
    assert cache[:, 0].abs().sum() == 0 and cache[:, 2].abs().sum() == 0  # -1 did not wrap to the last block
