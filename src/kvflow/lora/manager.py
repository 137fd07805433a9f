"""`LoRAManager`: the adapters of one model — on disk, in host memory, in device slots.

    disk ──load (checked)──► host cache (LRU, max_cpu_loras) ──activate──► device slot (LRU, max_loras)

The engine loads an adapter when a request naming it arrives, so a bad adapter is refused before
it is queued. Each step the runner asks for the step's adapters to be active: each missing one
takes a free slot or the least recently used slot that this step does not need, its weights are
copied into every LoRA layer's stacked tensors, and the step's `LoRABatch` says which slot each
row uses. The scheduler never runs more adapters at once than there are slots.

Host memory keeps `max_cpu_loras` adapters, but never evicts one that an unfinished request
uses (`in_use`, the engine's answer): a step then never reads a disk, whose files may have
changed or gone since the request was admitted, and cannot fail for everyone in it.

An id names one adapter (name and path) for the manager's whole life, even after removal: blocks
cached under the id must never be served to another adapter. The manager keeps the name and path
of each adapter loaded and not removed (of a removed one, until no unfinished request uses it);
then it forgets them and retires the id: loading any adapter under it, even the same one, is
refused. Retired ids are kept as ranges, not one by one: ids handed out in order (the server gives
each adapter a fresh one) and retired in any order merge into at most one range more than the
adapters held, so a server that loads and removes adapters for ever holds only what it serves.
"""

from __future__ import annotations

import bisect
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kvflow.lora.batch import LoRABatch
from kvflow.lora.layers import LoRAContext, LoRALinear, install_lora_layers, lora_targets
from kvflow.lora.peft_adapter import LoRAAdapter, load_peft_adapter
from kvflow.lora.request import LoRARequest


class RetiredIds:
    """A set of ids as sorted disjoint ranges [first, end), adjacent ones merged."""

    def __init__(self) -> None:
        self._firsts: list[int] = []
        self._ends: list[int] = []

    def __contains__(self, lora_int_id: int) -> bool:
        k = bisect.bisect_right(self._firsts, lora_int_id) - 1
        return k >= 0 and lora_int_id < self._ends[k]

    @property
    def num_ranges(self) -> int:
        return len(self._firsts)

    def add(self, lora_int_id: int) -> None:
        if lora_int_id in self:
            return
        k = bisect.bisect_right(self._firsts, lora_int_id)  # ranges [0, k) start before it
        extends_left = k > 0 and self._ends[k - 1] == lora_int_id
        extends_right = k < len(self._firsts) and self._firsts[k] == lora_int_id + 1
        if extends_left and extends_right:  # it closes the gap between two ranges
            self._ends[k - 1] = self._ends.pop(k)
            del self._firsts[k]
        elif extends_left:
            self._ends[k - 1] = lora_int_id + 1
        elif extends_right:
            self._firsts[k] = lora_int_id
        else:
            self._firsts.insert(k, lora_int_id)
            self._ends.insert(k, lora_int_id + 1)


