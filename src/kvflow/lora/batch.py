"""One step's adapters, row by row, and the two ways of adding their deltas to a layer's output.

Rows of the flat batch come grouped by adapter (the runner orders its chunks by adapter), so the
rows sharing an adapter form a few runs: segments. For one layer with slots' stacked A and B:

- segments: per run, (x[run] A_slot^T) B_slot — two small matmuls per run (per slice of a fused
  layer for B). Exact work, but a Python-level loop over the step's adapters in every layer.
- masked: all the step's K adapters at once: x [T, in] times the K adapters' A stacked
  [K·rank, in], each row's columns of other adapters zeroed, times the K B's stacked
  [K·rank, out]. K times the arithmetic, but a fixed handful of operations per layer.

Prefill-like steps (many rows per run) take segments, decode-like steps (a few rows per run)
the masked form: `benchmarks/lora_ops.py` measures both (docs/performance.md). Neither ever
merges an adapter into W, and rows without an adapter get exactly nothing added.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A run of at least this many rows (on average) makes the segment loop worth its per-run cost.
SEGMENT_MIN_ROWS = 16


@dataclass(frozen=True)
class LoRABatch:
    segments: list[tuple[int, int, int]]  # (slot, first row, end row): runs of rows with one adapter
    slots: torch.Tensor  # [K] the distinct slots of this step, in order
    all_slots: bool  # slots == 0..max_loras-1: the stacked weights need no gather
    row_mask: torch.Tensor  # [T, K] 1 where row t uses slots[k], in the model dtype
    use_segments: bool

    @classmethod
    def build(cls, row_slots: list[int], max_loras: int, dtype: torch.dtype, device,
              segment_min_rows: int = SEGMENT_MIN_ROWS) -> LoRABatch | None:
        """`row_slots`: each row's slot, -1 for none. None when no row has an adapter."""
        segments, start = [], 0
        for row in range(1, len(row_slots) + 1):
            if row == len(row_slots) or row_slots[row] != row_slots[start]:
                if row_slots[start] >= 0:
                    segments.append((row_slots[start], start, row))
                start = row
        if not segments:
            return None
        distinct = sorted({slot for slot, _, _ in segments})
        rows = torch.tensor(row_slots, device=device)
        slots = torch.tensor(distinct, device=device)
        return cls(
            segments=segments,
            slots=slots,
            all_slots=distinct == list(range(max_loras)),
            row_mask=(rows[:, None] == slots[None, :]).to(dtype),
            use_segments=len(row_slots) >= segment_min_rows * len(segments),
        )

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 out_slices: list[tuple[int, int]], rank: int) -> None:
        """y [T, out] += each row's s·(x A^T) B^T, in place. lora_a [L, S·rank, in], lora_b [L, rank, out]."""
        if self.use_segments:
            self._add_segments(y, x, lora_a, lora_b, out_slices, rank)
        else:
            self._add_masked(y, x, lora_a, lora_b, out_slices, rank)

    def _add_segments(self, y, x, lora_a, lora_b, out_slices, rank) -> None:
        for slot, first, end in self.segments:
            xa = x[first:end] @ lora_a[slot].t()  # [n, S·rank]
            if len(out_slices) == 1:
                y[first:end].addmm_(xa, lora_b[slot])
                continue
            for index, (col, width) in enumerate(out_slices):
                y[first:end, col:col + width] += xa[:, index * rank:(index + 1) * rank] @ lora_b[slot, :, col:col + width]

    def _add_masked(self, y, x, lora_a, lora_b, out_slices, rank) -> None:
        a = lora_a if self.all_slots else lora_a.index_select(0, self.slots)  # [K, S·rank, in]
        b = lora_b if self.all_slots else lora_b.index_select(0, self.slots)  # [K, rank, out]
        k, num_slices = a.shape[0], len(out_slices)
        xa = (x @ a.reshape(-1, a.shape[-1]).t()).view(-1, k, num_slices, rank)
        xa = xa * self.row_mask[:, :, None, None]  # each row keeps only its own adapter's columns
        if num_slices == 1:
            y.addmm_(xa.view(-1, k * rank), b.view(k * rank, -1))
            return
        for index, (col, width) in enumerate(out_slices):
            y[:, col:col + width] += xa[:, :, index].reshape(-1, k * rank) @ b[:, :, col:col + width].reshape(k * rank, width)
