"""The CPU fast path over the paged cache, in plain torch.

- A chunk that starts a prompt (nothing cached before it) attends to its own keys with SDPA's
  fused causal kernel, without reading the cache back.
- Everything else (decodes, prompt chunks after a cached prefix) gathers its keys from the
  blocks and runs grouped-query attention as two batched matmuls: on CPU this is several times
  faster than SDPA with an explicit mask in bfloat16. Decodes are batched in buckets of similar
  context length, so the padding each bucket gathers stays small.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.attention.metadata import AttentionLayerSpec, AttentionMetadata, gather_kv, write_kv

# A decode joins the current bucket while its context is at least this fraction of the bucket's
# longest: bounds padded work to 1 / BUCKET_RATIO of the real work, with few buckets.
BUCKET_RATIO = 0.6


class TorchSDPABackend:
    name = "torch_sdpa"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, layer: AttentionLayerSpec) -> torch.Tensor:
        write_kv(k, v, kv_cache, meta)
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        decodes = []
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            s, e = starts[i], starts[i + 1]
            if q_len == 1:
                decodes.append(i)
            elif q_len == seq_len and layer.sliding_window is None:
                out[s:e] = _causal_prompt(q[s:e], k[s:e], v[s:e], layer)
            else:
                out[s:e] = self._attend_cached([i], q[s:e].unsqueeze(0), kv_cache, meta, layer).squeeze(0)
        for bucket in _length_buckets(decodes, meta.seq_lens_cpu):
            rows = [starts[i] for i in bucket]
            out[rows] = self._attend_cached(bucket, q[rows].unsqueeze(1), kv_cache, meta, layer).squeeze(1)
        return out

    @staticmethod
    def _attend_cached(requests: list[int], q, kv_cache, meta: AttentionMetadata, layer) -> torch.Tensor:
        """q [B, n, H, D] for requests with equal query length n → [B, n, H, D]."""
        batch, n = q.shape[:2]
        max_len = max(meta.seq_lens_cpu[i] for i in requests)
        n_blocks = -(-max_len // meta.block_size)
        keys, values = gather_kv(kv_cache, meta.block_tables[requests, :n_blocks])  # [B, Hkv, L, D]
        seq_lens = meta.seq_lens[requests]
        query_pos = seq_lens[:, None] - n + torch.arange(n, device=q.device)  # [B, n]
        key_pos = torch.arange(keys.shape[2], device=q.device)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]
        if layer.sliding_window is not None:
            mask &= query_pos[:, :, None] - key_pos[None, None, :] < layer.sliding_window
        return grouped_attention(q, keys, values, mask, layer)


def grouped_attention(q, k, v, mask, layer: AttentionLayerSpec) -> torch.Tensor:
    """q [B, n, H, D], k/v [B, Hkv, L, D] contiguous, mask [B, n, L] → [B, n, H, D]. The G = H / Hkv
    query heads that share a KV head are stacked, so K and V are read once per KV head."""
    batch, n, heads, dim = q.shape
    kv_heads = layer.num_kv_heads
    group = heads // kv_heads
    q = q.view(batch, n, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, group * n, dim)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * layer.scale  # [B, Hkv, G*n, L]
    scores = scores.view(batch, kv_heads, group, n, -1).masked_fill(~mask[:, None, None], float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype).view(batch, kv_heads, group * n, -1)
    out = torch.matmul(probs, v)  # [B, Hkv, G*n, D]
    return out.view(batch, kv_heads, group, n, dim).permute(0, 3, 1, 2, 4).reshape(batch, n, heads, dim)


def _causal_prompt(q, k, v, layer: AttentionLayerSpec) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        is_causal=True, scale=layer.scale, enable_gqa=layer.num_heads != layer.num_kv_heads,
    )
    return out.squeeze(0).transpose(0, 1)


def _length_buckets(requests: list[int], seq_lens: list[int]) -> list[list[int]]:
    buckets: list[list[int]] = []
    longest = 0
    for i in sorted(requests, key=lambda r: seq_lens[r], reverse=True):
        if not buckets or seq_lens[i] < BUCKET_RATIO * longest:
            buckets.append([])
            longest = seq_lens[i]
        buckets[-1].append(i)
    return buckets
