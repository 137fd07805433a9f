"""Flash-Decoding: one query token per request, its context split into segments processed in
parallel, then merged by log-sum-exp.

A decode step has too few queries to fill a GPU with one program per (request, KV head), so the
grid is (requests, KV heads, num_splits): each program reads one segment of the context and
writes a partial result (running max, sum of exponentials, unnormalised output) per query head.
A second, tiny kernel rescales the partials to their common max and sums them.

The grid is static: num_splits is chosen from a bound on the context length, not from this
step's lengths, and each request cuts its own context into num_splits equal segments (rounded up
to BLOCK_N keys) inside the kernel. Short contexts therefore leave trailing segments empty; an
empty segment writes its max at the floor and a sum of 0, which the merge weighs at zero. A
request with seq_len 0 (padding in a captured batch) gets zeros.

The G query heads of a KV head are the rows of one dot, padded to 16, the smallest tensor-core
shape: padding costs nothing in a step bound by reading K and V.

Block tables are per request ([B, max_blocks]) or per request and KV head ([B, kv_heads,
width]): a sparse decode (attention/sparse_decode.py) reads, per KV head, only its picked blocks,
handed over as a table of just those blocks and a context that ends in the last of them
(`sparse_decode.compact_tables`); the kernel walks them as it walks any context.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.attention.triton_kernels.paged_prefill import (
    LOG2E,
    dot_precision,
    online_softmax_step,
    paged_kv_offsets,
)
from kvflow.kernel_launch import KernelLaunch

BLOCK_N = 64  # keys per inner step
# Two buffers of K/V in flight: a third (triton's default) adds registers, and in float32 on A100
# spills them (`kvflow bench gpu-compile --dtype float32`).
NUM_STAGES = 2
MIN_SEGMENT = 256  # keys a split should have at the bound: fewer and the merge outweighs the gain
MAX_SPLITS = 16


@triton.jit
def _decode_segment_kernel(
    q_ptr, cache_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    req_ids_ptr, qsl_ptr, seq_lens_ptr, block_tables_ptr,
    scale_log2, window, num_heads,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_ckv, stride_cb, stride_ch, stride_co, stride_cd,
    stride_bt, stride_bh,
    GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    req = tl.load(req_ids_ptr + b)
    row = tl.load(qsl_ptr + req)
    seq_len = tl.load(seq_lens_ptr + req)
    lo = 0
    if USE_WINDOW:  # the query sits at seq_len - 1 and sees keys k > seq_len - 1 - window
        lo = tl.maximum(seq_len - window, 0)
    segment = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * segment
    end = tl.minimum(start + segment, seq_len)

    g = tl.arange(0, ROWS)
    head = kv_head * GROUP + g
    g_ok = g < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + row * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([ROWS], -1.0e30, tl.float32)  # finite floor: see paged_prefill
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for key0 in range(start, end, BLOCK_N):
        keys = key0 + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        kv_offs = paged_kv_offsets(block_tables_ptr + req * stride_bt + kv_head * stride_bh, keys, key_ok, kv_head, d,
                                   stride_cb, stride_ch, stride_co, stride_cd, BLOCK_SIZE)
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, cache_ptr + stride_ckv + kv_offs, kv_mask, PRECISION)

    io_mask = g_ok[:, None] & d_ok[None, :]
    if SINGLE_SPLIT:  # the segment is the whole context: finish here, no merge launch
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + row * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        part = (b * num_heads + head) * num_splits + split  # partials are [B, H, num_splits(, D)]
        tl.store(part_max_ptr + part, m_i, mask=g_ok)
        tl.store(part_sum_ptr + part, l_i, mask=g_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=io_mask)


@triton.jit
def _merge_segments_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, req_ids_ptr, qsl_ptr,
    num_splits, num_heads,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    part = (b * num_heads + head) * num_splits + s
    m = tl.load(part_max_ptr + part, mask=s_ok, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=s_ok, other=0.0)  # noqa: E741 (the softmax sum's usual name)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    weight = tl.exp2(m - tl.max(m, 0))  # each segment rescaled to the common max
    total = tl.sum(weight * l, 0)
    out = tl.sum(weight[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    row = tl.load(qsl_ptr + tl.load(req_ids_ptr + b))
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d * stride_od, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def num_splits_for(max_context_len: int) -> int:
    """Splits for contexts up to this bound: a fixed count, so the decode grid stays static."""
    return max(1, min(MAX_SPLITS, triton.cdiv(max_context_len, MIN_SEGMENT)))


def decode_split_k(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, num_kv_heads, block_size, head_dim]
    out: torch.Tensor,  # [T, num_heads, head_dim]; only the decode rows are written
    request_ids: torch.Tensor,  # [Bd] requests whose single query row is qsl[request]
    query_start_loc: torch.Tensor,  # [B+1]
    seq_lens: torch.Tensor,  # [B]
    block_tables: torch.Tensor,  # [B, max_blocks], or [B, kv_heads, width] (a table per KV head)
    scale: float,
    window: int | None,
    num_splits: int,
    block_n: int = BLOCK_N,
) -> None:
    for launch in decode_split_k_launches(q, kv_cache, out, request_ids, query_start_loc, seq_lens, block_tables,
                                          scale, window, num_splits, block_n):
        launch()


def decode_split_k_launches(q, kv_cache, out, request_ids, query_start_loc, seq_lens, block_tables, scale, window,
                            num_splits: int, block_n: int = BLOCK_N) -> list[KernelLaunch]:
    """The launches decode_split_k makes, in order (with their scratch for the partial results);
    the arguments are decode_split_k's."""
    batch = request_ids.shape[0]
    if batch == 0:
        return []
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = kv_cache.shape[2]
    single = num_splits == 1
    parts = 0 if single else batch * heads * num_splits  # a single split writes `out` directly
    part_max = torch.empty(parts, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty(parts * head_dim, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    segments = KernelLaunch(
        _decode_segment_kernel,
        grid=(batch, kv_heads, num_splits),
        args=(q, kv_cache, out, part_acc, part_max, part_sum,
              request_ids, query_start_loc, seq_lens, block_tables,
              scale * LOG2E, window or 0, heads,
              *q.stride(), *out.stride(), *kv_cache.stride(), block_tables.stride(0),
              block_tables.stride(1) if block_tables.dim() == 3 else 0),
        constexprs=dict(
            GROUP=heads // kv_heads, ROWS=max(16, triton.next_power_of_2(heads // kv_heads)), HEAD_DIM=head_dim,
            BLOCK_SIZE=kv_cache.shape[3], BLOCK_N=block_n, BLOCK_D=block_d, USE_WINDOW=window is not None,
            PRECISION=dot_precision(q.dtype), SINGLE_SPLIT=single,
        ),
        num_stages=NUM_STAGES,
    )
    if single:
        return [segments]
    merge = KernelLaunch(
        _merge_segments_kernel,
        grid=(batch, heads),
        args=(out, part_acc, part_max, part_sum, request_ids, query_start_loc, num_splits, heads, *out.stride()),
        constexprs=dict(HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(num_splits), BLOCK_D=block_d),
    )
    return [segments, merge]
