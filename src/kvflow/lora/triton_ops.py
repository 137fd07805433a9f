"""The LoRA delta on GPU as two segmented matmuls (SGMV): shrink, then expand, per run of rows.

A step's rows are sorted by adapter, so its `LoRABatch` is a few segments (slot, first, end). A
layer adds to each row of a segment its slot's s·(x A^T) B (s folded into B at load):

    shrink  t[rows, :] = x[rows] · A[slot]^T       A stacked [slots, slices·rank, in]
    expand  y[rows, cols_i] += t[rows, rank_i] · B[slot, rank_i, cols_i]   for each slice i

One program of each kernel owns a tile of one segment's rows, so it reads its slot's weights
once per tile and multiplies them with tensor cores (tl.dot); no row's weights are gathered and
no adapter is merged into W. A segment of slot -1 (no adapter) adds nothing: its programs return.

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


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, t_ptr, seg_ptr, in_features, ranks,
    stride_xt, stride_xk, stride_al, stride_ar, stride_ak, stride_tt, stride_tr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    slot = tl.load(seg_ptr + seg * 3)
    first = tl.load(seg_ptr + seg * 3 + 1)
    end = tl.load(seg_ptr + seg * 3 + 2)
    row0 = first + tl.program_id(1) * BLOCK_M
    if (slot >= 0) & (row0 < end):
        rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        rs = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
        ks = tl.arange(0, BLOCK_K)
        a_base = a_ptr + slot.to(tl.int64) * stride_al
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for k0 in range(0, in_features, BLOCK_K):
            k = k0 + ks
            x = tl.load(x_ptr + rows[:, None] * stride_xt + k[None, :] * stride_xk,
                        mask=(rows < end)[:, None] & (k < in_features)[None, :], other=0.0)
            a = tl.load(a_base + rs[None, :] * stride_ar + k[:, None] * stride_ak,
                        mask=(rs < ranks)[None, :] & (k < in_features)[:, None], other=0.0)
            acc += tl.dot(x, a)
        tl.store(t_ptr + rows[:, None] * stride_tt + rs[None, :] * stride_tr,
                 acc.to(t_ptr.dtype.element_ty), mask=(rows < end)[:, None] & (rs < ranks)[None, :])


@triton.jit
def _lora_expand_kernel(
    t_ptr, b_ptr, y_ptr, seg_ptr, rank, width,
    stride_tt, stride_tr, stride_bl, stride_br, stride_bn, stride_yt, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    seg = tl.program_id(0)
    slot = tl.load(seg_ptr + seg * 3)
    first = tl.load(seg_ptr + seg * 3 + 1)
    end = tl.load(seg_ptr + seg * 3 + 2)
    row0 = first + tl.program_id(1) * BLOCK_M
    if (slot >= 0) & (row0 < end):
        rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        rs = tl.arange(0, BLOCK_R)
        row_ok = rows < end
        t = tl.load(t_ptr + rows[:, None] * stride_tt + rs[None, :] * stride_tr,
                    mask=row_ok[:, None] & (rs < rank)[None, :], other=0.0)
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_bl + rs[:, None] * stride_br + cols[None, :] * stride_bn,
                    mask=(rs < rank)[:, None] & (cols < width)[None, :], other=0.0)
        out = y_ptr + rows[:, None] * stride_yt + cols[None, :] * stride_yn
        ok = row_ok[:, None] & (cols < width)[None, :]
        y = tl.load(out, mask=ok, other=0.0)
        tl.store(out, (y.to(tl.float32) + tl.dot(t, b)).to(y_ptr.dtype.element_ty), mask=ok)


def _block_m(batch: LoRABatch) -> int:
    """Rows per program: a decode segment's row or few in one tl.dot-sized tile; a prefill
    segment's hundreds in tiles of 64, each reading its slot's weights once."""
    return min(64, max(_MIN_DOT, triton.next_power_of_2(batch.max_segment_rows)))


def lora_shrink_launch(x: torch.Tensor, lora_a: torch.Tensor, batch: LoRABatch) -> tuple[KernelLaunch, torch.Tensor]:
    """x [T, in], lora_a [L, S·rank, in] → the launch and t [T, S·rank] it fills (rows of no
    segment are left unwritten: no expand reads them)."""
    ranks = lora_a.shape[1]
    t = torch.empty(x.shape[0], ranks, dtype=x.dtype, device=x.device)
    block_m, block_r = _block_m(batch), max(_MIN_DOT, triton.next_power_of_2(ranks))
    launch = KernelLaunch(
        _lora_shrink_kernel,
        grid=(len(batch.segments), triton.cdiv(batch.max_segment_rows, block_m), triton.cdiv(ranks, block_r)),
        args=(x, lora_a, t, batch.segment_table, x.shape[1], ranks, *x.stride(), *lora_a.stride(), *t.stride()),
        constexprs=dict(BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=_BLOCK_K),
    )
    return launch, t


def lora_expand_launch(y: torch.Tensor, t: torch.Tensor, lora_b: torch.Tensor, batch: LoRABatch) -> KernelLaunch:
    """y [T, width] += each segment's t [T, rank] · B[slot] [rank, width]: views of one slice."""
    rank, width = t.shape[1], y.shape[1]
    block_m = _block_m(batch)
    return KernelLaunch(
        _lora_expand_kernel,
        grid=(len(batch.segments), triton.cdiv(batch.max_segment_rows, block_m), triton.cdiv(width, _BLOCK_N)),
        args=(t, lora_b, y, batch.segment_table, rank, width, *t.stride(), *lora_b.stride(), *y.stride()),
        constexprs=dict(BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_R=max(_MIN_DOT, triton.next_power_of_2(rank))),
    )


def lora_launches(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, batch: LoRABatch,
                  max_rank: int, out_slices: list[tuple[int, int]]) -> list[KernelLaunch]:
    """One shrink, then one expand per output slice (first column, width), in launch order."""
    shrink, t = lora_shrink_launch(x, lora_a, batch)
    expands = [lora_expand_launch(y[:, first:first + width], t[:, i * max_rank:(i + 1) * max_rank],
                                  lora_b[:, i * max_rank:(i + 1) * max_rank, first:first + width], batch)
               for i, (first, width) in enumerate(out_slices)]
    return [shrink, *expands]


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, batch: LoRABatch,
             max_rank: int, out_slices: list[tuple[int, int]]) -> None:
    """y [T, out] += each row's s·(x A^T) B in place, as `LoRABatch.add_lora` computes it."""
    batch.check_rows(x)
    for launch in lora_launches(y, x, lora_a, lora_b, batch, max_rank, out_slices):
        launch()
