from __future__ import annotations

import ctypes
import gc
import os
import threading
import time
import weakref
from types import SimpleNamespace

import pytest
import torch

from kvflow.config import CacheConfig, EngineArgs
from kvflow.core.sched_output import ScheduledChunk, SchedulerOutput
from kvflow.model.arch_config import ArchConfig
from kvflow.sampling_params import SamplingParams
from kvflow.worker import kv_cache
from kvflow.worker.kv_cache import (
    IdleGate,
    PagePopulator,
    allocate_kv_caches,
    num_kv_blocks,
    populate_in_background,
    zeros_untouched,
)
from kvflow.worker.worker import Worker

# SmolLM2-135M's shape: 30 layers, 3 KV heads of 64.
SMOLLM2 = ArchConfig.from_hf({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
})


def test_block_bytes_follow_the_kv_formula():
    # 2 (K and V) x 30 layers x 3 heads x 64 dims x 2 bytes = 23,040 bytes per token in bf16.
    assert SMOLLM2.kv_layout.block_bytes(16, 2) == 23_040 * 16
    assert SMOLLM2.kv_layout.block_bytes(16, 4) == 46_080 * 16


def test_memory_budget_sets_the_block_count():
    cache = CacheConfig(block_size=16, kv_cache_memory_gb=1.0, num_kv_blocks=None)
    assert num_kv_blocks(cache, 23_040 * 16, max_useful_blocks=10**9) == 1024**3 // (23_040 * 16)
    assert num_kv_blocks(cache, 23_040 * 16, max_useful_blocks=100) == 100


def test_explicit_block_count_wins_and_tiny_budget_is_an_error():
    assert num_kv_blocks(CacheConfig(16, 1.0, 7), 23_040 * 16, 10**9) == 7
    with pytest.raises(ValueError, match="holds no KV block"):
        num_kv_blocks(CacheConfig(16, 1e-6, None), 23_040 * 16, 10**9)


def test_allocated_tensors_have_the_paged_layout():
    caches = allocate_kv_caches(SMOLLM2.kv_layout, 5, 16, torch.bfloat16, "cpu")
    assert len(caches) == 30
    assert caches[0].shape == (2, 5, 3, 16, 64) and caches[0].dtype == torch.bfloat16
    assert not caches[0].any()  # zeroed: masked-out padding must never inject NaN


@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 16, 64 * 1024)])  # below and above a huge page
def test_an_untouched_pool_reads_as_zeros_and_keeps_what_is_written(shape):
    pool = zeros_untouched(shape, torch.bfloat16, "cpu")
    assert pool.shape == shape and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert not pool.any()
    gc.collect()  # the memory must live as long as the tensor, not as the allocating frame
    pool[-1, -1].fill_(2.5)
    gc.collect()
    assert pool[-1, -1].eq(2.5).all() and not pool[0].any()
    if pool.nbytes >= 2 << 20:
        assert pool.data_ptr() % (2 << 20) == 0  # huge pages need aligned addresses


