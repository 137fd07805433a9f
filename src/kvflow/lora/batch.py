"""One step's adapters, row by row, and how a layer adds their deltas to its output.

The runner orders its chunks by adapter, so the rows sharing an adapter form a few runs
(segments). A layer adds each row's s·(x A_s^T) B_s, A_s [slices·rank, in], B_s [slices·rank, out]
(a fused layer's slices share one shrink, and B_s is block-diagonal over them), in one of two ways
chosen once per step:

- per segment: per run of rows [first, end) using slot s, y[first:end] += (x[first:end] A_s^T) B_s,
  two matmuls per run and per layer, each on exactly its own rows;
- masked: the slots the step uses lie in a range [lo, hi) of the stacked weights, contiguous
  [(hi-lo), slices·rank, in] and [(hi-lo), slices·rank, out] tensors. One shrink of every row by
  all of their A's; each slot's own rows' products gathered (padded to the most rows a slot has)
  and expanded by that slot's B alone in one batched matmul; each row's result added to its row of
  y. Five ops per layer (two matmuls, three index ops) whatever the number of adapters, for
  (hi-lo) times the shrink's arithmetic and the expand's padding rows.

A row never meets another slot's values: the masked form selects each row's own products rather
than multiplying the other slots' by a zero mask (0·NaN is NaN, 0·inf too: an adapter holding a
NaN or an infinity would turn every row of the step into NaN, the base model's included). Rows
without an adapter are not written at all, in either form.

On this CPU a small matmul costs a fixed ~10–30 µs whatever its size (bf16 goes through oneDNN),
so at decode (a row or a few per adapter) the segment loop's 2K calls per layer were a fifth of
the step with 4 adapters, while the masked form's extra arithmetic is a few rows times a few
adapters; at prefill (hundreds of rows per adapter) the extra arithmetic loses. A step takes the
masked form when the row·slot products it adds, rows × (hi-lo-1), cost less than the matmul calls
it saves, 2K-3, at `MASKED_ROWS_PER_CALL` row·slot products per call (`benchmarks/lora_ops.py`
measures both forms per shape). The rule prices the expand as every row by every slot, more than
the gathered expand does, so it errs towards the segment loop. No row's weights are gathered and
no adapter is merged into W.

With `--batch-invariant` (`row_tile`), a row's delta must not depend on its batch: the segment
form runs each segment's two matmuls on tiles of exactly `row_tile` rows, the last one padded
with zero rows (as the batch-invariant linear layers do), and adds the delta to y afterwards
instead of inside the matmul, so every row meets the same kernel, blocking and additions alone
or beside others.

On CUDA with triton, the layers launch `lora.triton_ops`' segmented kernels instead (one program
per tile of a segment's rows, so the masked form's trade does not arise there): they read the
segments from `segment_table`, a copy on the device made once per step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvflow.config import triton_installed

# Row·slot products of the masked form's extra arithmetic that cost about one small matmul call
# (benchmarks/lora_ops.py, SmolLM2's layers in bf16: the forms cross near 128 rows with 4 adapters).
MASKED_ROWS_PER_CALL = 64


@dataclass(frozen=True)
class MaskedForm:
    """How a step takes the masked form. The shrink multiplies every row by the A of every slot in
    [first_slot, first_slot + num_slots): row r's product with slot j is row r·num_slots + j of
    that [rows · slots, S·rank] result. `gather` lists, slot by slot, the products of its own rows,
    each slot's list padded to `width` (the most rows any slot has) with a repeat of one of them;
    the expand multiplies slot j's list by slot j's B alone, and `picks` are the positions of the
    real (not padding) entries among its [slots · width] results, which go into `rows` of y."""

    first_slot: int
    num_slots: int
    width: int
    gather: torch.Tensor  # [num_slots · width] int64
    picks: torch.Tensor  # [R] int64, R the rows with an adapter
    rows: torch.Tensor  # [R] int64

    @classmethod
    def build(cls, row_slots: list[int], first_slot: int, num_slots: int, device) -> MaskedForm:
        own: list[list[int]] = [[] for _ in range(num_slots)]
        for row, slot in enumerate(row_slots):
            if slot >= 0:
                own[slot - first_slot].append(row)
        width = max(map(len, own))
        # A slot of the range that no row uses still gets `width` entries (bmm's batch is the whole
        # range); they and every padding entry are computed and never picked.
        gather = [row * num_slots + j for j, rows in enumerate(own)
                  for row in rows + [rows[0] if rows else 0] * (width - len(rows))]
        picks = [j * width + i for j, rows in enumerate(own) for i in range(len(rows))]
        index = functools.partial(torch.tensor, dtype=torch.int64, device=device)
        return cls(first_slot, num_slots, width, index(gather), index(picks), index([r for rows in own for r in rows]))

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        slots = slice(self.first_slot, self.first_slot + self.num_slots)
        xa = x @ lora_a[slots].flatten(0, 1).t()  # [T, slots·S·rank]: every row by every slot's A
        own = xa.view(-1, lora_a.shape[1]).index_select(0, self.gather).view(self.num_slots, self.width, -1)
        products = torch.bmm(own, lora_b[slots])  # [slots, width, out]: each slot's rows by its own B
        y.index_add_(0, self.rows, products.view(-1, y.shape[1]).index_select(0, self.picks))


@dataclass(frozen=True)
class LoRABatch:
    segments: list[tuple[int, int, int]]  # (slot, first row, end row): runs of rows with one adapter
    num_rows: int  # the step's rows (tokens): a layer sees exactly these, one per token
    masked: MaskedForm | None  # None: per segment
    segment_table: torch.Tensor  # the segments as int32 [segments, 3] on the device, for the kernels
    row_tile: int | None = None  # per segment on tiles of this many rows (batch-invariant mode)

    @classmethod
    def build(cls, row_slots: list[int], dtype: torch.dtype = torch.float32, device="cpu",
              masked: bool | None = None, row_tile: int | None = None) -> LoRABatch | None:
        """`row_slots`: each row's slot, -1 for none. None when no row has an adapter. `masked`
        forces a form (tests, benchmarks); by default the cheaper one for this shape. `dtype`, the
        layers', shapes nothing: both forms hold indices, no float mask. `row_tile`: the
        batch-invariant segment form (never masked)."""
        segments, start = [], 0
        for row in range(1, len(row_slots) + 1):
            if row == len(row_slots) or row_slots[row] != row_slots[start]:
                if row_slots[start] >= 0:
                    segments.append((row_slots[start], start, row))
                start = row
        if not segments:
            return None
        lo, hi = min(s for s, _, _ in segments), max(s for s, _, _ in segments) + 1
        if row_tile is not None or masked is None and torch.device(device).type == "cuda" and triton_installed():
            masked = False  # the kernels take every segment in one launch; tiles are per segment
        if masked is None:
            masked = len(row_slots) * (hi - lo - 1) <= MASKED_ROWS_PER_CALL * (2 * len(segments) - 3)
        form = MaskedForm.build(row_slots, lo, hi - lo, device) if masked else None
        table = torch.tensor(segments, dtype=torch.int32, device=device)
        return cls(segments, len(row_slots), form, table, row_tile)

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
        if self.masked is not None:
            self.masked.add_lora(y, x, lora_a, lora_b)
            return
        for slot, first, end in self.segments:
            if self.row_tile is None:
                y[first:end].addmm_(x[first:end] @ lora_a[slot].t(), lora_b[slot])
            else:
                y[first:end] += _row_tiled_delta(x[first:end], lora_a[slot], lora_b[slot], self.row_tile)


def _row_tiled_delta(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, tile: int) -> torch.Tensor:
    """(x A^T) B computed `tile` rows at a time, zero rows padding the last tile: each row's bits
    are the same whatever rows share its segment."""
    n = x.shape[0]
    if n % tile:
        x = torch.cat([x, x.new_zeros(tile - n % tile, x.shape[1])])
    return torch.cat([(part @ lora_a.t()) @ lora_b for part in x.split(tile)])[:n]
