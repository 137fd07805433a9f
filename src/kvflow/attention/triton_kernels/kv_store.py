"""Write the new tokens' K and V into their cache slots.

One program stores a tile of BLOCK_T tokens, all their KV heads at once: a token's heads are
addressed as one flat axis of num_kv_heads * head_dim elements, so the program count is
T / BLOCK_T whatever the head count (few programs matter for the CPU interpreter, and on a GPU a
decode step has few tokens anyway). A negative slot means "padding, write nothing", which lets a
caller pad a batch to a captured size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernel_launch import KernelLaunch

# Elements per program (tokens x heads x dim): large enough to amortise the launch, small enough
# to stay in registers.
_TILE_ELEMENTS = 4096


@triton.jit
def _kv_store_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr,
    num_tokens,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ckv, stride_cb, stride_ch, stride_co, stride_cd,
    HEAD_DIM: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    hd = tl.arange(0, BLOCK_HD)
    head = hd // HEAD_DIM
    dim = hd % HEAD_DIM
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1)
    mask = (slots >= 0)[:, None] & (hd < NUM_KV_HEADS * HEAD_DIM)[None, :]
    block = slots // BLOCK_SIZE
    offset = slots % BLOCK_SIZE
    dst = cache_ptr + block[:, None] * stride_cb + head[None, :] * stride_ch \
        + offset[:, None] * stride_co + dim[None, :] * stride_cd
    row = tokens.to(tl.int64)[:, None]
    k = tl.load(k_ptr + row * stride_kt + head[None, :] * stride_kh + dim[None, :] * stride_kd, mask=mask)
    v = tl.load(v_ptr + row * stride_vt + head[None, :] * stride_vh + dim[None, :] * stride_vd, mask=mask)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: [T, num_kv_heads, head_dim] (any strides); kv_cache: [2, num_blocks, num_kv_heads,
    block_size, head_dim]; slot_mapping: [T] (block * block_size + offset, negative = skip)."""
    launch = kv_store_launch(k, v, kv_cache, slot_mapping)
    if launch is not None:
        launch()


def kv_store_launch(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> KernelLaunch | None:
    """The launch store_kv makes (None: no tokens)."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return None
    block_hd = triton.next_power_of_2(kv_heads * head_dim)
    block_t = max(1, min(_TILE_ELEMENTS // block_hd, triton.next_power_of_2(num_tokens)))
    return KernelLaunch(
        _kv_store_kernel,
        grid=(triton.cdiv(num_tokens, block_t),),
        args=(k, v, kv_cache, slot_mapping, num_tokens, *k.stride(), *v.stride(), *kv_cache.stride()),
        constexprs=dict(HEAD_DIM=head_dim, NUM_KV_HEADS=kv_heads, BLOCK_SIZE=kv_cache.shape[3],
                        BLOCK_T=block_t, BLOCK_HD=block_hd),
    )
