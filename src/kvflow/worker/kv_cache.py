"""The KV tensors: one `[2, num_blocks, num_kv_heads, block_size, head_dim]` tensor per layer,
sized from a memory budget. Block b of every layer belongs to the same request. Heads come before
positions inside a block so that a request's keys gather into the contiguous [heads, len, dim]
operand a batched matmul reads fastest."""

from __future__ import annotations

import torch

from kvflow.config import CacheConfig
from kvflow.model.arch_config import ArchConfig


def kv_bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * dtype.itemsize
    return per_token * block_size


def num_kv_blocks(cache: CacheConfig, arch: ArchConfig, dtype: torch.dtype, max_useful_blocks: int) -> int:
    """Blocks that fit in the memory budget, but never more than `max_useful_blocks` (what
    max_num_seqs requests of max_model_len tokens could ever hold)."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    budget = int(cache.kv_cache_memory_gb * 1024**3)
    blocks = budget // kv_bytes_per_block(arch, cache.block_size, dtype)
    if blocks < 1:
        raise ValueError(f"kv_cache_memory_gb={cache.kv_cache_memory_gb} holds no KV block of "
                         f"{kv_bytes_per_block(arch, cache.block_size, dtype)} bytes")
    return min(blocks, max_useful_blocks)


def allocate_kv_caches(arch: ArchConfig, num_blocks: int, block_size: int, dtype, device) -> list[torch.Tensor]:
    shape = (2, num_blocks, arch.num_kv_heads, block_size, arch.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
