"""Paged attention for prompt chunks and mixed batches: any query length, causal across the cached
prefix and the chunk itself, GQA, sliding windows.

Tiling. A program owns one tile of BLOCK_Q consecutive queries of one request and one KV head.
The G query heads that share that KV head are packed into the same program as extra rows
(row = token * G_PAD + head), so each K/V tile is loaded once and feeds a [BLOCK_Q * G_PAD, BLOCK_N]
score matrix through one tensor-core dot. The program walks the request's keys in tiles of
BLOCK_N, looking each key's physical block up in the block table (so BLOCK_N is independent of
the cache block size), and keeps an online softmax in fp32: a running row max, row sum and
unnormalised output, rescaled whenever the max grows.

Which request a tile belongs to comes from a small host-built tile table [(request, first query)],
since the host already knows every query length; the engine builds it once per step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvflow.kernel_launch import KernelLaunch

LOG2E = 1.4426950408889634

@triton.jit
def paged_kv_offsets(block_table_ptr, keys, key_ok, kv_head, d, stride_cb, stride_ch, stride_co, stride_cd,
                     BLOCK_SIZE: tl.constexpr):
    """Offsets of a tile of keys [N, D] of one KV head in the paged cache: each key position is
    looked up in the request's block table, so tiles need not align with blocks."""
    block = tl.load(block_table_ptr + keys // BLOCK_SIZE, mask=key_ok, other=0)
    return (block * stride_cb + kv_head * stride_ch + (keys % BLOCK_SIZE) * stride_co)[:, None] + d[None, :] * stride_cd


@triton.jit
def online_softmax_step(s, m_i, l_i, acc, v_ptrs, v_mask, PRECISION: tl.constexpr):
    """Fold one tile of base-2 scores s [M, N] and its values into the running max, sum and
    output: earlier tiles are rescaled by exp2(old max - new max)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _paged_prefill_kernel(
    q_ptr, cache_ptr, out_ptr, tiles_ptr, qsl_ptr, seq_lens_ptr, block_tables_ptr,
    scale_log2, window,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_ckv, stride_cb, stride_ch, stride_co, stride_cd,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    req = tl.load(tiles_ptr + 2 * tl.program_id(0))
    first = tl.load(tiles_ptr + 2 * tl.program_id(0) + 1)  # the tile's first query, within its request
    kv_head = tl.program_id(1)
    row0 = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - row0
    seq_len = tl.load(seq_lens_ptr + req)
    cached = seq_len - q_len  # the chunk's queries sit at positions cached .. seq_len - 1

    rows = tl.arange(0, BLOCK_M)
    tok = first + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (tok < q_len) & (rows % GROUP_PAD < GROUP)
    pos = cached + tok
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + (row0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=io_mask, other=0.0)

    # Keys past the tile's last query are invisible to all its rows; with a window, so are keys
    # before the first query's window.
    hi = tl.minimum(seq_len, cached + first + BLOCK_Q)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(cached + first - window + 1, 0) // BLOCK_N * BLOCK_N
    # A finite floor for the running max: a row that has seen no visible key yet then gets
    # exp2(-inf - floor) = 0 instead of exp2(-inf + inf) = nan.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < hi
        kv_offs = paged_kv_offsets(block_tables_ptr + req * stride_bt, keys, key_ok, kv_head, d,
                                   stride_cb, stride_ch, stride_co, stride_cd, BLOCK_SIZE)
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        visible = key_ok[None, :] & (keys[None, :] <= pos[:, None])
        if USE_WINDOW:
            visible = visible & (pos[:, None] - keys[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, cache_ptr + stride_ckv + kv_offs, kv_mask, PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (row0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # query rows per program: tokens x packed query heads
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int


def prefill_config(head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """Tiles and warps that compile without spilling registers on A100 and H100 (`kvflow bench
    gpu-compile` checks each model it is given):
    - 16-bit, head dim up to 64: 64 x 64 tiles over 4 warps (16 query rows of the MMA each);
    - 16-bit, head dim 128: the [64, 128] fp32 accumulator beside the Q, K and V tiles leaves no
      room for a 64-key score tile (the A100 build spills at 255 registers): 32 keys per step;
    - float32, the accuracy mode: IEEE dots run without tensor cores and 64 x 64 tiles spill
      kilobytes per thread, so 32 query rows over 8 warps.
    """
    if dtype == torch.float32:
        return PrefillConfig(32, 64, num_warps=8, num_stages=2)
    if head_dim <= 64:
        return PrefillConfig(64, 64, num_warps=4, num_stages=3)
    return PrefillConfig(64, 32, num_warps=4, num_stages=2)


def group_pad(num_heads: int, num_kv_heads: int) -> int:
    return triton.next_power_of_2(num_heads // num_kv_heads)


def query_tile_size(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Queries per program once the GQA group is packed into the rows (at least one)."""
    return max(1, prefill_config(head_dim, dtype).block_m // group_pad(num_heads, num_kv_heads))


def make_tiles(query_lens: list[int], requests: Iterable[int], block_q: int, device) -> torch.Tensor:
    """The tile table: one (request, first query) row per program, int32 [num_tiles, 2]."""
    rows = [(i, first) for i in requests for first in range(0, query_lens[i], block_q)]
    return torch.tensor(rows, dtype=torch.int32).view(-1, 2).to(device)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 runs are the accuracy reference, so no silent tf32 rounding of Q.K and P.V.
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_prefill(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, num_kv_heads, block_size, head_dim]
    out: torch.Tensor,  # [T, num_heads, head_dim]; only the rows of the tiled requests are written
    tiles: torch.Tensor,  # make_tiles(..., query_tile_size(...)) for these heads, head dim and dtype
    query_start_loc: torch.Tensor,  # [B+1]
    seq_lens: torch.Tensor,  # [B]
    block_tables: torch.Tensor,  # [B, max_blocks]
    scale: float,
    window: int | None,
) -> None:
    launch = paged_prefill_launch(q, kv_cache, out, tiles, query_start_loc, seq_lens, block_tables, scale, window)
    if launch is not None:
        launch()


def paged_prefill_launch(q, kv_cache, out, tiles, query_start_loc, seq_lens, block_tables, scale,
                         window) -> KernelLaunch | None:
    """The launch paged_prefill makes (None: no tiles); the arguments are paged_prefill's."""
    if tiles.shape[0] == 0:
        return None
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = kv_cache.shape[2]
    config = prefill_config(head_dim, q.dtype)
    return KernelLaunch(
        _paged_prefill_kernel,
        grid=(tiles.shape[0], kv_heads),
        args=(q, kv_cache, out, tiles, query_start_loc, seq_lens, block_tables,
              scale * LOG2E, window or 0,
              *q.stride(), *out.stride(), *kv_cache.stride(), block_tables.stride(0)),
        constexprs=dict(
            GROUP=heads // kv_heads, GROUP_PAD=group_pad(heads, kv_heads), HEAD_DIM=head_dim,
            BLOCK_SIZE=kv_cache.shape[3], BLOCK_Q=query_tile_size(heads, kv_heads, head_dim, q.dtype),
            BLOCK_N=config.block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            USE_WINDOW=window is not None, PRECISION=dot_precision(q.dtype),
        ),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
