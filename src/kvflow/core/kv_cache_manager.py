"""Per-request block tables on top of the block pool, with automatic prefix caching.

A request owns an ordered list of block ids; token position p lives in slot
`block_ids[p // block_size] * block_size + p % block_size`. When a request is admitted, the
longest chain of its full blocks already in the cache is reused (shared, reference-counted) and
only the rest is computed; its last token is always computed, so it gets logits. Blocks become
findable once they are full and computed, and stay findable after their request ends until the
pool needs their memory.
"""

from __future__ import annotations

from kvflow.core.block_hash import BlockHash, extend_block_hashes
from kvflow.core.block_pool import BlockPool
from kvflow.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self._block_tables: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks of the table already in the cache
        # Full blocks a running request will compute but has not yet: a request with the same
        # prefix waits for them instead of computing them a second time.
        self._in_flight: dict[BlockHash, str] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return self._block_tables.get(request_id, [])

    # -- prefix cache ----------------------------------------------------------------------
    def block_hashes(self, request: Request) -> list[BlockHash]:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_extra_keys)
        return request.block_hashes

    def find_cached_prefix(self, request: Request) -> list[int]:
        """The longest chain of cached blocks for the request, never covering its last token."""
        if not self.pool.enable_caching:
            return []
        found = []
        for block_hash in self.block_hashes(request)[:(request.num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def prefix_in_flight(self, request: Request, num_cached_blocks: int) -> bool:
        """True if the first block the request would compute is being computed by another."""
        hashes = self.block_hashes(request)
        return num_cached_blocks < len(hashes) and hashes[num_cached_blocks] in self._in_flight

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    # -- allocation ------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Make room for the request's first `num_tokens` tokens, starting its table with
        `cached_blocks` if given. False, with nothing changed, if the pool cannot provide it."""
        rid = request.request_id
        table = self._block_tables.get(rid, [])
        missing = self.blocks_needed(num_tokens) - len(table) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)  # free ones leave the free list
        if max(missing, 0) + revived > self.pool.num_free_blocks:
            return False
        if rid not in self._block_tables:
            self._block_tables[rid] = table
            self._num_cached_blocks[rid] = len(cached_blocks)
        self.pool.take(list(cached_blocks))
        table.extend(cached_blocks)
        if missing > 0:
            table.extend(self.pool.allocate(missing))
            self._mark_in_flight(request, table)
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Make the request's newly full, computed blocks findable."""
        rid = request.request_id
        table = self._block_tables.get(rid)
        if table is None or not self.pool.enable_caching:
            return
        hashes = self.block_hashes(request)
        full = min(request.num_computed_tokens // self.block_size, len(hashes))
        for i in range(self._num_cached_blocks[rid], full):
            self.pool.cache(table[i], hashes[i])
            if self._in_flight.get(hashes[i]) == rid:
                del self._in_flight[hashes[i]]
        self._num_cached_blocks[rid] = max(full, self._num_cached_blocks[rid])

    def free(self, request: Request) -> None:
        rid = request.request_id
        table = self._block_tables.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        for block_hash in request.block_hashes:
            if self._in_flight.get(block_hash) == rid:
                del self._in_flight[block_hash]
        if table:
            # Tail first: a request's last blocks are the least likely to be shared, so reuse them first.
            self.pool.release(table[::-1])

    def _mark_in_flight(self, request: Request, table: list[int]) -> None:
        if not self.pool.enable_caching:
            return
        hashes = self.block_hashes(request)
        for i in range(self._num_cached_blocks[request.request_id], min(len(table), len(hashes))):
            self._in_flight.setdefault(hashes[i], request.request_id)
