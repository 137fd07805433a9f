"""Rotary position embedding (rotate-half layout), with llama3 and linear frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from kvflow.cpu_extension import current_kernels
from kvflow.model.layers.reference import Rope, torch_rotary
from kvflow.model.layers.triton_ops import kernels_for


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        return _llama3_scale(inv_freq, scaling).float()
    raise ValueError(f"rope scaling {kind!r} is not supported (supported: default, linear, llama3)")


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    blend = ((old_len / wavelen) - low) / (high - low)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, blended)
    return torch.where(wavelen < old_len / high, inv_freq, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(head_dim, theta, scaling))
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_positions, head_dim / 2]
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.custom_ops = current_kernels().custom_ops

    def forward(self, positions: torch.Tensor) -> Rope:
        return Rope(positions, self.cos, self.sin, self.custom_ops)


def apply_rotary(q: torch.Tensor, k: torch.Tensor | None, rope: Rope) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate q [T, heads, head_dim] and k [T, kv_heads, head_dim] (rotate-half layout), in float32.
    k is None for a layer that reads another layer's keys."""
    if k is None:
        return torch_rotary(q, rope), None
    kernels = kernels_for(q) if rope.custom_ops else None
    if kernels is not None:
        return kernels.rotary(q, k, rope.positions, rope.cos_table, rope.sin_table)
    return torch_rotary(q, rope), torch_rotary(k, rope)
