"""What attention needs to know about the flat batch: where each request's queries start, how
long its context is, where its KV blocks are, and which cache slot each new token writes."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B+1] int64: request i's queries are rows qsl[i]:qsl[i+1]
    seq_lens: torch.Tensor  # [B] int64: context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_size: int
    # Host copies, so backends can branch and slice without a device sync per request.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass(frozen=True)
class AttentionLayerSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None  # a query at p sees keys k with p - k < window


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store the new tokens' K and V. kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]."""
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    flat[0].index_copy_(0, meta.slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, meta.slot_mapping, v.to(kv_cache.dtype))


def gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's first `length` cached keys and values: [length, num_kv_heads, head_dim] each."""
    k = kv_cache[0, block_ids].flatten(0, 1)[:length]
    v = kv_cache[1, block_ids].flatten(0, 1)[:length]
    return k, v


def allowed_keys(query_pos: torch.Tensor, key_len: int, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) mask: [num_queries, key_len] bool, True where attention may look."""
    key_pos = torch.arange(key_len, device=query_pos.device)
    mask = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        mask &= query_pos[:, None] - key_pos[None, :] < window
    return mask
