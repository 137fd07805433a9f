"""The KV tensors, sized from a memory budget, laid out by the model's KV groups.

A block of the pool holds one group's KV for `block_size` positions; a group has G layers (the
layout's group size), so the pool is G tensors, and slot j of every group lives in tensor j:
layer `layers[j]` of whichever group owns block b reads block b of tensor j. Layers that share
another layer's KV get that layer's tensor. Shapes:

- K/V attention: `[2, num_blocks, num_kv_heads, block_size, head_dim]`, heads before positions so
  that a request's keys gather into the contiguous [heads, len, dim] operand a batched matmul
  reads fastest;
- MLA: `[1, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`, the latent and the RoPE key
  of each position side by side;
- quantized K/V (kv_cache_dtype fp8 or int8): `[2, num_blocks, num_kv_heads, block_size *
  (head_dim + 2)]`, each (block, head) row its codes then their bfloat16 scales
  (kvflow.attention.kv_quant).

Either way dimension 1 is the block, which is all block copies and swaps need to know.
"""

from __future__ import annotations

import torch

from kvflow.attention import kv_quant
from kvflow.config import CacheConfig
from kvflow.kv_cache_spec import KVCacheSpec, KVLayout, MLAAttentionSpec, SharedKVSpec


def kv_cache_shape(spec: KVCacheSpec, num_blocks: int, block_size: int, quantized: bool = False) -> tuple[int, ...]:
    if isinstance(spec, SharedKVSpec):
        raise ValueError("a layer that shares KV has no cache of its own")
    if isinstance(spec, MLAAttentionSpec):
        if quantized:
            raise ValueError("kv_cache_dtype fp8/int8 is not implemented for multi-head latent attention (MLA) "
                             "caches yet; use kv_cache_dtype=auto")
        return (1, num_blocks, block_size, spec.elements_per_token)
    if quantized:
        return kv_quant.packed_shape(spec.num_kv_heads, spec.head_dim, num_blocks, block_size)
    return (2, num_blocks, spec.num_kv_heads, block_size, spec.head_dim)


def num_kv_blocks(cache: CacheConfig, block_bytes: int, max_useful_blocks: int) -> int:
    """Blocks of `block_bytes` that fit in the memory budget, but never more than
    `max_useful_blocks` (what max_num_seqs requests of max_model_len tokens could ever hold)."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    blocks = int(cache.kv_cache_memory_gb * 1024**3) // block_bytes
    if blocks < 1:
        raise ValueError(f"kv_cache_memory_gb={cache.kv_cache_memory_gb} holds no KV block of {block_bytes} bytes")
    return min(blocks, max_useful_blocks)


def allocate_kv_caches(layout: KVLayout, num_blocks: int, block_size: int, dtype, device,
                       kv_cache_dtype: str = "auto") -> list[torch.Tensor]:
    """One cache per layer (views of the G pool tensors; sharing layers get their target's).
    `dtype`: the model's, which "auto" keeps; fp8/int8 store codes of that dtype plus scales."""
    codes = kv_quant.storage_dtype(kv_cache_dtype)
    quantized = codes is not None
    first = layout.groups[0].spec
    pool = [torch.zeros(kv_cache_shape(first, num_blocks, block_size, quantized), dtype=codes or dtype, device=device)
            for _ in range(layout.group_size)]
    return [pool[slot].view(kv_cache_shape(layout.groups[group].spec, num_blocks, block_size, quantized))
            for group, slot in layout.places]


def unique_caches(kv_caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """The distinct pool tensors behind per-layer caches (a block copy touches each once)."""
    seen: dict[int, torch.Tensor] = {}
    for cache in kv_caches:
        seen.setdefault(cache.untyped_storage().data_ptr(), cache)
    return list(seen.values())
