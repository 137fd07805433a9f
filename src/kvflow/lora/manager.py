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
cached under the id must never be served to another adapter.
"""

from __future__ import annotations

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


@dataclass
class LoRAStats:
    disk_loads: int = 0  # adapters read and checked (first use, or again after host eviction)
    disk_load_seconds: float = 0.0
    slot_loads: int = 0  # adapters copied into a device slot
    slot_load_seconds: float = 0.0


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device, in_use: Callable[[], set[int]] = set) -> None:
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.dtype, self.device = dtype, torch.device(device)
        self.context = LoRAContext()
        self.layers: dict[str, LoRALinear] = install_lora_layers(model, max_loras, max_lora_rank, self.context,
                                                                 dtype, self.device)
        self.targets = lora_targets(self.layers, getattr(type(model), "stacked_params", {}))
        model.register_forward_pre_hook(self.context.read_metadata, with_kwargs=True)
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # by id, least recently used first
        self._slots: OrderedDict[int, int] = OrderedDict()  # id → slot, least recently used first
        self._identities: dict[int, tuple[str, str]] = {}  # id → (name, path), never forgotten
        self.in_use = in_use  # ids of adapters that unfinished requests run with
        self.stats = LoRAStats()

    # -- host memory -----------------------------------------------------------------------
    def load(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter in host memory, read and checked from disk if it is not there. Raises
        ValueError naming the adapter if it cannot run on this model."""
        identity = (request.lora_name, request.lora_path)
        known = self._identities.get(request.lora_int_id)
        if known is not None and known != identity:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: lora_int_id {request.lora_int_id} already names "
                             f"adapter {known[0]!r} at {known[1]!r}; give each adapter an id of its own")
        adapter = self._host.get(request.lora_int_id)
        if adapter is None:
            started = time.perf_counter()
            adapter = load_peft_adapter(request, self.targets, self.max_lora_rank, self.dtype)
            self.stats.disk_loads += 1
            self.stats.disk_load_seconds += time.perf_counter() - started
            self._identities[request.lora_int_id] = identity
            self._host[request.lora_int_id] = adapter
        self._host.move_to_end(request.lora_int_id)
        self._evict_host(keep=request.lora_int_id)
        return adapter

    def _evict_host(self, keep: int) -> None:
        if len(self._host) <= self.max_cpu_loras:
            return
        pinned = self.in_use() | {keep}
        for lora_int_id in [i for i in self._host if i not in pinned][:len(self._host) - self.max_cpu_loras]:
            del self._host[lora_int_id]

    def remove(self, lora_int_id: int) -> bool:
        """Forget the adapter's weights (host and slot); returns whether it was loaded. While
        unfinished requests use it, it stays for them, to be evicted like any other later."""
        loaded = lora_int_id in self._host or lora_int_id in self._slots
        if lora_int_id not in self.in_use():
            self._host.pop(lora_int_id, None)
            self._slots.pop(lora_int_id, None)
        return loaded

    def list_loras(self) -> list[int]:
        return list(self._host)

    # -- device slots ----------------------------------------------------------------------
    def prepare(self, requests: list[LoRARequest | None], num_rows: list[int]) -> LoRABatch | None:
        """Make the step's adapters active; `requests` and `num_rows` are per chunk, in row order.
        Returns which slot each row uses, or None if no row has an adapter."""
        needed = list(dict.fromkeys(r for r in requests if r is not None))
        if not needed:
            return None
        if len({r.lora_int_id for r in needed}) > self.max_loras:
            raise RuntimeError(f"a step with {len(needed)} adapters, more than max_loras {self.max_loras}")
        slot_of = {r.lora_int_id: self._activate(r, needed) for r in needed}
        row_slots = [slot_of[r.lora_int_id] if r is not None else -1
                     for r, n in zip(requests, num_rows) for _ in range(n)]
        return LoRABatch.build(row_slots, self.dtype, self.device)

    def _activate(self, request: LoRARequest, needed: list[LoRARequest]) -> int:
        if request.lora_int_id in self._slots:
            self._slots.move_to_end(request.lora_int_id)
            return self._slots[request.lora_int_id]
        adapter = self.load(request)
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