@dataclass
class LoRAStats:
    disk_loads: int = 0  # adapters read and checked (first use, or again after host eviction)
    disk_load_seconds: float = 0.0
    slot_loads: int = 0  # adapters copied into a device slot
    slot_load_seconds: float = 0.0


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device, in_use: Callable[[], set[int]] = set, row_tile: int | None = None) -> None:
        """`row_tile`: deltas on row tiles of this size, so a row's bits never depend on its batch
        (batch-invariant mode)."""
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.row_tile = row_tile
        self.dtype, self.device = dtype, torch.device(device)
        self.context = LoRAContext()
        self.layers: dict[str, LoRALinear] = install_lora_layers(model, max_loras, max_lora_rank, self.context,
                                                                 dtype, self.device)
        self.targets = lora_targets(self.layers, getattr(type(model), "stacked_params", {}))
        model.register_forward_pre_hook(self.context.read_metadata, with_kwargs=True)
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # by id, least recently used first
        self._slots: OrderedDict[int, int] = OrderedDict()  # id → slot, least recently used first
        self._identities: dict[int, tuple[str, str]] = {}  # id → (name, path) of the adapters held
        self._removed: set[int] = set()  # held only for the unfinished requests that use them
        self.retired = RetiredIds()  # removed and no longer held: never loaded again
        self.in_use = in_use  # ids of adapters that unfinished requests run with
        self.stats = LoRAStats()

    # -- host memory -----------------------------------------------------------------------
    def load(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter in host memory, read and checked from disk if it is not there. Raises
        ValueError naming the adapter if it cannot run on this model. An adapter removed while
        requests still ran with it is held again, as if never removed."""
        self._check_identity(request)
        self._removed.discard(request.lora_int_id)
        return self._host_copy(request)

    def _host_copy(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self._host.get(request.lora_int_id)
        if adapter is None:
            started = time.perf_counter()
            adapter = load_peft_adapter(request, self.targets, self.max_lora_rank, self.dtype)
            self.stats.disk_loads += 1
            self.stats.disk_load_seconds += time.perf_counter() - started
            self._identities[request.lora_int_id] = (request.lora_name, request.lora_path)
            self._host[request.lora_int_id] = adapter
        self._host.move_to_end(request.lora_int_id)
        self._evict_host(keep=request.lora_int_id)
        return adapter

    def _check_identity(self, request: LoRARequest) -> None:
        """The id names this adapter or none yet. (The other adapter is named, its path is not:
        the caller may not be the one who gave it.)"""
        lora_int_id = request.lora_int_id
        if lora_int_id in self.retired:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: lora_int_id {lora_int_id} named an adapter that "
                             "was removed (blocks cached under the id may remain); load it, or any other, under a "
                             "new id")
        known = self._identities.get(lora_int_id)
        if known is not None and known != (request.lora_name, request.lora_path):
            other = f"adapter {known[0]!r}" + (" at another path" if known[0] == request.lora_name else "")
            raise ValueError(f"LoRA adapter {request.lora_name!r}: lora_int_id {lora_int_id} already names {other}; "
                             "give each adapter an id of its own")

    def _evict_host(self, keep: int) -> None:
        if len(self._host) <= self.max_cpu_loras:
            return
        pinned = self.in_use() | {keep}
        for lora_int_id in [i for i in self._host if i not in pinned][:len(self._host) - self.max_cpu_loras]:
            del self._host[lora_int_id]

    def remove(self, lora_int_id: int) -> bool:
        """Forget the adapter (weights in host memory and slot, identity) and retire its id;
        returns whether it was loaded. While unfinished requests use it, it stays for them."""
        loaded = lora_int_id in self._host or lora_int_id in self._slots
        if lora_int_id in self._identities:
            self._removed.add(lora_int_id)
            self._forget_removed()
        return loaded

    def _forget_removed(self) -> None:
        """Drop the removed adapters no unfinished request uses any more, and retire their ids."""
        if not self._removed:
            return
        for lora_int_id in self._removed - self.in_use():
            self._host.pop(lora_int_id, None)
            self._slots.pop(lora_int_id, None)
            del self._identities[lora_int_id]
            self._removed.discard(lora_int_id)
            self.retired.add(lora_int_id)

    def list_loras(self) -> list[int]:
        return list(self._host)

    # -- device slots ----------------------------------------------------------------------
    def prepare(self, requests: list[LoRARequest | None], num_rows: list[int]) -> LoRABatch | None:
        """Make the step's adapters active; `requests` and `num_rows` are per chunk, in row order.
        Returns which slot each row uses, or None if no row has an adapter."""
        self._forget_removed()  # their last requests may have finished since
        needed = list(dict.fromkeys(r for r in requests if r is not None))
        if not needed:
            return None
        if len({r.lora_int_id for r in needed}) > self.max_loras:
            raise RuntimeError(f"a step with {len(needed)} adapters, more than max_loras {self.max_loras}")
        slot_of = {r.lora_int_id: self._activate(r, needed) for r in needed}
        row_slots = [slot_of[r.lora_int_id] if r is not None else -1
                     for r, n in zip(requests, num_rows) for _ in range(n)]
        return LoRABatch.build(row_slots, self.dtype, self.device, row_tile=self.row_tile)

    def _activate(self, request: LoRARequest, needed: list[LoRARequest]) -> int:
        if request.lora_int_id in self._slots:
            self._slots.move_to_end(request.lora_int_id)
            return self._slots[request.lora_int_id]
        adapter = self._host_copy(request)
        started = time.perf_counter()
        slot = self._free_slot({r.lora_int_id for r in needed})
        by_layer: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, index), pair in adapter.weights.items():
            by_layer.setdefault(layer, {})[index] = pair
        for prefix, layer in self.layers.items():
            layer.set_slot(slot, by_layer.get(prefix, {}))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the copies are asynchronous: time them whole
        self._slots[request.lora_int_id] = slot
        self.stats.slot_loads += 1
        self.stats.slot_load_seconds += time.perf_counter() - started
        return slot

    def _free_slot(self, keep: set[int]) -> int:
        used = set(self._slots.values())
        free = next((s for s in range(self.max_loras) if s not in used), None)
        if free is not None:
            return free
        victim = next(i for i in self._slots if i not in keep)  # least recently used first
        return self._slots.pop(victim)
