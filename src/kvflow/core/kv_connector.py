"""The scheduler half of a KV connector: KV that comes from, or goes to, outside this engine.

A connector moves KV blocks between this engine's pool and somewhere else, keyed by the prefix
cache's chained block hashes (equal keys mean equal prefixes, whoever computed them). It has two
halves. This one, in the scheduler, decides:

- when a request is admitted, how many tokens after its local prefix hit can be loaded instead of
  computed (`get_num_matched_tokens`), and, once blocks are allocated for them, which blocks to
  load into (`update_state_after_alloc`);
- when a step finishes a request's prompt, which of its blocks to save (`build_connector_meta`);
- when the worker could not load a request's blocks, to load nothing more for it
  (`request_load_failed`);
- when a request ends, what to forget (`request_finished`).

Each step it hands the worker half (`kvflow.worker.kv_connector`) a `KVConnectorMetadata`: the
(key, block) pairs to load before the forward pass and to save after it. Loads and saves are
synchronous within the step, so a block is never freed or reused while a copy of it is under way.

What is transferred is a prompt's KV but for its last token: the receiving engine computes that
token itself, because it needs its logits to sample the first output token; so it recomputes
nothing it received. The keys are the hashes of the prompt's full blocks before that token and of
the partial block that ends there (`transfer_keys`).

`KVStoreConnector` is the implementation: its blocks wait in a `KVBlockStore`
(`kvflow.kv_store`) — a directory the engines of one host share (kv_connector
"SharedStorageConnector"), or a Redis server for engines on different hosts
("RedisStoreConnector"). A prefill engine (kv_role "kv_producer") saves; a decode engine
("kv_consumer") loads, and deletes what its requests used when they end; "kv_both" does both.

The store may lose a block (a bounded store evicts the least recently used) or go away. A lookup
stops at the first missing block, and a store that cannot answer matches nothing: the rest of
the prompt is computed. A block lost between the lookup and the load (in the same step) fails
that request's load: the worker reports it, the scheduler throws away what the step computed for
it and sends it back to waiting (`Scheduler.recompute_failed_loads`), and it then computes its
prompt here. Nothing waits on the store longer than its timeout.

`OffloadConnector` is KV offloading (`--kv-offloading-size`): this engine's own blocks written
through to its tiers (host memory, disk, a shared store) and loaded back asynchronously.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvflow.core.block_hash import ROOT_HASH, BlockHash, extend_block_hashes, hash_block
from kvflow.core.request import Request
from kvflow.kv_store.base import KVBlockStore, KVStoreError, StoreFailureLog
from kvflow.kv_transfer_config import KV_ROLES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockTransfer:
    request_id: str
    key: BlockHash
    block_id: int


@dataclass
class TransferStats:
    """A request's KV transfer: bytes moved and seconds spent (summed over its blocks); `loaded`:
    its asynchronous load (KV offloading) landed in its blocks this step, so it may proceed."""

    bytes: int = 0
    seconds: float = 0.0
    loaded: bool = False

    def add(self, num_bytes: int, seconds: float) -> None:
        self.bytes += num_bytes
        self.seconds += seconds


@dataclass
class KVConnectorMetadata:
    """What the worker half does this step: loads before the forward pass, saves after it;
    asynchronous loads (`fetches`) to start, and those to give up (`cancelled`: their requests
    were preempted or ended, their blocks are no longer theirs)."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    fetches: list[BlockTransfer] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.loads or self.saves or self.fetches or self.cancelled)


def transfer_keys(prompt_token_ids: list[int], block_size: int, extra_keys: tuple = ()) -> list[tuple[BlockHash, int]]:
    """(key, tokens covered up to and including it) of each block of the prompt but its last
    token: the chained hashes of its full blocks, then of the partial block that ends there.
    `extra_keys`: the request's cache keys (adapter, salt), as the prefix cache hashes them."""
    prefix = prompt_token_ids[:-1]
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, prefix, block_size, extra_keys)
    keys = [(h, (i + 1) * block_size) for i, h in enumerate(hashes)]
    full = len(hashes) * block_size
    if full < len(prefix):
        parent = hashes[-1] if hashes else ROOT_HASH
        keys.append((hash_block(parent, prefix[full:], () if hashes else extra_keys), len(prefix)))
    return keys


def rank_key(key: BlockHash, rank: int, world_size: int) -> BlockHash:
    """The key of rank `rank`'s part of a block (under tensor parallel each rank holds its own KV
    heads, stored apart); one rank's key is the block's own, so single-rank stores are unchanged."""
    if world_size == 1:
        return key
    return hashlib.sha256(key + f"/rank {rank} of {world_size}".encode()).digest()