def _resident_pages(t: torch.Tensor) -> int:
    """How many of t's pages are mapped in (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() // page * page
    pages = -(-(t.data_ptr() + t.nbytes - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) == 0
    return sum(v & 1 for v in vec)


def test_the_pool_is_mapped_in_behind_the_writes():
    """The background populate maps every page in and changes no byte, even of writes racing it."""
    pool = zeros_untouched((64, 1024, 1024), torch.bfloat16, "cpu")  # 128 MiB
    populate_in_background([pool])
    pool[7].fill_(1.5)  # a KV write while the thread works
    deadline = time.monotonic() + 60
    while _resident_pages(pool) * os.sysconf("SC_PAGE_SIZE") < pool.nbytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _resident_pages(pool) * os.sysconf("SC_PAGE_SIZE") >= pool.nbytes
    assert pool[7].eq(1.5).all() and not pool[:7].any() and not pool[8:].any()


def test_every_layer_pool_is_mapped_in_by_one_thread():
    """allocate_kv_caches starts one populate thread for all the layers' pools (a thread each
    stalled the start), and it reaches every pool."""
    before = {t.ident for t in threading.enumerate()}
    caches = allocate_kv_caches(SMOLLM2.kv_layout, 200, 16, torch.bfloat16, "cpu")  # 2.4 MB a layer
    started = [t for t in threading.enumerate() if t.ident not in before and t.name == "kv-pool-populate"]
    assert len(started) == 1
    started[0].join(timeout=60)
    assert all(_resident_pages(c) * os.sysconf("SC_PAGE_SIZE") >= c.nbytes for c in caches)


def test_without_populate_pages_wait_for_their_first_write():
    """An untouched pool maps nothing by itself."""
    pool = zeros_untouched((64, 1024, 1024), torch.bfloat16, "cpu")
    time.sleep(0.2)
    assert _resident_pages(pool) == 0


def test_a_gated_populate_waits_for_the_worker_to_be_idle():
    """While a step runs (and for the gate's quiet period after it), populate maps nothing: a busy
    server's pages fault in as its steps write them. Once idle, every page is mapped in."""
    pool = zeros_untouched((64, 1024, 1024), torch.bfloat16, "cpu")  # 128 MiB
    gate = IdleGate(quiet_s=0.2)
    with gate:
        thread = populate_in_background([pool], gate)
        time.sleep(0.5)
        assert _resident_pages(pool) == 0
        pool[7].fill_(1.5)  # a step's KV write faults its own pages in
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert _resident_pages(pool) * os.sysconf("SC_PAGE_SIZE") >= pool.nbytes
    assert pool[7].eq(1.5).all() and not pool[:7].any() and not pool[8:].any()


def test_kv_populate_off_leaves_every_page_to_its_first_write():
    """`--kv-populate off`: the worker asks for no populate thread."""
    before = {t.ident for t in threading.enumerate()}
    caches = allocate_kv_caches(SMOLLM2.kv_layout, 200, 16, torch.bfloat16, "cpu", populate=False)
    assert not [t for t in threading.enumerate() if t.ident not in before and t.name == "kv-pool-populate"]
    time.sleep(0.2)
    assert _resident_pages(caches[0]) == 0


@pytest.mark.parametrize("mode", ["background", "when-idle", "off"])
def test_only_a_when_idle_worker_holds_a_gate_around_its_steps(mode):
    """The gate (and its bookkeeping on every step) exists only where the populate waits on it."""
    worker = Worker(EngineArgs(kv_populate=mode, device="cpu").create_config(2048), SMOLLM2, None)
    assert isinstance(worker.idle, IdleGate) == (mode == "when-idle")


def _record_madvise(monkeypatch, result: int | None = None) -> list[tuple[int, int, int]]:
    """The populate's madvise calls as (address, bytes, the calling thread's nice value), each
    passed on to the kernel (or answered `result` instead)."""
    libc = kv_cache._libc()
    calls = []

    def madvise(address, nbytes, advice):
        calls.append((address.value, nbytes, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return libc.madvise(address, nbytes, advice) if result is None else result

    monkeypatch.setattr(kv_cache, "_libc", lambda: SimpleNamespace(madvise=madvise))
    return calls


def _resident_blocks_bytes(pool: torch.Tensor, blocks: slice) -> int:
    """Bytes mapped in of `blocks` of every plane of `pool`."""
    return sum(_resident_pages(plane[blocks]) for plane in pool) * os.sysconf("SC_PAGE_SIZE")


def _wait_until_mapped(pool: torch.Tensor, blocks: slice) -> None:
    deadline = time.monotonic() + 60
    while _resident_blocks_bytes(pool, blocks) < pool[:, blocks].nbytes and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _resident_blocks_bytes(pool, blocks) >= pool[:, blocks].nbytes


def _blocks_pool() -> torch.Tensor:
    """K and V planes of 32 blocks of 1 MiB: two blocks to a huge page."""
    return zeros_untouched((2, 32, 1 << 20), torch.uint8, "cpu")


def test_each_madvise_maps_one_chunk_at_the_priority_of_the_thread_that_started_it(monkeypatch):
    """Regression: one madvise for a whole pool, from a thread at nice 19, held the process's mmap
    lock for minutes on a loaded machine, and every brk, mmap and munmap of the engine's threads
    waited for it (`LLM()` took 60-125 s with four CPU hogs). Each call now maps at most one
    aligned huge page (the lock is held for one page's fault), at the engine's own priority."""
    calls = _record_madvise(monkeypatch)
    huge_page = 2 << 20
    pool = zeros_untouched((2, 33, 3 << 18), torch.uint8, "cpu")  # its V plane starts inside a huge page
    thread = populate_in_background([pool])
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert _resident_pages(pool) * os.sysconf("SC_PAGE_SIZE") >= pool.nbytes
    assert len(calls) >= pool.nbytes // huge_page
    assert all(0 < nbytes and address // huge_page == (address + nbytes - 1) // huge_page for address, nbytes, _ in calls)
    assert {nice for _, _, nice in calls} == {os.getpriority(os.PRIO_PROCESS, threading.get_native_id())}


def test_pages_are_mapped_in_block_order_no_further_than_ahead_of_the_steps(monkeypatch):
    """With `ahead_blocks`, only the blocks up to that many past the highest a step holds are
    mapped (both planes of a block before the next block), and the window follows `reach`."""
    calls = _record_madvise(monkeypatch)
    pool = _blocks_pool()
    populator = PagePopulator([pool], ahead_blocks=4)
    _wait_until_mapped(pool, slice(0, 4))
    assert _resident_blocks_bytes(pool, slice(4, None)) == 0
    populator.reach(5)  # a step holds blocks up to 5: map up to block 5 + 4
    _wait_until_mapped(pool, slice(0, 10))
    assert _resident_blocks_bytes(pool, slice(10, None)) == 0
    populator.reach(3)  # an older block: the window never moves back
    assert populator.target == 10
    populator.reach(31)
    populator.thread.join(timeout=60)
    assert not populator.thread.is_alive()
    assert _resident_pages(pool) * os.sysconf("SC_PAGE_SIZE") >= pool.nbytes
    plane_bytes, base = pool.stride(0), pool.data_ptr()
    first_blocks = [(address - base) % plane_bytes >> 20 for address, _, _ in calls]
    assert first_blocks == sorted(first_blocks) and len(calls) == 32


def test_a_populator_no_one_holds_ends_its_thread_and_frees_the_pool():
    """A populator waiting for its steps holds no pool: once its worker is gone, so are the thread
    and the pool's memory."""
    pool = _blocks_pool()
    populator = PagePopulator([pool], ahead_blocks=2)
    thread, pool_ref = populator.thread, weakref.ref(pool)
    _wait_until_mapped(pool, slice(0, 2))
    del populator, pool
    thread.join(timeout=60)
    assert not thread.is_alive() and pool_ref() is None


def test_a_refused_madvise_ends_the_populate(monkeypatch):
    """A kernel without MADV_POPULATE_WRITE (Linux < 5.14) refuses the first call: no more are made,
    and the pages fault on first write."""
    calls = _record_madvise(monkeypatch, result=-1)
    pool = _blocks_pool()
    thread = populate_in_background([pool])
    thread.join(timeout=60)
    assert not thread.is_alive() and len(calls) == 1 and _resident_pages(pool) == 0


def _step(block_tables: list[list[int]], swap_out: list[tuple[int, int]] = ()) -> SchedulerOutput:
    chunks = [ScheduledChunk(f"r{i}", [1], 0, (table,), True, SamplingParams(), [1], [], frozenset())
              for i, table in enumerate(block_tables)]
    return SchedulerOutput(chunks=chunks, swap_out=list(swap_out))


@pytest.mark.parametrize("mode", ["background", "when-idle", "off"])
def test_a_worker_maps_its_pools_ahead_of_its_steps_or_while_idle(mode):
    """background: each step moves the device pool's window to past the highest block its requests
    hold, and the host pool's past the highest it swaps out to, by the blocks one step can take
    (64 tokens in blocks of 16, plus one per request: 6). when-idle: the whole pools, gated. off: none."""
    config = EngineArgs(kv_populate=mode, device="cpu", max_num_batched_tokens=64, max_num_seqs=2).create_config(2048)
    worker = Worker(config, SMOLLM2, None)
    worker.start_populate(allocate_kv_caches(SMOLLM2.kv_layout, 400, 16, torch.bfloat16, "cpu", populate=False),
                          allocate_kv_caches(SMOLLM2.kv_layout, 300, 16, torch.bfloat16, "cpu", populate=False))
    worker.model_runner = SimpleNamespace(execute=lambda sched: "ran")
    assert worker.execute_model(_step([[5, 9, 40], [7, 12]], swap_out=[(9, 20), (12, 3)])) == "ran"
    targets = [(populator.target, host) for populator, host in worker.populators]
    expected = {"background": [(47, False), (27, True)], "when-idle": [(400, False), (300, True)], "off": []}[mode]
    assert targets == expected
