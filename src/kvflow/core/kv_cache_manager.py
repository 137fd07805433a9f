"""Per-request block tables on top of the block pool, with automatic prefix caching.

A request owns an ordered list of block ids; token position p lives in slot
`block_ids[p // block_size] * block_size + p % block_size`. When a request is admitted, the
longest chain of its blocks already in the cache is reused (shared, reference-counted) and only
the rest is computed. Full blocks become findable once computed; so does the partial last block
of a prompt, so an identical prompt (or a sibling of an n > 1 request) reuses the whole prompt
and recomputes only its last token, which it needs for logits.

One rule keeps shared memory correct: content the cache promises is never overwritten. A write
into a cached block's covered slots (a request recomputing the last token of a prompt it found
whole) copies the block first; the copies are handed to the worker with the step. Writing past
the covered slots (the owner's next token in its prompt's tail block) needs no copy.
"""

from __future__ import annotations

from kvflow.core.block_hash import ROOT_HASH, BlockHash, extend_block_hashes, hash_block
from kvflow.core.block_pool import BlockPool
from kvflow.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self._block_tables: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading full blocks already registered
        # Blocks a running request will compute but has not yet: a request with the same
        # prefix waits for them instead of computing them a second time.
        self._in_flight: dict[BlockHash, str] = {}
        self._copies: list[tuple[int, int]] = []  # (source, destination) for the next step
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

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    # -- prefix cache ----------------------------------------------------------------------
    def block_hashes(self, request: Request) -> list[BlockHash]:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_extra_keys)
        return request.block_hashes

    def _tail_hash(self, request: Request) -> BlockHash | None:
        """The hash of a fresh prompt's partial last block (None: no outputs yet is required,
        and the prompt must not end on a block boundary)."""
        full, rest = divmod(request.num_prompt_tokens, self.block_size)
        if rest == 0 or request.num_output_tokens:
            return None
        parent = self.block_hashes(request)[full - 1] if full else ROOT_HASH
        return hash_block(parent, request.prompt_token_ids[full * self.block_size:],
                          () if full else request.cache_extra_keys)

    def _next_hashes(self, request: Request) -> list[BlockHash]:
        """The hashes that, in order, cover the request's known tokens."""
        full = self.block_hashes(request)[:request.num_tokens // self.block_size]
        tail = self._tail_hash(request)
        return full if tail is None else [*full, tail]

    def find_cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """(blocks, tokens) of the longest cached prefix. A fresh prompt found whole is reused
        whole but for its last token; otherwise only full blocks count, never the last token."""
        if not self.pool.enable_caching:
            return [], 0
        hashes, found = self._next_hashes(request), []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            found.append(block)
        if len(found) == len(hashes) and request.num_output_tokens == 0:
            return found, request.num_tokens - 1
        found = found[:(request.num_tokens - 1) // self.block_size]
        return found, len(found) * self.block_size

    def prefix_in_flight(self, request: Request, num_cached_blocks: int) -> bool:
        """True if the first block the request would compute is being computed by another."""
        hashes = self._next_hashes(request)
        return num_cached_blocks < len(hashes) and hashes[num_cached_blocks] in self._in_flight

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    # -- allocation ------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_computed: int, num_new: int, cached_blocks: list[int] = ()) -> bool:
        """Make room to compute tokens [num_computed, num_computed + num_new), the table starting
        with `cached_blocks` if given. False, with nothing changed, if the pool is too small."""
        rid = request.request_id
        table = self._block_tables.get(rid, [])
        missing = self.blocks_needed(num_computed + num_new) - len(table) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)  # they leave the free list
        first, offset = divmod(num_computed, self.block_size)
        existing = [*table, *cached_blocks]
        copy = first < len(existing) and self.pool.overwrites_cached(existing[first], offset)
        if max(missing, 0) + revived + copy > self.pool.num_free_blocks:
            return False
        if rid not in self._block_tables:
            self._block_tables[rid] = table
            self._num_cached_blocks[rid] = min(len(cached_blocks), request.num_tokens // self.block_size)
        self.pool.take(list(cached_blocks))
        table.extend(cached_blocks)
        if copy:
            self._copy_on_write(table, first)
        if missing > 0:
            table.extend(self.pool.allocate(missing))
            self._mark_in_flight(request, table)
        return True

    def _copy_on_write(self, table: list[int], index: int) -> None:
        source = table[index]
        table[index] = self.pool.allocate(1)[0]
        self._copies.append((source, table[index]))
        self.pool.release([source])

    def cache_computed_blocks(self, request: Request) -> None:
        """Make the request's newly computed full blocks, and its prompt's tail block once the
        prompt is done, findable."""
        rid = request.request_id
        table = self._block_tables.get(rid)
        if table is None or not self.pool.enable_caching:
            return
        hashes = self.block_hashes(request)
        full = min(request.num_computed_tokens // self.block_size, len(hashes))
        for i in range(self._num_cached_blocks[rid], full):
            self._register(table[i], hashes[i], self.block_size, rid)
        self._num_cached_blocks[rid] = max(full, self._num_cached_blocks[rid])
        tail = self._tail_hash(request)
        if tail is not None and request.num_computed_tokens == request.num_prompt_tokens:
            index, covered = divmod(request.num_prompt_tokens, self.block_size)
            self._register(table[index], tail, covered, rid)

    def _register(self, block: int, block_hash: BlockHash, num_tokens: int, rid: str) -> None:
        self.pool.cache(block, block_hash, num_tokens)
        if self._in_flight.get(block_hash) == rid:
            del self._in_flight[block_hash]

    def free(self, request: Request) -> None:
        rid = request.request_id
        table = self._block_tables.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        for block_hash in [h for h, owner in self._in_flight.items() if owner == rid]:
            del self._in_flight[block_hash]
        if table:
            # Tail first: a request's last blocks are the least likely to be shared, so reuse them first.
            self.pool.release(table[::-1])

    def _mark_in_flight(self, request: Request, table: list[int]) -> None:
        if not self.pool.enable_caching:
            return
        hashes = self._next_hashes(request)
        for i in range(self._num_cached_blocks[request.request_id], min(len(table), len(hashes))):
            self._in_flight.setdefault(hashes[i], request.request_id)
