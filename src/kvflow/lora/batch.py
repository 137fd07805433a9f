"""One step's adapters, row by row, and how a layer adds their deltas to its output.

The runner orders its chunks by adapter, so the rows sharing an adapter form a few runs
(segments). A layer adds each row's s·(x A_s^T) B_s, A_s [slices·rank, in], B_s [slices·rank, out]
(a fused layer's slices share one shrink, and B_s is block-diagonal over them), in one of two ways
chosen once per step:

- per segment: per run of rows [first, end) using slot s, y[first:end] += (x[first:end] A_s^T) B_s,
  two matmuls per run and per layer, each on exactly its own rows;
- masked: the slots the step uses lie in a range [lo, hi) of the stacked weights, a contiguous
  [(hi-lo)·slices·rank, in] matrix. One shrink of every row by all of them, each row's columns of
  other slots zeroed by a one-hot mask, and one expand by the stacked B: y += (x A^T ⊙ M) B.
  Three ops per layer whatever the number of adapters, for (hi-lo) times the delta's arithmetic.

On this CPU a small matmul costs a fixed ~10–30 µs whatever its size (bf16 goes through oneDNN),
so at decode (a row or a few per adapter) the segment loop's 2K calls per layer were a fifth of
the step with 4 adapters, while the masked form's extra arithmetic is a few rows times a few
adapters; at prefill (hundreds of rows per adapter) the extra arithmetic loses. A step takes the
masked form when the row·slot products it adds, rows × (hi-lo-1), cost less than the matmul calls
it saves, 2K-3, at `MASKED_ROWS_PER_CALL` row·slot products per call (`benchmarks/lora_ops.py`
measures both forms per shape). No row's weights are gathered, no adapter is merged into W, and
rows without an adapter get exactly nothing added (a zero mask row, or no segment).

On CUDA with triton, the layers launch `lora.triton_ops`' segmented kernels instead (one program
per tile of a segment's rows, so the masked form's trade does not arise there): they read the
segments from `segment_table`, a copy on the device made once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.config import triton_installed

# Row·slot products of the masked form's extra arithmetic that cost about one small matmul call
# (benchmarks/lora_ops.py, SmolLM2's layers in bf16: the forms cross near 128 rows with 4 adapters).
MASKED_ROWS_PER_CALL = 64


@dataclass(frozen=True)
class LoRABatch:
    segments: list[tuple[int, int, int]]  # (slot, first row, end row): runs of rows with one adapter
    num_rows: int  # the step's rows (tokens): a layer sees exactly these, one per token
    first_slot: int  # masked form: the slots [first_slot, first_slot + mask.shape[1]) ...
    mask: torch.Tensor | None  # ... and each row's one-hot [rows, slots, 1]; None: per segment
    segment_table: torch.Tensor  # the segments as int32 [segments, 3] on the device, for the kernels

    @classmethod
    def build(cls, row_slots: list[int], dtype: torch.dtype = torch.float32, device="cpu",
              masked: bool | None = None) -> LoRABatch | None:
        """`row_slots`: each row's slot, -1 for none. None when no row has an adapter. `masked`
        forces a form (tests, benchmarks); by default the cheaper one for this shape."""
        segments, start = [], 0
        for row in range(1, len(row_slots) + 1):
            if row == len(row_slots) or row_slots[row] != row_slots[start]:
                if row_slots[start] >= 0:
                    segments.append((row_slots[start], start, row))
                start = row
        if not segments:
            return None
        lo, hi = min(s for s, _, _ in segments), max(s for s, _, _ in segments) + 1
        if masked is None and torch.device(device).type == "cuda" and triton_installed():
            masked = False  # the kernels take every segment in one launch
        if masked is None:
            masked = len(row_slots) * (hi - lo - 1) <= MASKED_ROWS_PER_CALL * (2 * len(segments) - 3)
        mask = None
        if masked:
            slots = torch.tensor(row_slots, device=device)
            mask = (slots[:, None] == torch.arange(lo, hi, device=device)).to(dtype)[:, :, None]
        table = torch.tensor(segments, dtype=torch.int32, device=device)
        return cls(segments, len(row_slots), lo, mask, table)

    @property
    def max_segment_rows(self) -> int:
        return max(end - first for _, first, end in self.segments)

    def check_rows(self, x: torch.Tensor) -> None:
        """A layer called on other rows (a routed subset, a weight read through the identity)
        would give them the wrong adapters: an error, never a silent mix-up."""
        if x.shape[0] != self.num_rows:
            raise RuntimeError(f"a LoRA layer got {x.shape[0]} rows in a step of {self.num_rows} tokens: "
                               "it must wrap only linears that see each token once")

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """y [T, out] += each row's s·(x A^T) B, in place; lora_a [L, S·rank, in], lora_b [L, S·rank, out]."""
        self.check_rows(x)
        if self.mask is None:
            for slot, first, end in self.segments:
                y[first:end].addmm_(x[first:end] @ lora_a[slot].t(), lora_b[slot])
            return
        slots = slice(self.first_slot, self.first_slot + self.mask.shape[1])
        xa = x @ lora_a[slots].flatten(0, 1).t()  # [T, slots·S·rank]: every row by every slot's A
        xa.view(x.shape[0], self.mask.shape[1], -1).mul_(self.mask)  # keep each row's own slot
        y.addmm_(xa, lora_b[slots].flatten(0, 1))
