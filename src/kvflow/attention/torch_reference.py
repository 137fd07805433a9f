"""The oracle: attention over the paged cache, one request at a time, in float32.

Slow and obvious on purpose. Every faster backend is tested against it, and it is tested
(through the whole model) against HuggingFace transformers.
"""

from __future__ import annotations

import torch

from kvflow.attention.metadata import AttentionLayerSpec, AttentionMetadata, allowed_keys, gather_kv, write_kv


class TorchReferenceBackend:
    name = "torch_reference"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, layer: AttentionLayerSpec) -> torch.Tensor:
        if layer.writes_kv:
            write_kv(k, v, kv_cache, meta)
        out = torch.empty_like(q)
        group = layer.num_heads // layer.num_kv_heads
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            n_blocks = -(-seq_len // meta.block_size)
            keys, values = gather_kv(kv_cache, meta.block_tables[i:i + 1, :n_blocks], None, meta.block_size,
                                     torch.float32)  # [1, Hkv, L', D]
            keys = keys[0, :, :seq_len].transpose(0, 1).float().repeat_interleave(group, dim=1)  # [L, H, D]
            values = values[0, :, :seq_len].transpose(0, 1).float().repeat_interleave(group, dim=1)
            queries = q[start:start + q_len].float()  # [n, H, D]
            scores = torch.einsum("nhd,lhd->hnl", queries, keys) * layer.scale
            query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            scores.masked_fill_(~allowed_keys(query_pos, seq_len, layer.sliding_window), float("-inf"))
            probs = scores.softmax(dim=-1)
            out[start:start + q_len] = torch.einsum("hnl,lhd->nhd", probs, values).to(q.dtype)
            start += q_len
        return out
