"""The KV tensors, sized from a memory budget, laid out by the model's KV groups.

A block of the pool holds one group's KV for `block_size` positions; a group has G layers (the
layout's group size), so the pool is G tensors, and slot j of every group lives in tensor j:
layer `layers[j]` of whichever group owns block b reads block b of tensor j. Layers that share
another layer's KV get that layer's tensor. Shapes:

- K/V attention: `[2, num_blocks, num_kv_heads, block_size, head_dim]`, heads before positions so
  that a request's keys gather into the contiguous [heads, len, dim] operand a batched matmul
  reads fastest;
- MLA: `[1, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`, the latent and the RoPE key
  of each position side by side;
- quantized K/V (kv_cache_dtype fp8 or int8): `[2, num_blocks, num_kv_heads, block_size *
  (head_dim + 2)]`, each (block, head) row its codes then their bfloat16 scales
  (kvflow.attention.kv_quant).

Either way dimension 1 is the block, which is all block copies and swaps need to know.

A recurrent state is `[1, slots, state_elements]`, float32. A model of state layers only keeps
its states in the pool's blocks (a block is a state). A hybrid's state layers each get a tensor
of their own, indexed by state slot (kv_cache_spec): [1, max_num_seqs, elements], since slots stay
below max_num_seqs (`core.block_pool.StateSlots`); the budget sets those states aside before it
counts the attention blocks (`pool_blocks`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import mmap
import threading
import time
import weakref

import numpy as np
import torch

from kvflow.attention import kv_quant
from kvflow.config import CacheConfig
from kvflow.kv_cache_spec import KVCacheSpec, KVLayout, MLAAttentionSpec, RecurrentStateSpec, SharedKVSpec


def kv_cache_shape(spec: KVCacheSpec, num_blocks: int, block_size: int, quantized: bool = False) -> tuple[int, ...]:
    if isinstance(spec, SharedKVSpec):
        raise ValueError("a layer that shares KV has no cache of its own")
    if isinstance(spec, RecurrentStateSpec):  # a block is one request's state: float32, whatever kv_cache_dtype says
        if quantized:
            raise ValueError("kv_cache_dtype fp8/int8 does not apply to a model with recurrent state (its states "
                             "are float32); use kv_cache_dtype=auto")
        return (1, num_blocks, spec.state_elements)
    if isinstance(spec, MLAAttentionSpec):
        if quantized:
            raise ValueError("kv_cache_dtype fp8/int8 is not implemented for multi-head latent attention (MLA) "
                             "caches yet; use kv_cache_dtype=auto")
        return (1, num_blocks, block_size, spec.elements_per_token)
    if quantized:
        return kv_quant.packed_shape(spec.num_kv_heads, spec.head_dim, num_blocks, block_size)
    return (2, num_blocks, spec.num_kv_heads, block_size, spec.head_dim)


# Memory left free after the KV pool is allocated: activations of the largest step, the
# sampler's logits, allocator slack. The pool never takes it, whatever the budget says.
MEMORY_HEADROOM_BYTES = 1024**3


def num_kv_blocks(cache: CacheConfig, block_bytes: int, max_useful_blocks: int,
                  available_bytes: int | None = None, state_bytes: int = 0) -> int:
    """Blocks of `block_bytes` that fit in the memory budget, but never more than
    `max_useful_blocks` (what max_num_seqs requests of max_model_len tokens could ever hold), nor
    more than the memory measured free (`available_bytes`, after the model is loaded) less
    `MEMORY_HEADROOM_BYTES`. `state_bytes`: what a hybrid's state slots take of the budget first."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    budget = int(cache.kv_cache_memory_gb * 1024**3)
    beside = f" beside max_num_seqs requests' states ({state_bytes} bytes)" if state_bytes else ""
    if available_bytes is not None and available_bytes - MEMORY_HEADROOM_BYTES < budget:
        budget = available_bytes - MEMORY_HEADROOM_BYTES
        if budget < block_bytes + state_bytes:
            raise ValueError(f"kv_cache_memory_gb={cache.kv_cache_memory_gb}: only {available_bytes / 1024**3:.2f} GiB "
                             f"is free after loading the model, less than {MEMORY_HEADROOM_BYTES / 1024**3:.0f} GiB "
                             f"of headroom plus one KV block of {block_bytes} bytes{beside}")
    blocks = (budget - state_bytes) // block_bytes
    if blocks < 1:
        raise ValueError(f"kv_cache_memory_gb={cache.kv_cache_memory_gb} holds no KV block of {block_bytes} "
                         f"bytes{beside}")
    return min(blocks, max_useful_blocks)


