"""Per-request block tables on top of the block pool, one per KV group, with prefix caching.

A model's layers form KV groups (`kvflow.kv_cache_spec`): layers with the same kind of KV. Each
request owns one block table per group, all indexed alike: token position p lives in slot
`table[p // block_size] * block_size + p % block_size` of its group's table. All groups draw
blocks from one pool. A sliding-window group gives a block back as soon as it has left the window
of every query still to come, while the request runs; its table keeps `NULL_BLOCK` in that place,
so memory for a long request stays O(window) in those layers.

When a request is admitted, the longest prefix whose blocks are all in the cache is reused
(shared, reference-counted) and only the rest is computed; a sliding group needs only the blocks
in the window of the first token to compute. Full blocks become findable once computed; so does
the partial last block of a prompt, so an identical prompt (or a sibling of an n > 1 request)
reuses the whole prompt and recomputes only its last token, which it needs for logits. A prompt
that is a cached prompt plus one token (a beam of beam search extending the beam it came from)
finds that prompt's tail too, and computes only its new token.

A state group (a state-space model's layers: a `RecurrentStateSpec`, Mamba's or a short
convolution's) gives each request one block, its state slot, from its first chunk to its end,
whatever its length; the worker reads and writes the
request's state there, and a request computing from position 0 starts from zeros in it. Such
models run without the prefix cache (the engine turns it off). In a hybrid (state groups beside
attention groups) the state slots are not blocks of the pool: they come from `StateSlots`, one per
state group and request, while the attention groups draw blocks as any model's do; the pool's
block counts (free, held, admission's bound) are the attention groups' alone.

A request with a KV budget (`core/kv_eviction.py`) drops its oldest non-sink blocks at fixed
points; its table then holds only the survivors, compacted, and its positions past the first
point are `num_evicted_tokens` ahead of their KV indices. It neither reads nor fills the prefix
cache.

Two rules keep shared memory correct (copy-on-write): content the cache promises is never
overwritten, and a block another request holds is never written. A write into a cached block's
covered slots (a request recomputing the last token of a prompt it found whole), or into a
partial block someone else holds (sibling beams each appending their own token after the same
tail), copies the block first; the copies are handed to the worker with the step. The owner
writing past the covered slots of a block only it holds (its next token in its prompt's tail
block) needs no copy.
"""

from __future__ import annotations

from collections.abc import ItemsView

from kvflow.core.block_hash import ROOT_HASH, BlockHash, extend_block_hashes, hash_block
from kvflow.core.block_pool import BlockPool, StateSlots
from kvflow.core.kv_eviction import KVEviction
from kvflow.core.request import Request

