"""The LoRA delta on GPU as two segmented matmuls (SGMV): shrink, then expand, per run of rows.

A step's rows are sorted by adapter, so its `LoRABatch` is a few segments (slot, first, end). A
layer adds to each row of a segment its slot's s·(x A^T) B (s folded into B at load):

    shrink  t[rows, :] = x[rows] · A[slot]^T       A stacked [slots, slices·rank, in]
    expand  y[rows, cols_i] += t[rows, rank_i] · B[slot, rank_i, cols_i]   for each slice i

One program of each kernel owns a tile of one segment's rows, so it reads its slot's weights
once per tile and multiplies them with tensor cores (tl.dot); no row's weights are gathered and
no adapter is merged into W. A segment of slot -1 (no adapter) adds nothing: its programs return.

The shrink reads all of A[slot] ([S·rank, in], megabytes for a wide layer) for a few rows at
decode, so it also splits the input features over programs, each writing a float32 partial sum;
the expand adds the partials up (no atomics: the same sum every run) before it rounds t.

The expand runs once per output slice of a fused layer (q/k/v, gate/up): B is block-diagonal
over slices (`LoRALinear`), so slice i's columns need only slice i's rank rows, and a launch over
that block alone reads 1/slices of B and skips the zeros the torch path multiplies. t is rounded
to the model dtype between the two, as the torch path's x @ A^T is, and the sum into y is rounded
once, as addmm_ rounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernel_launch import KernelLaunch
from kvflow.lora.batch import LoRABatch

_BLOCK_K = 64  # input features per shrink iteration
_BLOCK_N = 64  # output columns per expand program
_MIN_DOT = 16  # tl.dot's smallest tile side
_ACC_ELEMENTS = 64 * 64  # a program's float32 accumulator: 32 registers a thread at 4 warps
_TARGET_PROGRAMS = 128  # about one per SM of an H100 (132) or A100 (108)


@triton.jit
def _segment_tile(seg_ptr, BLOCK_M: tl.constexpr):
    """This program's segment (grid axis 0) and row tile (axis 1): slot, first row, segment end."""
    seg = tl.program_id(0)
    first = tl.load(seg_ptr + seg * 3 + 1)
    return tl.load(seg_ptr + seg * 3), first + tl.program_id(1) * BLOCK_M, tl.load(seg_ptr + seg * 3 + 2)


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, part_ptr, seg_ptr, in_features, ranks, split_len,
    stride_xt, stride_xk, stride_al, stride_ar, stride_ak, stride_ps, stride_pt, stride_pr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    slot, row0, end = _segment_tile(seg_ptr, BLOCK_M)
    if (slot >= 0) & (row0 < end):
        split = tl.program_id(2)
        rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        rs = tl.arange(0, BLOCK_R)
        ks = tl.arange(0, BLOCK_K)
        a_base = a_ptr + slot.to(tl.int64) * stride_al
        k_end = tl.minimum(in_features, (split + 1) * split_len)
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for k0 in range(split * split_len, k_end, BLOCK_K):
            k = k0 + ks
            x = tl.load(x_ptr + rows[:, None] * stride_xt + k[None, :] * stride_xk,
                        mask=(rows < end)[:, None] & (k < k_end)[None, :], other=0.0)
            a = tl.load(a_base + rs[None, :] * stride_ar + k[:, None] * stride_ak,
                        mask=(rs < ranks)[None, :] & (k < k_end)[:, None], other=0.0)
            acc += tl.dot(x, a)
        tl.store(part_ptr + split * stride_ps + rows[:, None] * stride_pt + rs[None, :] * stride_pr,
                 acc, mask=(rows < end)[:, None] & (rs < ranks)[None, :])


@triton.jit
def _lora_expand_kernel(
    part_ptr, b_ptr, y_ptr, seg_ptr, rank, width, splits,
    stride_ps, stride_pt, stride_pr, stride_bl, stride_br, stride_bn, stride_yt, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    slot, row0, end = _segment_tile(seg_ptr, BLOCK_M)
    if (slot >= 0) & (row0 < end):
        rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        rs = tl.arange(0, BLOCK_R)
        row_ok = rows < end
        t = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for split in range(0, splits):  # the shrink's partial sums over slices of the input features
            t += tl.load(part_ptr + split * stride_ps + rows[:, None] * stride_pt + rs[None, :] * stride_pr,
                         mask=row_ok[:, None] & (rs < rank)[None, :], other=0.0)
        t = t.to(b_ptr.dtype.element_ty)  # x A^T rounded to the model dtype, as torch's matmul is
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_bl + rs[:, None] * stride_br + cols[None, :] * stride_bn,
                    mask=(rs < rank)[:, None] & (cols < width)[None, :], other=0.0)
        out = y_ptr + rows[:, None] * stride_yt + cols[None, :] * stride_yn
        ok = row_ok[:, None] & (cols < width)[None, :]
        y = tl.load(out, mask=ok, other=0.0)
        tl.store(out, (y.to(tl.float32) + tl.dot(t, b)).to(y_ptr.dtype.element_ty), mask=ok)


