"""The model-side front of attention: holds the layer's shape and hands the work to a backend."""

from __future__ import annotations

import torch
from torch import nn

from kvflow.attention.backend import AttentionBackend
from kvflow.attention.metadata import AttentionLayerSpec, AttentionMetadata


class Attention(nn.Module):
    def __init__(self, spec: AttentionLayerSpec, backend: AttentionBackend) -> None:
        super().__init__()
        self.spec = spec
        self.backend = backend

    def forward(self, q, k, v, kv_cache: torch.Tensor, metas: tuple[AttentionMetadata, ...]) -> torch.Tensor:
        """`metas`: the step's metadata, one per KV group; the layer reads its own group's. A
        layer that shares another's KV passes k = v = None."""
        s = self.spec
        if k is not None:
            k, v = k.view(-1, s.num_kv_heads, s.head_dim), v.view(-1, s.num_kv_heads, s.head_dim)
        out = self.backend.forward(q.view(-1, s.num_heads, s.head_dim), k, v, kv_cache, metas[s.kv_group], s)
        return out.flatten(1)
