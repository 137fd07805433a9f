"""The physical KV blocks: reference counts, the prefix cache, and the free list.

A block is free when no request holds it. A free block that was cached keeps its hash and its
contents, so a later request with the same prefix can take it back (a prefix-cache hit) until
its memory is needed. Free blocks are handed out least recently freed first (LRU), and only then
is a cached block's hash forgotten.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from kvflow.core.block_hash import BlockHash


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        # A block can be found under several hashes: a prompt's tail, then the full block it grows into.
        self.block_hashes: list[list[BlockHash]] = [[] for _ in range(num_blocks)]
        self.cached_tokens = [0] * num_blocks  # how many leading slots its cached content covers
        self.cached: dict[BlockHash, int] = {}  # hash → block holding that content
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (kvflow:kv_cache_usage_perc)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._forget(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def take(self, blocks: list[int]) -> None:
        """Add an owner to cached blocks found by `lookup` (free ones leave the free list)."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self._free[b]
            self.ref_counts[b] += 1

    def cache(self, block: int, block_hash: BlockHash, num_tokens: int) -> None:
        """Record that the first `num_tokens` slots of `block` hold the content `block_hash` names.
        If another block already holds it, that one stays the one found."""
        if not self.enable_caching or block_hash in self.cached:
            return
        self.block_hashes[block].append(block_hash)
        self.cached_tokens[block] = max(self.cached_tokens[block], num_tokens)
        self.cached[block_hash] = block

    def overwrites_cached(self, block: int, offset: int) -> bool:
        """Would writing slot `offset` of `block` change content the cache promises?"""
        return offset < self.cached_tokens[block]

    def release(self, blocks: list[int]) -> None:
        """Drop an owner from each block, in order: the first freed is the first reused."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"KV block {b} released twice")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free[b] = None

    def reset_prefix_cache(self) -> None:
        for block in list(self._free):
            self._forget(block)

    def _forget(self, block: int) -> None:
        for block_hash in self.block_hashes[block]:
            if self.cached.get(block_hash) == block:
                del self.cached[block_hash]
        self.block_hashes[block] = []
        self.cached_tokens[block] = 0


class StateSlots:
    """A hybrid model's state slots (kv_cache_spec: its states are kept apart from the block pool):
    a request holds one from its first chunk to its end. The lowest free slot is always handed out
    first, so every slot ever handed out is below the most requests that held one at once, which
    the scheduler keeps at max_num_seqs: the worker's state tensors need that many rows, whatever
    the block pool's size."""

    def __init__(self) -> None:
        self._free: list[int] = []  # a heap of released slots below `_next`
        self._next = 0  # every slot from here on is free
        self.num_held = 0

    def allocate(self) -> int:
        self.num_held += 1
        if self._free:
            return heapq.heappop(self._free)
        self._next += 1
        return self._next - 1

    def release(self, slot: int) -> None:
        if not 0 <= slot < self._next or slot in self._free:
            raise RuntimeError(f"state slot {slot} released twice")
        heapq.heappush(self._free, slot)
        self.num_held -= 1