def _block_m(batch: LoRABatch, block_r: int) -> int:
    """Rows per program: a decode segment's row or few in one tl.dot-sized tile; a prefill
    segment's hundreds in tiles of up to 64, each reading its slot's weights once (fewer where
    many ranks would make the accumulator spill)."""
    rows = triton.next_power_of_2(batch.max_segment_rows)
    return max(_MIN_DOT, min(rows, 64, _ACC_ELEMENTS // block_r))


def _splits(in_features: int, programs: int) -> int:
    """Slices of the input features the shrink splits over: enough programs to keep the GPU's
    ~130 SMs reading A (a decode step has one program per adapter otherwise), each slice at
    least 4 iterations long."""
    return max(1, min(triton.cdiv(in_features, 4 * _BLOCK_K), triton.cdiv(_TARGET_PROGRAMS, programs)))


def lora_shrink_launch(x: torch.Tensor, lora_a: torch.Tensor, batch: LoRABatch) -> tuple[KernelLaunch, torch.Tensor]:
    """x [T, in], lora_a [L, S·rank, in] → the launch and the float32 partial sums it fills,
    [splits, T, S·rank] (rows of no segment are left unwritten: no expand reads them)."""
    ranks, in_features = lora_a.shape[1], x.shape[1]
    block_r = max(_MIN_DOT, triton.next_power_of_2(ranks))
    block_m = _block_m(batch, block_r)
    row_tiles = triton.cdiv(batch.max_segment_rows, block_m)
    splits = _splits(in_features, len(batch.segments) * row_tiles)
    split_len = triton.cdiv(triton.cdiv(in_features, splits), _BLOCK_K) * _BLOCK_K
    splits = triton.cdiv(in_features, split_len)  # none empty
    part = torch.empty(splits, x.shape[0], ranks, dtype=torch.float32, device=x.device)
    launch = KernelLaunch(
        _lora_shrink_kernel,
        grid=(len(batch.segments), row_tiles, splits),
        args=(x, lora_a, part, batch.segment_table, in_features, ranks, split_len,
              *x.stride(), *lora_a.stride(), *part.stride()),
        constexprs=dict(BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=_BLOCK_K),
    )
    return launch, part


def lora_expand_launch(y: torch.Tensor, part: torch.Tensor, lora_b: torch.Tensor, batch: LoRABatch) -> KernelLaunch:
    """y [T, width] += each segment's t · B[slot] [rank, width], t [T, rank] the sum of the
    shrink's partials [splits, T, rank] rounded to B's dtype: views of one slice."""
    rank, width = part.shape[2], y.shape[1]
    block_r = max(_MIN_DOT, triton.next_power_of_2(rank))
    block_m = _block_m(batch, block_r)
    return KernelLaunch(
        _lora_expand_kernel,
        grid=(len(batch.segments), triton.cdiv(batch.max_segment_rows, block_m), triton.cdiv(width, _BLOCK_N)),
        args=(part, lora_b, y, batch.segment_table, rank, width, part.shape[0], *part.stride(), *lora_b.stride(),
              *y.stride()),
        constexprs=dict(BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_R=block_r),
    )


def lora_launches(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, batch: LoRABatch,
                  max_rank: int, out_slices: list[tuple[int, int]]) -> list[KernelLaunch]:
    """One shrink, then one expand per output slice (first column, width), in launch order."""
    shrink, part = lora_shrink_launch(x, lora_a, batch)
    expands = [lora_expand_launch(y[:, first:first + width], part[:, :, i * max_rank:(i + 1) * max_rank],
                                  lora_b[:, i * max_rank:(i + 1) * max_rank, first:first + width], batch)
               for i, (first, width) in enumerate(out_slices)]
    return [shrink, *expands]


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, batch: LoRABatch,
             max_rank: int, out_slices: list[tuple[int, int]]) -> None:
    """y [T, out] += each row's s·(x A^T) B in place, as `LoRABatch.add_lora` computes it."""
    batch.check_rows(x)
    for launch in lora_launches(y, x, lora_a, lora_b, batch, max_rank, out_slices):
        launch()