def pool_blocks(cache: CacheConfig, layout: KVLayout, dtype_bytes: int, max_model_len: int, max_num_seqs: int,
                available_bytes: int | None = None, layers: range | None = None, side_bytes: int = 0) -> tuple[int, int]:
    """(device blocks, host blocks for swapping) of a pool laid out by `layout` (for `layers` only,
    on a pipeline stage): the budget, capped by what max_num_seqs requests of max_model_len tokens
    could hold in every group and by `available_bytes` (`num_kv_blocks`). `side_bytes`: what each
    device block costs beside its KV (sparse decode's key summaries); host blocks hold KV only.
    A hybrid's max_num_seqs states come out of the budget first; it has no swap space (its state
    slots are not blocks a swap could copy), so preemption_mode='swap' is refused."""
    block_bytes = layout.block_bytes(cache.block_size, dtype_bytes, cache.cache_dtype, layers)
    if layout.hybrid and cache.swap_space_gb > 0:
        raise ValueError("preemption_mode='swap': a model with both recurrent-state and attention layers (a hybrid) "
                         "keeps its states apart from the KV blocks a swap copies; use preemption_mode='recompute'")
    only_states = layout.holds_state and not layout.hybrid
    per_request = 1 if only_states else -(-max_model_len // cache.block_size)  # a state is one block
    useful = per_request * max_num_seqs * len(layout.pool_groups())
    states = max_num_seqs * layout.state_bytes(layers)
    return (num_kv_blocks(cache, block_bytes + side_bytes, useful, available_bytes, states),
            int(cache.swap_space_gb * 1024**3) // block_bytes)


def utilization_budget_gb(fraction: float, device: torch.device) -> float:
    """The KV budget (GiB) under `gpu_memory_utilization`: `fraction` of the device's memory (the
    host's, on CPU), less what this process holds already (the loaded model) and the activations'
    headroom. ValueError when that leaves nothing, saying what took it."""
    if device.type == "cuda":
        total, held = torch.cuda.mem_get_info(device)[1], torch.cuda.memory_reserved(device)
    else:
        total, held = _meminfo_bytes("MemTotal"), _resident_bytes()
    budget = fraction * total - held - MEMORY_HEADROOM_BYTES
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={fraction} allows {fraction * total / 1024**3:.2f} GiB, but the "
                         f"loaded model already holds {held / 1024**3:.2f} GiB and activations need "
                         f"{MEMORY_HEADROOM_BYTES / 1024**3:.0f} GiB: no room is left for the KV cache")
    return budget / 1024**3


def _meminfo_bytes(field: str) -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields[field].split()[0]) * 1024


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def available_memory_bytes(device: torch.device) -> int | None:
    """Memory free for the KV pool now: the GPU's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):  # not Linux: the configured budget alone decides
        return None


def allocate_kv_caches(layout: KVLayout, num_blocks: int, block_size: int, dtype, device,
                       kv_cache_dtype: str = "auto", populate: bool = True,
                       idle: IdleGate | None = None, layers: range | None = None,
                       num_state_slots: int = 0) -> list[torch.Tensor | None]:
    """One cache per layer (views of the G pool tensors; sharing layers get their target's).
    `layers`: a pipeline stage's; only their pool tensors are allocated, other layers get None.
    `dtype`: the model's, which "auto" keeps; fp8/int8 store codes of that dtype plus scales.
    `populate`: map every page in on a background thread (`populate_in_background`), waiting on
    `idle` (the worker's gate) where one is given. The worker passes False and starts its own
    (`Worker.start_populate`: ahead of its steps, or gated). `num_state_slots`: the rows of a
    hybrid's state tensors (max_num_seqs; a model without state slots ignores it)."""
    if layout.state_layers and num_state_slots < 1:
        raise ValueError("a hybrid model's state tensors need num_state_slots (max_num_seqs) rows")
    codes = kv_quant.storage_dtype(kv_cache_dtype)
    quantized = codes is not None
    first = layout.groups[layout.pool_groups()[0]].spec
    held = range(layout.group_size) if layers is None else layout.slots(layers)
    if isinstance(first, RecurrentStateSpec):
        codes = torch.float32
    pool = {slot: zeros_untouched(kv_cache_shape(first, num_blocks, block_size, quantized), codes or dtype, device)
            for slot in held}
    # One thread for every layer's pool: a thread each (30 for SmolLM2) made the start wait ~75 ms
    # per thread.start() while the earlier ones held both cores (3.2 s of a 5.5 s start).
    if populate:
        populate_in_background(list(pool.values()), idle)
    caches = [pool[slot].view(kv_cache_shape(layout.groups[group].spec, num_blocks, block_size, quantized))
              if (layers is None or i in layers) and i not in layout.state_layers else None
              for i, (group, slot) in enumerate(layout.places)]
    for i in layout.state_layers:  # a hybrid's: a row per state slot
        if layers is None or i in layers:
            spec = layout.groups[layout.places[i][0]].spec
            caches[i] = torch.zeros(kv_cache_shape(spec, num_state_slots, block_size, quantized), dtype=torch.float32,
                                    device=device)
    return caches


def zeros_untouched(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zero tensor whose pages the OS maps on first write, on CPU: fresh anonymous memory is zero
    by contract and untouched, where torch.zeros writes every byte (seconds for a GiB-sized pool,
    paid at every start). Attention never depends on the zeros (it masks what no one wrote,
    `attention.metadata`); they only keep garbage out.

    A first write to a page still costs a fault, and in a KV write that is on the step's path: a
    first write to a 2 MiB page can cost milliseconds (the fault may compact memory), and W1 (1.2
    GB of KV written) was ~8% slower faulting in its writes than with the pages mapped beforehand
    (docs/performance-journal.md). So a thread maps the pages in beside the steps (`PagePopulator`), and
    the pool asks for transparent huge pages (2 MiB: 512x fewer faults and TLB entries) where the
    kernel offers them on request (`madvise` mode, the common default); elsewhere madvise is a
    no-op."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
    memory = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(memory, dtype=torch.uint8)  # the tensor keeps `memory` alive
    start = -whole.data_ptr() % _HUGE_PAGE  # huge pages need 2 MiB-aligned addresses
    return whole[start:start + nbytes].view(dtype).view(shape)


class IdleGate:
    """When background work may take a core: once the worker has run no step for `quiet_s`; a
    step holds it (`with gate:`).

    The KV pool's populate waits on it before each of its madvise calls where `--kv-populate
    when-idle` (`kvflow serve`'s default). Mapping the whole pool while a server's first requests
    ran took a core from them: loaded at once after `/health`, 234–263 output tok/s with TTFT p90
    3.0–4.2 s, against 290–298 and 1.1 s gated (docs/performance-journal.md). A batch job maps its pages
    ahead of its steps instead (`--kv-populate background`, `PagePopulator.ahead_blocks`)."""

    def __init__(self, quiet_s: float = 1.0) -> None:
        self.quiet_s = quiet_s
        self._busy = False
        self._since = time.monotonic()  # the quiet period starts at the allocation, within the start

    def __enter__(self) -> None:
        self._busy = True

    def __exit__(self, *exc) -> None:
        self._busy = False
        self._since = time.monotonic()

    def wait(self) -> None:
        while True:
            quiet_left = self.quiet_s - (time.monotonic() - self._since)
            if not self._busy and quiet_left <= 0:
                return
            time.sleep(max(quiet_left, 0.1))


def populate_in_background(pools: list[torch.Tensor], idle: IdleGate | None = None) -> threading.Thread | None:
    """Map every page of `pools` in on a thread of its own (`PagePopulator`, the whole pool), which
    keeps them alive until it is done; with `idle`, only while the worker is idle. The thread, or
    None where there is nothing it can map."""
    return PagePopulator(pools, idle=idle, keep_alive=True).thread


class PagePopulator:
    """Maps KV pools' pages in on one daemon thread with madvise(MADV_POPULATE_WRITE), so that the
    steps' KV writes do not take the faults (`zeros_untouched`). The pages fault in as a write
    would fault them and their contents are left as they are, so KV writes racing it are safe.
    Pools it cannot take are left to fault on first write: a device's, and small ones from the
    heap (not page-aligned). Each pool is `[planes, blocks, ...]` (K and V, or MLA's one plane).

    It must never make the engine's threads wait on it, whatever the machine's load. The kernel
    runs MADV_POPULATE_WRITE under the process's mmap lock, held for reading for the whole call;
    brk, mmap, munmap and mprotect (any thread's malloc growing or trimming its heap) take it for
    writing and wait until every reader has left, and once a writer waits, later readers queue
    behind it. A reader-writer semaphore lends no priority to its holder. One call for a whole
    pool from a thread at nice 19 was a priority inversion: with CPU hogs beside the engine that
    thread got a sliver of a core, held the lock for minutes and the engine's main thread sat in
    brk the while (`LLM()` took 60–125 s with four hogs on two cores). So:

    - each call maps at most one POPULATE_CHUNK-aligned piece (one huge page): the lock is held
      for one page's fault, the fault the engine would take itself on its first write there;
    - the thread runs at the priority of the thread that made it (the engine's), never lowered:
      an unprivileged thread cannot raise its priority back for a call (RLIMIT_NICE), and between
      calls it takes the GIL, where a starved holder would stall every Python thread the same way;
    - it maps the blocks in the order the engine writes them and no further than it needs: the
      block pool hands out never-used blocks in id order (`core.block_pool`: its free list starts
      0..N-1 and freed blocks go to its end), so with `ahead_blocks` the pages of blocks up to
      that many past the highest block a step holds (`reach`) are mapped, beside the steps. Its
      work is then the faults the steps would take, done off their path, plus one window; a job
      that uses little of its pool maps little of it. Without `ahead_blocks`, the whole pool.
    - with `idle` (an IdleGate), each call waits until the worker is idle.

    The thread never holds the populator nor its pools (`keep_alive` aside): it shares only a
    `_PopulateState` with it. Whoever drops the populator frees the pools, after its finalizer has
    waited for a call in progress and told the thread to stop. So a tensor is never freed on the
    thread, where at interpreter exit freeing one aborts the process (a daemon thread taking the
    GIL then is ended by pthread_exit, whose unwinding cannot pass torch's destructors).
    `keep_alive` holds the populator until the whole pool is mapped instead (a caller that drops
    it). A failed call (Linux < 5.14 has no MADV_POPULATE_WRITE) ends it: the rest of the pages
    fault on first write."""

    def __init__(self, pools: list[torch.Tensor], ahead_blocks: int | None = None, idle: IdleGate | None = None,
                 keep_alive: bool = False) -> None:
        self.pools = [pool for pool in pools if pool.device.type == "cpu" and pool.data_ptr() % mmap.PAGESIZE == 0]
        self.num_blocks = max((pool.shape[1] for pool in self.pools), default=0)
        self.ahead_blocks = ahead_blocks
        self._state = _PopulateState(self.num_blocks if ahead_blocks is None else min(ahead_blocks, self.num_blocks))
        self.thread: threading.Thread | None = None
        libc = _libc()
        if libc is None or not self.pools:
            return
        weakref.finalize(self, _stop_populating, self._state)
        self.thread = threading.Thread(
            target=_populate, name="kv-pool-populate", daemon=True,
            args=(self._state, _pieces_in_block_order(self.pools), libc.madvise, idle, self if keep_alive else None))
        self.thread.start()

    @property
    def target(self) -> int:
        """Blocks below it are to be mapped; it only grows."""
        return self._state.target

    def reach(self, block: int) -> None:
        """A step holds `block`: map the pages up to `ahead_blocks` past it. Called from the
        worker's thread only (the target only grows)."""
        target = min(block + 1 + (self.ahead_blocks or 0), self.num_blocks)
        state = self._state
        if target <= state.target:  # most steps: no lock taken
            return
        with state.wake:
            state.target = target
            state.wake.notify()


@dataclasses.dataclass
class _PopulateState:
    """What a populator and its thread share: the target, the thread's wake-up, and the stop the
    populator's finalizer gives (under `calling`, which the thread holds during each call, so the
    pools outlive a call in progress)."""

    target: int
    wake: threading.Condition = dataclasses.field(default_factory=threading.Condition)
    calling: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    stopped: bool = False


def _stop_populating(state: _PopulateState) -> None:
    with state.calling:
        state.stopped = True
    with state.wake:
        state.wake.notify_all()


def _pieces_in_block_order(pools: list[torch.Tensor]) -> list[tuple[int, int, int]]:
    """(first block, address, bytes) of each madvise call that maps `pools` in: within one plane,
    at most one POPULATE_CHUNK-aligned window of it, page-aligned; ordered by the first block each
    holds, which is the order the engine writes them in."""
    pieces = []
    for pool in pools:
        plane_bytes, block_bytes = pool.stride(0) * pool.element_size(), pool.stride(1) * pool.element_size()
        for plane in range(pool.shape[0]):
            start = pool.data_ptr() + plane * plane_bytes
            end = start + pool.shape[1] * block_bytes
            address = start // mmap.PAGESIZE * mmap.PAGESIZE
            while address < end:
                stop = min((address // POPULATE_CHUNK + 1) * POPULATE_CHUNK, end)
                pieces.append((max(address - start, 0) // block_bytes, address, stop - address))
                address = stop
    return sorted(pieces)


def _populate(state: _PopulateState, pieces: list[tuple[int, int, int]], madvise, idle: IdleGate | None,
              keep_alive: PagePopulator | None) -> None:
    """The populate thread: each piece once its first block is below the target (and the worker is
    idle, with `idle`), until the populator stops it. `keep_alive`: the populator, held to the end."""
    for first_block, address, nbytes in pieces:
        if not _wait_for_target(state, first_block):
            return
        if idle is not None:
            idle.wait()
        with state.calling:
            if state.stopped or madvise(ctypes.c_void_p(address), nbytes, _MADV_POPULATE_WRITE) != 0:
                return


def _wait_for_target(state: _PopulateState, block: int) -> bool:
    """Wait until the target passes `block`; False once the populator is gone."""
    with state.wake:
        while not state.stopped and block >= state.target:
            state.wake.wait()
        return not state.stopped


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


_MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux 5.14
_HUGE_PAGE = 2 << 20
POPULATE_CHUNK = _HUGE_PAGE  # the most one madvise call maps, holding the mmap lock: one huge page's fault


def unique_caches(kv_caches: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """The distinct pool tensors behind per-layer caches (a block copy touches each once); a
    pipeline stage has none for other stages' layers."""
    seen: dict[int, torch.Tensor] = {}
    for cache in kv_caches:
        if cache is not None:
            seen.setdefault(cache.untyped_storage().data_ptr(), cache)
    return list(seen.values())
