"""Rotary position embedding (rotate-half layout) and the RoPE scalings of the supported families.

Every scaling becomes one float32 cos/sin table, built once: the torch code, the C++ and the
Triton kernels only look positions up in it, so none of them knows the scaling. The types, with
HF's math (transformers' `modeling_rope_utils`):

- `linear`: every frequency divided by `factor`.
- `llama3`: long wavelengths divided by `factor`, short ones kept, the band between blended.
- `yarn`: the same split by rotations per `original_max_position_embeddings` (`beta_fast`,
  `beta_slow`, bounds rounded outward unless `truncate` is false), and an attention factor that
  multiplies cos and sin (so q·k grows by its square). DeepSeek's extra softmax scale from
  `mscale_all_dim` is the attention's (`yarn_mscale`, used by `models.deepseek_v2`).
- `longrope`: per-frequency divisors, `short_factor` for a context within
  `original_max_position_embeddings`, `long_factor` past it, and an attention factor.
- `dynamic`: NTK scaling, the base grown for a context of L positions.

longrope and dynamic depend on a length. HF takes the length of each forward's sequence, so a
sequence's earlier keys would be rotated differently once it grows; a paged KV cache keeps keys
rotated once. kvflow takes one length, `serve_len`, the engine's max_model_len, as vLLM does:
equal to HF for a sequence of that length, and for every sequence where the choice does not
change within max_model_len (longrope with max_model_len <= original_max_position_embeddings;
dynamic with max_model_len <= the checkpoint's max_position_embeddings, where it does not scale).
Past that, a shorter sequence is rotated as HF rotates a max_model_len one (long factors; the
grown base), not as HF rotates it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from kvflow.cpu_extension import current_kernels
from kvflow.model.layers.reference import Rope, torch_rotary
from kvflow.model.layers.triton_ops import kernels_for

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


def rope_type(scaling: Mapping | None) -> str:
    return str(scaling.get("rope_type", scaling.get("type", "default"))) if scaling else "default"


def rope_frequencies(head_dim: int, theta: float, scaling: Mapping | None,
                     serve_len: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] float32, the factor on cos and sin) of `scaling` (None:
    plain RoPE) for an engine serving `serve_len` positions."""
    kind = rope_type(scaling)
    if kind == "default":
        return _inv_freq(head_dim, theta).float(), 1.0
    if kind == "linear":
        return (_inv_freq(head_dim, theta) / scaling["factor"]).float(), 1.0
    if kind == "llama3":
        return _llama3_scale(_inv_freq(head_dim, theta), scaling).float(), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling).float(), yarn_attention_factor(scaling)
    if kind == "longrope":
        return _longrope(head_dim, theta, scaling, serve_len)
    if kind == "dynamic":
        return _inv_freq(head_dim, _dynamic_base(head_dim, theta, scaling, serve_len)).float(), 1.0
    raise ValueError(f"rope_scaling.rope_type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def _llama3_scale(inv_freq: torch.Tensor, s: Mapping) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    blend = ((old_len / wavelen) - low) / (high - low)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, blended)
    return torch.where(wavelen < old_len / high, inv_freq, scaled)


def yarn_mscale(factor: float, coefficient: float = 1.0) -> float:
    """YaRN's magnitude correction for stretching the context `factor` times (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * coefficient * math.log(factor) + 1.0


def yarn_attention_factor(s: Mapping) -> float:
    """The factor on cos and sin: the config's `attention_factor`, else mscale / mscale_all_dim
    where both are set (DeepSeek: 1 when equal, its softmax carrying the rest), else the plain mscale."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    if s.get("mscale") and s.get("mscale_all_dim"):
        return yarn_mscale(s["factor"], s["mscale"]) / yarn_mscale(s["factor"], s["mscale_all_dim"])
    return yarn_mscale(s["factor"])


def _yarn_inv_freq(head_dim: int, theta: float, s: Mapping) -> torch.Tensor:
    # Frequencies turning more than beta_fast times over the original context keep their value
    # (they never saw a longer wavelength in training); those under beta_slow are divided by
    # `factor`; a linear ramp over the dimensions between.
    low, high = _yarn_band(head_dim, theta, s)
    span = high - low if high != low else 0.001  # HF's guard against an empty band
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / span).clamp(0, 1)
    inv_freq = _inv_freq(head_dim, theta)
    return inv_freq * (1 - ramp) + inv_freq / s["factor"] * ramp


def _yarn_band(head_dim: int, theta: float, s: Mapping) -> tuple[float, float]:
    """The dimensions (pair index) where the ramp starts and ends."""
    original = s["original_max_position_embeddings"]

    def dim_turning(rotations: float) -> float:  # the pair that turns `rotations` times over `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(s.get("beta_fast") or 32), dim_turning(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def _longrope(head_dim: int, theta: float, s: Mapping, serve_len: int) -> tuple[torch.Tensor, float]:
    original = s["original_max_position_embeddings"]
    for key in ("short_factor", "long_factor"):  # both checked: a malformed list is refused whichever is used
        if len(s[key]) != head_dim // 2:
            raise ValueError(f"rope_scaling.{key} has {len(s[key])} entries; expected head_dim / 2 = {head_dim // 2}")
    divisors = torch.tensor(s["long_factor" if serve_len > original else "short_factor"], dtype=torch.float64)
    factor = s["factor"]
    attention = s.get("attention_factor")
    if attention is None:  # LongRoPE's: grows with log(factor) relative to log(original context)
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return (_inv_freq(head_dim, theta) / divisors).float(), float(attention)


def _dynamic_base(head_dim: int, theta: float, s: Mapping, serve_len: int) -> float:
    # NTK: the base grows so that the lowest frequency spans `serve_len` as it spanned the
    # original context; within the original context the base is kept.
    original, factor = s["original_max_position_embeddings"], s["factor"]
    length = max(serve_len, original)
    return theta * (factor * length / original - (factor - 1)) ** (head_dim / (head_dim - 2))


class RotaryEmbedding(nn.Module):
    """cos/sin tables for `max_positions` positions; longrope and dynamic scale for `serve_len`
    (the engine's max_model_len; None: `max_positions`)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: Mapping | None,
                 serve_len: int | None = None) -> None:
        super().__init__()
        inv_freq, attention = rope_frequencies(head_dim, theta, scaling, serve_len or max_positions)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # The attention factor scales cos and sin as HF does: rotated q and k each grow by it.
        self.register_buffer("cos", freqs.cos() * attention, persistent=False)  # [max_positions, head_dim / 2]
        self.register_buffer("sin", freqs.sin() * attention, persistent=False)
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
