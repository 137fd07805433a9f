"""RoPE (rotate-half layout) on q and k in one launch, the cos/sin looked up by position.

A token's heads are addressed as one flat axis of heads * head_dim / 2 pairs, so a program
rotates a tile of BLOCK_T whole tokens, q then k, whatever the head counts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernel_launch import KernelLaunch

_TILE_ELEMENTS = 4096  # tokens x padded (q heads x pairs) per program
_ELEMENTS_PER_WARP = 1024  # beyond this, more warps: one token of a 128-head model has 8192 pairs


@triton.jit
def _rotate(
    x_ptr, out_ptr, cos_ptr, sin_ptr, rows, positions, row_mask,
    stride_xt, stride_xh, stride_xd, stride_ot, stride_oh, stride_c,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HD: tl.constexpr,
):
    pair = tl.arange(0, BLOCK_HD)
    head = pair // HALF
    i = pair % HALF
    mask = row_mask[:, None] & (pair < NUM_HEADS * HALF)[None, :]
    table = positions[:, None] * stride_c + i[None, :]
    cos = tl.load(cos_ptr + table, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + table, mask=mask, other=0.0)
    src = x_ptr + rows[:, None] * stride_xt + head[None, :] * stride_xh + i[None, :] * stride_xd
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF * stride_xd, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + rows[:, None] * stride_ot + head[None, :] * stride_oh + i[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr,
    num_tokens,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_c,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    row_mask = rows < num_tokens
    positions = tl.load(pos_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    _rotate(q_ptr, q_out_ptr, cos_ptr, sin_ptr, rows, positions, row_mask,
            stride_qt, stride_qh, stride_qd, stride_qot, stride_qoh, stride_c, NUM_Q_HEADS, HALF, BLOCK_Q)
    _rotate(k_ptr, k_out_ptr, cos_ptr, sin_ptr, rows, positions, row_mask,
            stride_kt, stride_kh, stride_kd, stride_kot, stride_koh, stride_c, NUM_KV_HEADS, HALF, BLOCK_K)


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, head_dim] and k [T, kv_heads, head_dim] (any strides) rotated by the angles
    of positions [T], in float32; cos and sin: contiguous [max_positions, head_dim / 2] float32
    tables."""
    launch, result = rotary_launch(q, k, positions, cos, sin)
    if launch is not None:
        launch()
    return result


def rotary_launch(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
) -> tuple[KernelLaunch | None, tuple[torch.Tensor, torch.Tensor]]:
    """The launch rotary makes (None: no tokens) and the outputs it will fill."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out, k_out = q.new_empty(q.shape), k.new_empty(k.shape)  # contiguous, whatever q and k's strides
    if not num_tokens:
        return None, (q_out, k_out)
    half = head_dim // 2
    block_q, block_k = triton.next_power_of_2(num_heads * half), triton.next_power_of_2(num_kv_heads * half)
    block_t = max(1, min(_TILE_ELEMENTS // block_q, triton.next_power_of_2(num_tokens)))
    launch = KernelLaunch(
        _rotary_kernel,
        grid=(triton.cdiv(num_tokens, block_t),),
        args=(q, k, q_out, k_out, positions, cos, sin,
              num_tokens,
              *q.stride(), *k.stride(), *q_out.stride()[:2], *k_out.stride()[:2], cos.stride(0)),
        constexprs=dict(NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
                        BLOCK_T=block_t, BLOCK_Q=block_q, BLOCK_K=block_k),
        # A token is never split across programs, so a wide one gets more warps, not more
        # registers (4 warps spill at 128 heads x 64 pairs: `kvflow bench gpu-compile`).
        num_warps=min(16, max(4, block_t * block_q // _ELEMENTS_PER_WARP)),
        # Round each product before the sum, as torch does: contracted into an FMA, a*b - c*d
        # would differ from the torch path in the last bit.
        options=dict(enable_fp_fusion=False),
    )
    return launch, (q_out, k_out)
