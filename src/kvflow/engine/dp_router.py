"""DPRouter: which data-parallel replica serves a request.

A conversation returns to the replica that already holds its prefix in its prefix cache: the
router keys prompts by the chained hashes of their full blocks (the very keys the prefix cache
uses, salt and LoRA adapter included) and remembers, in a bounded LRU, which replica each hash was
sent to. A new prompt goes to the replica of its longest remembered prefix, unless that replica is
more than `max_imbalance` requests busier than the least loaded one (a hot prefix must not pin all
traffic to one replica); otherwise to the least loaded replica.

Load is (requests in flight, KV cache usage): the first counted by the server itself, which is
exact and current because only it feeds the replicas, the second as each replica last reported.
Ties go to the lowest replica index, so the same history routes the same way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvflow.core.block_hash import BlockHash, cache_extra_keys, extend_block_hashes


@dataclass(frozen=True)
class ReplicaLoad:
    alive: bool
    num_in_flight: int  # requests routed there and not yet ended
    kv_cache_usage: float  # fraction of its KV blocks in use, as it last reported


class DPRouter:
    def __init__(self, block_size: int, max_hashes: int = 1 << 16, max_prefix_blocks: int = 256,
                 max_imbalance: int = 16) -> None:
        if block_size < 1 or max_hashes < 1 or max_prefix_blocks < 1 or max_imbalance < 0:
            raise ValueError("DPRouter: block_size, max_hashes and max_prefix_blocks must be >= 1, max_imbalance >= 0")
        self.block_size = block_size
        self.max_hashes = max_hashes
        self.max_prefix_blocks = max_prefix_blocks  # hash at most this much of a prompt: bounded work per request
        self.max_imbalance = max_imbalance
        self._owner: OrderedDict[BlockHash, int] = OrderedDict()  # block hash → replica, least recent first
        self.prefix_hits = 0  # requests sent where their prefix was (for tests and logs)

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None,
                     lora_int_id: int = 0) -> list[BlockHash]:
        hashes: list[BlockHash] = []
        head = list(token_ids[:self.max_prefix_blocks * self.block_size])
        extend_block_hashes(hashes, head, self.block_size, cache_extra_keys(cache_salt, lora_int_id))
        return hashes

    def route(self, hashes: list[BlockHash], loads: Sequence[ReplicaLoad]) -> int:
        """The replica for a prompt with these block hashes; remembers the choice. Raises
        RuntimeError when no replica is alive."""
        alive = [i for i, load in enumerate(loads) if load.alive]
        if not alive:
            raise RuntimeError("no data-parallel replica is alive")
        least = min(alive, key=lambda i: (loads[i].num_in_flight, loads[i].kv_cache_usage, i))
        chosen = least
        holder = self._prefix_holder(hashes)
        if holder is not None and loads[holder].alive and \
                loads[holder].num_in_flight - loads[least].num_in_flight <= self.max_imbalance:
            chosen = holder
            self.prefix_hits += 1
        self._remember(hashes, chosen)
        return chosen

    def forget_replica(self, index: int) -> None:
        """A replica died: its cache is gone, so nothing should be routed there for its prefix."""
        for block_hash in [h for h, i in self._owner.items() if i == index]:
            del self._owner[block_hash]

    def _prefix_holder(self, hashes: list[BlockHash]) -> int | None:
        for block_hash in reversed(hashes):  # the longest remembered prefix wins
            index = self._owner.get(block_hash)
            if index is not None:
                return index
        return None

    def _remember(self, hashes: list[BlockHash], index: int) -> None:
        for block_hash in hashes:
            self._owner[block_hash] = index
            self._owner.move_to_end(block_hash)
        while len(self._owner) > self.max_hashes:
            self._owner.popitem(last=False)
