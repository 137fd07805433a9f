"""One step's adapters, row by row, and how a layer adds their deltas to its output.

The runner orders its chunks by adapter, so the rows sharing an adapter form a few runs
(segments). A layer adds, per run of rows [first, end) using slot s,

    y[first:end] += (x[first:end] A_s^T) B_s      A_s [slices·rank, in], B_s [slices·rank, out]

two matmuls per run and per layer, each on exactly its own rows: no row's weights are gathered,
no adapter is merged into W, and rows without an adapter get nothing added. On this CPU that beat
a gathered bmm (rows padded into one [adapters, rows, in] batch) at prefill and decode shapes
alike (`benchmarks/lora_ops.py`, docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRABatch:
    segments: list[tuple[int, int, int]]  # (slot, first row, end row): runs of rows with one adapter
    num_rows: int  # the step's rows (tokens): a layer sees exactly these, one per token

    @classmethod
    def build(cls, row_slots: list[int]) -> LoRABatch | None:
        """`row_slots`: each row's slot, -1 for none. None when no row has an adapter."""
        segments, start = [], 0
        for row in range(1, len(row_slots) + 1):
            if row == len(row_slots) or row_slots[row] != row_slots[start]:
                if row_slots[start] >= 0:
                    segments.append((row_slots[start], start, row))
                start = row
        return cls(segments, len(row_slots)) if segments else None

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """y [T, out] += each row's s·(x A^T) B, in place; lora_a [L, S·rank, in], lora_b [L, S·rank, out].
        A layer called on other rows (a routed subset, a weight read through the identity) would
        give them the wrong adapters: an error, never a silent mix-up."""
        if x.shape[0] != self.num_rows:
            raise RuntimeError(f"a LoRA layer got {x.shape[0]} rows in a step of {self.num_rows} tokens: "
                               "it must wrap only linears that see each token once")
        for slot, first, end in self.segments:
            y[first:end].addmm_(x[first:end] @ lora_a[slot].t(), lora_b[slot])