class KVConnectorScheduler:
    """The interface the scheduler calls; the base class transfers nothing."""

    #: True: loads run beside the steps (`OffloadConnector`); the scheduler parks a request whose
    #: tokens are being loaded (WAITING_FOR_REMOTE_KVS) until the worker reports them landed.
    loads_async = False

    def get_num_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after the first `num_computed_tokens` (found locally) that can be loaded."""
        return 0

    def update_state_after_alloc(self, request: Request, block_table: list[int], num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        """Blocks are allocated: load the external tokens into `block_table`'s blocks that hold them."""

    def build_connector_meta(self, chunks, requests: dict[str, Request]) -> KVConnectorMetadata:
        """This step's loads and saves; clears what was pending."""
        return KVConnectorMetadata()

    def request_load_failed(self, request: Request) -> None:
        """The worker could not load the request's blocks: load nothing more for it."""

    def request_finished(self, request: Request) -> None:
        """The request ended (finished, aborted): forget its pending transfers."""

    def cancel_load(self, request: Request) -> None:
        """The request was preempted while its asynchronous load ran: the worker drops it."""

    def loads_landed(self, request_ids: Iterable[str]) -> None:
        """The worker copied these requests' asynchronous loads into their blocks."""


class KVStoreConnector(KVConnectorScheduler):
    """Blocks in a `KVBlockStore` (a directory on one host, a Redis server across hosts)."""

    def __init__(self, store: KVBlockStore, kv_role: str, block_size: int, world_size: int = 1) -> None:
        """`world_size`: the tensor-parallel ranks, each of which stores its part of every block."""
        if kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}; got {kv_role!r}")
        self.store = store
        self.kv_role = kv_role
        self.block_size = block_size
        self.world_size = world_size
        self._loads: list[BlockTransfer] = []
        self._load_failed: set[str] = set()  # requests that compute their prompts here, whatever the store holds
        self._failures = StoreFailureLog(logger)

    @property
    def saves(self) -> bool:
        return self.kv_role != "kv_consumer"

    @property
    def loads(self) -> bool:
        return self.kv_role != "kv_producer"

    def _keys(self, request: Request) -> list[tuple[BlockHash, int]]:
        return transfer_keys(request.prompt_token_ids, self.block_size, request.cache_extra_keys)

    def get_num_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """One lookup of every key after the local hit; it stops at the first missing block (one
        evicted, or never saved): the tokens from there on are computed."""
        if not self.loads or request.num_output_tokens or request.request_id in self._load_failed:
            return 0
        keys = self._keys(request)[num_computed_tokens // self.block_size:]
        if not keys:
            return 0
        try:  # every rank's part of a block must be there: the prefix all ranks can load
            found = min(self.store.lookup([rank_key(key, rank, self.world_size) for key, _ in keys])
                        for rank in range(self.world_size))
        except KVStoreError as e:  # the store is down: the prompt is computed here
            self._failures.report("looking up a prompt's KV blocks", e)
            return 0
        return max(0, keys[found - 1][1] - num_computed_tokens) if found else 0

    def update_state_after_alloc(self, request: Request, block_table: list[int], num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        first = num_computed_tokens // self.block_size
        for index, (key, covered) in enumerate(self._keys(request)[first:], first):
            if covered > num_computed_tokens + num_external_tokens:
                break
            self._loads.append(BlockTransfer(request.request_id, key, block_table[index]))

    def build_connector_meta(self, chunks, requests: dict[str, Request]) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(loads=self._loads)
        self._loads = []
        if self.saves:
            for chunk in chunks:  # the step that computes a prompt's last token saves the rest of it
                request = requests[chunk.request_id]
                if chunk.sample and not request.num_output_tokens:
                    table = chunk.block_ids[0]
                    meta.saves.extend(BlockTransfer(request.request_id, key, table[i])
                                      for i, (key, _) in enumerate(self._keys(request)))
        return meta

    def request_load_failed(self, request: Request) -> None:
        """Had it blocks once and not the next moment, the store may flap again: the request
        computes its prompt rather than try a second load."""
        self._load_failed.add(request.request_id)

    def request_finished(self, request: Request) -> None:
        """A consumer deletes its request's blocks from the store, loaded or not (its own prefix
        cache may have held some): a transfer serves one request. Another request of the same
        prefix still in flight then finds them in this engine's prefix cache, or computes them."""
        self._loads = [t for t in self._loads if t.request_id != request.request_id]
        self._load_failed.discard(request.request_id)
        if self.kv_role == "kv_consumer":
            self.discard(request.prompt_token_ids, request.cache_extra_keys)

    def discard(self, prompt_token_ids: list[int], extra_keys: tuple = ()) -> None:
        """Delete whatever was saved for a prompt that no engine will load now (its request ended)."""
        keys = [rank_key(key, rank, self.world_size) for key, _ in transfer_keys(prompt_token_ids, self.block_size, extra_keys)
                for rank in range(self.world_size)]
        try:
            self.store.delete(keys)
        except KVStoreError as e:  # a bounded store evicts them in time
            self._failures.report("deleting a finished request's KV blocks", e)


class OffloadConnector(KVConnectorScheduler):
    """KV offloading (`--kv-offloading-size`): this engine's own blocks, kept in its tiers (host
    memory, disk, a shared store: `kvflow.kv_store.tiered`) beyond the life of the pool's copy.

    Write-through: every full block of every request, prompt and output alike, is saved in the
    step that computes it (the worker copies it to host memory after the forward pass, the tiers
    take it from there on a thread), so a block the pool later evicts needs no copy then. Its key
    is its prefix-cache hash (rank 0's part's, `rank_key`), so a later request finds exactly the
    blocks the prefix cache would have found.

    A request admitted with blocks after its local prefix hit in the tiers waits for them
    (`loads_async`: the scheduler parks it in WAITING_FOR_REMOTE_KVS with its blocks allocated);
    the worker fetches them on its thread and copies them into those blocks before a later step,
    then reports them landed (`TransferStats.loaded`). What moves is whole blocks before the
    request's last token (it computes that one, for its logits).

    Lookups ask rank 0's tiers only (the store the engine shares with rank 0's worker): under
    tensor parallel a block whose other parts another rank's tiers lost fails that request's load
    on every rank (the ranks agree), and it computes its prompt.
    """

    loads_async = True

    def __init__(self, store: KVBlockStore, block_size: int, world_size: int = 1) -> None:
        self.store = store
        self.block_size = block_size
        self.world_size = world_size
        self._fetches: list[BlockTransfer] = []
        self._cancelled: list[str] = []
        self._loading: set[str] = set()  # requests whose fetch the worker runs
        self._saved: dict[str, int] = {}  # request → its leading full blocks already saved
        self._load_failed: set[str] = set()
        self._failures = StoreFailureLog(logger)

    def _loadable_keys(self, request: Request) -> list[BlockHash]:
        """Hashes of the full blocks before the request's last token (the prefix cache's own)."""
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_extra_keys)
        return request.block_hashes[:(request.num_tokens - 1) // self.block_size]

    def get_num_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens in whole blocks after the local hit that the tiers hold, from the first (one
        batched lookup per tier)."""
        first, inside = divmod(num_computed_tokens, self.block_size)
        if inside or not request.uses_prefix_cache or request.request_id in self._load_failed:
            return 0  # a prompt found whole locally ends inside a block: nothing after it is loadable
        keys = self._loadable_keys(request)[first:]
        if not keys:
            return 0
        try:
            found = self.store.lookup([rank_key(key, 0, self.world_size) for key in keys])
        except KVStoreError as e:
            self._failures.report("looking up offloaded KV blocks", e)
            return 0
        return found * self.block_size

    def update_state_after_alloc(self, request: Request, block_table: list[int], num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        keys = self._loadable_keys(request)
        first = num_computed_tokens // self.block_size
        last = (num_computed_tokens + num_external_tokens) // self.block_size
        self._fetches.extend(BlockTransfer(request.request_id, keys[i], block_table[i]) for i in range(first, last))
        self._loading.add(request.request_id)
        self._saved[request.request_id] = max(self._saved.get(request.request_id, 0), last)

    def build_connector_meta(self, chunks, requests: dict[str, Request]) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(fetches=self._fetches, cancelled=self._cancelled)
        self._fetches, self._cancelled = [], []
        for chunk in chunks:
            meta.saves.extend(self._new_full_blocks(chunk, requests[chunk.request_id]))
        return meta

    def _new_full_blocks(self, chunk, request: Request) -> list[BlockTransfer]:
        """The full blocks the chunk completes (and any an earlier step's accepted proposals
        completed), not saved yet. Proposals are not known tokens: a block they would fill is
        saved once they are accepted, the next step."""
        if not request.uses_prefix_cache:  # a KV budget's blocks are not the full context's
            return []
        hashes = request.block_hashes
        extend_block_hashes(hashes, request.all_token_ids, self.block_size, request.cache_extra_keys)
        known = chunk.start_pos + chunk.num_tokens - chunk.num_spec_tokens
        upto = min(known // self.block_size, len(hashes))
        first = self._saved.setdefault(request.request_id, chunk.start_pos // self.block_size)
        self._saved[request.request_id] = max(first, upto)
        table = chunk.block_ids[0]
        return [BlockTransfer(request.request_id, hashes[i], table[i]) for i in range(first, upto)]

    def loads_landed(self, request_ids: Iterable[str]) -> None:
        self._loading.difference_update(request_ids)

    def request_load_failed(self, request: Request) -> None:
        """Its blocks were there at the lookup and not at the load: it computes its prompt rather
        than trust the tiers twice."""
        self._loading.discard(request.request_id)
        self._load_failed.add(request.request_id)
        self._saved.pop(request.request_id, None)  # what it computes now is saved again

    def cancel_load(self, request: Request) -> None:
        self._fetches = [t for t in self._fetches if t.request_id != request.request_id]
        if request.request_id in self._loading:
            self._loading.discard(request.request_id)
            self._cancelled.append(request.request_id)
            self._saved.pop(request.request_id, None)  # its loaded blocks never landed

    def request_finished(self, request: Request) -> None:
        """Its blocks stay in the tiers for the next request with its prefix."""
        self.cancel_load(request)
        self._saved.pop(request.request_id, None)
        self._load_failed.discard(request.request_id)
