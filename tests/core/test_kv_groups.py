"""The scheduler and the KV manager with several KV groups (full and sliding-window), against a
simulated cache that records what each slot holds.

Every step writes each scheduled token's "content" (the token prefix ending at it) into its slot
in every group, executes the step's swaps and copy-on-write copies, and checks that every key a
query may see (all earlier positions, or the last `window` of them) holds the right content:
the checks fail if a block is shared wrongly, freed too early, evicted while in use or restored
to the wrong place. Block counts of sliding groups must stay within their bound.
"""

from __future__ import annotations

import random

import pytest

from kvflow.config import SchedulerConfig
from kvflow.core.block_pool import BlockPool
from kvflow.core.kv_cache_manager import NULL_BLOCK, KVCacheManager
from kvflow.core.request import Request
from kvflow.core.scheduler import Scheduler
from kvflow.sampling_params import SamplingParams

BLOCK, BUDGET, STEPS = 4, 16, 32


class SimulatedCache:
    def __init__(self) -> None:
        self.device: dict[tuple[int, int], tuple] = {}  # (block, offset) → content
        self.host: dict[int, dict[int, tuple]] = {}

    def apply(self, out) -> None:
        for device, host in out.swap_out:
            self.host[host] = {o: v for (b, o), v in self.device.items() if b == device}
        for source, dest in out.block_copies:
            for (b, o), v in list(self.device.items()):
                if b == source:
                    self.device[(dest, o)] = v
        for device, host in out.swap_in:
            for o, v in self.host[host].items():
                self.device[(device, o)] = v

    def run_chunk(self, chunk, tokens: list[int], windows) -> None:
        end = chunk.start_pos + chunk.num_tokens
        for table, window in zip(chunk.block_ids, windows):
            for pos in range(chunk.start_pos, end):
                assert table[pos // BLOCK] != NULL_BLOCK, f"{chunk.request_id} writes position {pos} into a freed block"
                self.device[(table[pos // BLOCK], pos % BLOCK)] = tuple(tokens[:pos + 1])
            for query in range(chunk.start_pos, end):
                for key in range(0 if window is None else max(0, query - window + 1), query + 1):
                    block = table[key // BLOCK]
                    held = self.device.get((block, key % BLOCK)) if block != NULL_BLOCK else None
                    assert held == tuple(tokens[:key + 1]), \
                        f"{chunk.request_id}: query {query} reads a wrong key {key} (window {window})"


def _run(windows: tuple, num_blocks: int, mode: str, seed: int) -> tuple[int, int]:
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, BLOCK, True, windows)
    host = BlockPool(64, enable_caching=False) if mode == "swap" else None
    scheduler = Scheduler(SchedulerConfig(BUDGET, 8, "fcfs", mode), kv, 1000, host)
    base = [rng.randrange(50) for _ in range(40)]
    prompts = [base, [rng.randrange(50) for _ in range(27)], base[:24] + [rng.randrange(50) for _ in range(12)],
               base[:27]]  # the last: a prefix of another prompt, so a whole-prompt hit with a copy
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=STEPS, prompt_logprobs=0 if i == 1 else None, ignore_eos=True)
        scheduler.add_request(Request(str(i), prompt, params, STEPS, frozenset()))
    cache = SimulatedCache()
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        cache.apply(out)
        for chunk in out.chunks:
            cache.run_chunk(chunk, scheduler.requests[chunk.request_id].all_token_ids, windows)
            for table, window in zip(chunk.block_ids, windows):
                if window is not None:  # live blocks: the window's and the chunk's
                    live = sum(b != NULL_BLOCK for b in table)
                    assert live <= -(-(window - 1 + chunk.num_tokens) // BLOCK) + 1
        scheduler.update_from_output(out, {c.request_id: [7] for c in out.chunks if c.sample})
    assert kv.usage == 0.0
    return scheduler.num_preemptions_total, kv.prefix_cache_hits


@pytest.mark.parametrize("windows", [(None,), (8,), (8, None), (8, 8, None)])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_every_read_sees_what_was_written(windows, mode):
    need = KVCacheManager(1, BLOCK, sliding_windows=windows).max_blocks_held(40 + STEPS, BUDGET)
    preemptions = hits = 0
    for seed in range(3):
        for extra in (0, 3, 10, 60):
            p, h = _run(windows, need + extra, mode, seed)
            preemptions, hits = preemptions + p, hits + h
    assert preemptions and hits  # the runs took the paths they are meant to check


def test_sliding_group_holds_its_window_while_a_full_group_grows():
    kv = KVCacheManager(64, BLOCK, True, (8, None))
    request = Request("a", list(range(3)), SamplingParams(max_tokens=200), 200, frozenset())
    for position in range(100):
        assert kv.allocate_slots(request, position, 1)
        request.num_computed_tokens = position + 1
        sliding, full = kv.block_ids("a")
        assert sum(b != NULL_BLOCK for b in sliding) <= -(-8 // BLOCK) + 1
        assert len(full) == position // BLOCK + 1
    assert kv.pool.num_blocks - kv.pool.num_free_blocks == len(full) + sum(b != NULL_BLOCK for b in sliding)
