"""The CPU fast path: torch's fused scaled_dot_product_attention over the paged cache.

Decodes (one query each) are gathered into one padded batch and run as a single SDPA call;
prompt chunks run one SDPA call each, and a chunk that starts a prompt attends to its own
keys directly, without reading the cache back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.attention.metadata import AttentionLayerSpec, AttentionMetadata, allowed_keys, gather_kv, write_kv


class TorchSDPABackend:
    name = "torch_sdpa"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, layer: AttentionLayerSpec) -> torch.Tensor:
        write_kv(k, v, kv_cache, meta)
        out = torch.empty_like(q)
        decodes = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
        if decodes:
            self._decode_batch(q, kv_cache, meta, layer, decodes, out)
        starts = meta.query_start_loc.tolist()
        for i, q_len in enumerate(meta.query_lens_cpu):
            if q_len > 1:
                s, e = starts[i], starts[i + 1]
                out[s:e] = self._prompt_chunk(q[s:e], k[s:e], v[s:e], kv_cache, meta, layer, i)
        return out

    def _prompt_chunk(self, q, k, v, kv_cache, meta, layer, i) -> torch.Tensor:
        q_len, seq_len = q.shape[0], meta.seq_lens_cpu[i]
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        if seq_len == q_len:  # nothing cached before this chunk: its own K/V are the whole context
            keys, values = k, v
        else:
            n_blocks = -(-seq_len // meta.block_size)
            keys, values = gather_kv(kv_cache, meta.block_tables[i, :n_blocks], seq_len)
        if seq_len == q_len and layer.sliding_window is None:
            mask = None  # plain causal: let SDPA pick its fused causal kernel
        else:
            mask = allowed_keys(query_pos, seq_len, layer.sliding_window).unsqueeze(0)
        return _sdpa(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), mask, layer).squeeze(0)

    def _decode_batch(self, q, kv_cache, meta, layer, rows: list[int], out: torch.Tensor) -> None:
        idx = torch.tensor(rows, device=q.device)
        seq_lens = meta.seq_lens[idx]
        max_len = max(meta.seq_lens_cpu[i] for i in rows)
        n_blocks = -(-max_len // meta.block_size)
        tables = meta.block_tables[idx, :n_blocks]
        keys = kv_cache[0, tables].flatten(1, 2)  # [B, n_blocks * block_size, Hkv, D]
        values = kv_cache[1, tables].flatten(1, 2)
        key_pos = torch.arange(keys.shape[1], device=q.device)
        mask = key_pos[None, :] < seq_lens[:, None]
        if layer.sliding_window is not None:
            mask &= (seq_lens[:, None] - 1) - key_pos[None, :] < layer.sliding_window
        token_rows = meta.query_start_loc[idx]
        out[token_rows] = _sdpa(q[token_rows].unsqueeze(1), keys, values, mask.unsqueeze(1), layer).squeeze(1)


def _sdpa(q, k, v, mask: torch.Tensor | None, layer: AttentionLayerSpec) -> torch.Tensor:
    """q [B, n, H, D], k/v [B, L, Hkv, D], mask [B or 1, n, L] (None: causal) → [B, n, H, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
        attn_mask=None if mask is None else mask.unsqueeze(1), is_causal=mask is None,
        scale=layer.scale, enable_gqa=layer.num_heads != layer.num_kv_heads,
    )
    return out.transpose(1, 2)
