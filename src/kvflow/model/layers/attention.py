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

    def forward(self, q, k, v, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        s = self.spec
        out = self.backend.forward(
            q.view(-1, s.num_heads, s.head_dim), k.view(-1, s.num_kv_heads, s.head_dim),
            v.view(-1, s.num_kv_heads, s.head_dim), kv_cache, meta, s,
        )
        return out.flatten(1)