NULL_BLOCK = -1  # a table entry whose block left the sliding window and was given back
BlockTables = tuple[list[int], ...]  # one table per KV group


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_windows: tuple[int | None, ...] = (None,), state_groups: tuple[bool, ...] | None = None) -> None:
        """`sliding_windows`: one entry per KV group, None for groups that keep every position;
        `state_groups`: per group, whether it holds one state block per request (default: none)."""
        self.block_size = block_size
        self.sliding_windows = tuple(sliding_windows)
        self.state_groups = tuple(state_groups or (False,) * len(self.sliding_windows))
        if any(self.state_groups) and enable_caching:
            raise ValueError("a model with recurrent state runs without the prefix cache")
        self.pool = BlockPool(num_blocks, enable_caching)
        # A hybrid's state slots, one allocator per state group (None: states are the pool's blocks).
        hybrid = any(self.state_groups) and not all(self.state_groups)
        self.state_slots = tuple(StateSlots() if hybrid and state else None for state in self.state_groups)
        self._block_tables: dict[str, BlockTables] = {}
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
    def num_groups(self) -> int:
        return len(self.sliding_windows)

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        """Table entries (per group) that cover `num_tokens` positions."""
        return cdiv(num_tokens, self.block_size)

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks, over all groups, a request may hold at once while it caches
        `num_tokens` positions in chunks of at most `max_chunk` tokens."""
        full = self.blocks_needed(num_tokens)
        return sum(self._pool_blocks_of_state(g) if state else full if w is None
                   else min(full, cdiv(w - 1 + max_chunk, self.block_size) + 1)
                   for g, (w, state) in enumerate(zip(self.sliding_windows, self.state_groups)))

    def _pool_blocks_of_state(self, group: int) -> int:
        """Pool blocks a state group's slot takes: one, or none where its slots are apart (a hybrid)."""
        return 0 if self.state_slots[group] is not None else 1

    def max_blocks_held_within(self, num_tokens: int, eviction: KVEviction) -> int:
        """The most blocks a request with a KV budget holds while it caches `num_tokens` positions:
        the budget's in full-attention groups, a window and a chunk (chunks end at eviction
        points) in sliding ones."""
        full = self.blocks_needed(num_tokens)
        held = min(full, self.blocks_needed(eviction.budget_tokens))
        return sum(held if w is None else min(full, cdiv(w - 1 + eviction.interval, self.block_size) + 1)
                   for w in self.sliding_windows)

    def max_chunk(self, num_tokens: int, budget: int) -> int:
        """The largest chunk (at most `budget`) with which a request caching `num_tokens`
        positions fits in the whole pool; 0 if none does."""
        low, high = 0, budget
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.max_blocks_held(num_tokens, mid) <= self.num_blocks else (low, mid - 1)
        return low

    def block_ids(self, request_id: str) -> BlockTables:
        return self._block_tables.get(request_id) or self._empty_tables()

    def all_block_tables(self) -> ItemsView[str, BlockTables]:
        """(request id, its tables) of every request holding blocks (the live page's view)."""
        return self._block_tables.items()

    def resumable_blocks(self, request: Request) -> list[int]:
        """The blocks, over all groups in order, holding the KV that computing on from
        `num_computed_tokens` reads: what a swap saves and restores (a request with a KV budget is
        recomputed instead, never swapped; so is a hybrid, whose pool has no swap space: its state
        slots are not blocks, and are not among these)."""
        tables, start = self.block_ids(request.request_id), request.num_computed_tokens
        end = self.blocks_needed(start)
        return [b for w, state, slots, table in zip(self.sliding_windows, self.state_groups, self.state_slots, tables)
                if slots is None for b in (table if state else table[self._first_live(w, start):end])]

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def _empty_tables(self) -> BlockTables:
        return tuple([] for _ in self.sliding_windows)

    def _first_live(self, window: int | None, start: int) -> int:
        """The first table entry a computation from position `start` on still reads."""
        return 0 if window is None else max(0, start - window + 1) // self.block_size

    # -- prefix cache ----------------------------------------------------------------------
    def block_hashes(self, request: Request) -> list[BlockHash]:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_extra_keys)
        return request.block_hashes

    def _tail_hash(self, request: Request, length: int | None = None) -> BlockHash | None:
        """The hash of the partial last block of a fresh prompt's first `length` tokens (default:
        all of them). None: the request has outputs, or `length` ends on a block boundary."""
        length = request.num_prompt_tokens if length is None else length
        full, rest = divmod(length, self.block_size)
        if rest == 0 or request.num_output_tokens:
            return None
        parent = self.block_hashes(request)[full - 1] if full else ROOT_HASH
        return hash_block(parent, request.prompt_token_ids[full * self.block_size:length],
                          () if full else request.cache_extra_keys)

    def _next_hashes(self, request: Request) -> list[BlockHash]:
        """The hashes that, in order, cover the request's known tokens."""
        full = self.block_hashes(request)[:request.num_tokens // self.block_size]
        tail = self._tail_hash(request)
        return full if tail is None else [*full, tail]

    def find_cached_prefix(self, request: Request, whole_blocks_only: bool = False) -> tuple[BlockTables, int]:
        """(tables, tokens) of the longest cached prefix. A fresh prompt found whole is reused
        whole but for its last token; otherwise (and always with `whole_blocks_only`) only full
        blocks count, never the last token. A sliding group's entries before the window of the
        first token to compute are NULL_BLOCK."""
        if not self.pool.enable_caching:
            return self._empty_tables(), 0
        hashes = self._next_hashes(request)
        last_full = (request.num_tokens - 1) // self.block_size
        if whole_blocks_only:
            hashes = hashes[:last_full]
        # The last block may also be found holding all but the prompt's last token.
        lead = None if whole_blocks_only else self._tail_hash(request, request.num_tokens - 1)
        found = []
        for g, window in enumerate(self.sliding_windows):
            blocks = []
            for i, block_hash in enumerate(hashes):
                blocks.append(self.pool.lookup((g, block_hash)))
                if blocks[-1] is None and lead is not None and i == last_full:
                    blocks[-1] = self.pool.lookup((g, lead))
                if window is None and blocks[-1] is None:
                    break
            found.append(blocks)
        n = min((_leading_run(f) for w, f in zip(self.sliding_windows, found) if w is None), default=len(hashes))
        for n in range(n, -1, -1):  # noqa: B020 (counting down from the n given)
            whole = n == len(hashes) and request.num_output_tokens == 0 and not whole_blocks_only
            n_used = n if whole else min(n, last_full)
            tokens = request.num_tokens - 1 if whole else n_used * self.block_size
            starts = [self._first_live(w, tokens) for w in self.sliding_windows]
            if all(None not in f[s:n_used] for f, s in zip(found, starts)):
                return tuple([NULL_BLOCK] * s + f[s:n_used] for f, s in zip(found, starts)), tokens
        raise AssertionError("an empty prefix always qualifies")

    def prefix_in_flight(self, request: Request, num_cached_tokens: int) -> bool:
        """True if the first block the request would compute is being computed by another."""
        hashes, index = self._next_hashes(request), num_cached_tokens // self.block_size
        return index < len(hashes) and hashes[index] in self._in_flight

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    # -- allocation ------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_computed: int, num_new: int, cached_blocks: BlockTables = ()) -> bool:
        """Make room to compute tokens [num_computed, num_computed + num_new), each table starting
        with its group's `cached_blocks` if given. Blocks that left a sliding window, or that an
        eviction point drops, are given back first (they are due whatever follows); beyond that,
        False with nothing changed if the pool is too small."""
        rid = request.request_id
        tables = self._block_tables.get(rid) or self._empty_tables()
        cached = cached_blocks or self._empty_tables()
        if request.eviction is not None:
            self._evict(request, tables, num_computed)
        self._drop_out_of_window(tables, num_computed)
        # Where position num_computed lies in each group's table (a budget compacts full-attention tables).
        starts = [num_computed - self._evicted_in(g, request) for g in range(self.num_groups)]
        plans, need = [], 0
        for g, (window, table, hits) in enumerate(zip(self.sliding_windows, tables, cached)):
            existing = [*table, *hits]
            first, offset = divmod(starts[g], self.block_size)
            missing = max(0, self._table_length(g, starts[g] + num_new)
                          - max(len(existing), self._first_live(window, starts[g])))
            if self.state_slots[g] is not None:  # a slot of its own, never short: the pool is not asked
                missing = 0
            copy = first < len(existing) and self._must_copy(existing[first], offset, held=first < len(table))
            need += missing + copy + sum(1 for b in hits if b != NULL_BLOCK and self.pool.ref_counts[b] == 0)
            plans.append(copy)
        if need > self.pool.num_free_blocks:
            return False
        if rid not in self._block_tables:
            self._block_tables[rid] = tables
            # A last block found whole is registered again once computed: it may have grown full.
            self._num_cached_blocks[rid] = min(len(cached[0]), num_computed // self.block_size)
        for hits in cached:  # every group's hits leave the free list before any group allocates
            self.pool.take([b for b in hits if b != NULL_BLOCK])
        grew = False
        for g, (window, table, hits, copy) in enumerate(zip(self.sliding_windows, tables, cached, plans)):
            table.extend(hits)
            if copy:
                self._copy_on_write(table, starts[g] // self.block_size)
            table.extend([NULL_BLOCK] * (self._first_live(window, starts[g]) - len(table)))
            length = self._table_length(g, starts[g] + num_new)
            if length > len(table):
                slots = self.state_slots[g]
                table.extend([slots.allocate()] if slots is not None else self.pool.allocate(length - len(table)))
                grew = True
        if grew:
            self._mark_in_flight(request, len(tables[0]))
        return True

    def _table_length(self, group: int, num_tokens: int) -> int:
        """Entries a group's table needs to hold `num_tokens` positions (a state group: its one block)."""
        return 1 if self.state_groups[group] else self.blocks_needed(num_tokens)

    def _evicted_in(self, group: int, request: Request) -> int:
        """Positions a KV budget took out of this group's table: full-attention groups are compacted;
        a sliding group keeps its window by position, never longer than it was."""
        return request.num_evicted_tokens if self.sliding_windows[group] is None else 0

    def _evict(self, request: Request, tables: BlockTables, num_computed: int) -> None:
        """At an eviction point, drop the oldest blocks after the sinks down to the policy's count
        from every full-attention table (again at the same point: nothing)."""
        eviction = request.eviction
        if num_computed % eviction.interval:
            return
        drop = (eviction.evicted_at(num_computed) - request.num_evicted_tokens) // self.block_size
        if drop <= 0:
            return
        first = eviction.sink_tokens // self.block_size
        for window, table in zip(self.sliding_windows, tables):
            if window is None:
                self.pool.release(table[first:first + drop])
                del table[first:first + drop]
        request.num_evicted_tokens += drop * self.block_size

    def _drop_out_of_window(self, tables: BlockTables, num_computed: int) -> None:
        for window, table in zip(self.sliding_windows, tables):
            if window is None:
                continue
            dead = [i for i in range(min(len(table), self._first_live(window, num_computed))) if table[i] != NULL_BLOCK]
            self.pool.release([table[i] for i in dead])
            for i in dead:
                table[i] = NULL_BLOCK

    def _must_copy(self, block: int, offset: int, held: bool) -> bool:
        """Must writing slot `offset` of `block` go to a private copy? `held`: the writer's table
        already holds it (one of its references is the writer's own)."""
        if block == NULL_BLOCK:
            return False
        held_by_others = self.pool.ref_counts[block] - held > 0
        return held_by_others or self.pool.overwrites_cached(block, offset)

    def _copy_on_write(self, table: list[int], index: int) -> None:
        source = table[index]
        table[index] = self.pool.allocate(1)[0]
        self._copies.append((source, table[index]))
        self.pool.release([source])

    def cache_computed_blocks(self, request: Request) -> None:
        """Make the request's newly computed full blocks, and its prompt's tail block once the
        prompt is done, findable (in every group that still holds them)."""
        rid = request.request_id
        tables = self._block_tables.get(rid)
        if tables is None or not self.pool.enable_caching or not request.uses_prefix_cache:
            return
        hashes = self.block_hashes(request)
        full = min(request.num_computed_tokens // self.block_size, len(hashes))
        for g, table in enumerate(tables):
            for i in range(self._num_cached_blocks[rid], full):
                self._register(g, table[i], hashes[i], self.block_size, rid)
        self._num_cached_blocks[rid] = max(full, self._num_cached_blocks[rid])
        tail = self._tail_hash(request)
        if tail is not None and request.num_computed_tokens == request.num_prompt_tokens:
            index, covered = divmod(request.num_prompt_tokens, self.block_size)
            for g, table in enumerate(tables):
                self._register(g, table[index], tail, covered, rid)

    def _register(self, group: int, block: int, block_hash: BlockHash, num_tokens: int, rid: str) -> None:
        if block != NULL_BLOCK:
            self.pool.cache(block, (group, block_hash), num_tokens)
        if self._in_flight.get(block_hash) == rid:
            del self._in_flight[block_hash]

    def free(self, request: Request) -> None:
        rid = request.request_id
        tables = self._block_tables.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        for block_hash in [h for h, owner in self._in_flight.items() if owner == rid]:
            del self._in_flight[block_hash]
        for slots, table in zip(self.state_slots, tables or ()):
            if slots is not None:
                for slot in table:
                    slots.release(slot)
                continue
            # Tail first: a request's last blocks are the least likely to be shared, so reuse them first.
            self.pool.release([b for b in reversed(table) if b != NULL_BLOCK])

    def _mark_in_flight(self, request: Request, num_table_blocks: int) -> None:
        if not self.pool.enable_caching or not request.uses_prefix_cache:
            return
        hashes = self._next_hashes(request)
        for i in range(self._num_cached_blocks[request.request_id], min(num_table_blocks, len(hashes))):
            self._in_flight.setdefault(hashes[i], request.request_id)


def _leading_run(blocks: list[int | None]) -> int:
    return next((i for i, b in enumerate(blocks) if b is None), len(blocks))
