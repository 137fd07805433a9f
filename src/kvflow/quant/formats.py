"""Number formats and their rounding: symmetric int8 per channel, asymmetric int4 per group, FP8
E4M3 per channel, and OCP microscaling MXFP4 (E2M1 elements sharing an E8M0 power-of-two scale
per block of 32). Each quantizer refuses NaN/inf, naming the tensor, since one NaN would poison
a whole scale."""

from __future__ import annotations

import torch

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # codes 0–7; bit 3 is the sign
_E2M1_MIDPOINTS = (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2
E2M1_EMAX = 2  # 6 = 1.5 · 2²
MX_BLOCK = 32
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def check_finite(w: torch.Tensor, name: str) -> None:
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{name}: the weight holds NaN or inf, which cannot be quantized")


def int8_per_channel(w: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] → q int8 [N, K] and scale [N] with w ≈ q · scale, |q| ≤ 127."""
    check_finite(w, name)
    scale = w.abs().amax(dim=1).float() / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def int4_per_group(w: torch.Tensor, group: int, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] → u uint8 in 0..15, scale and min [N, K / group] with w ≈ scale · u + min."""
    check_finite(w, name)
    n, k = w.shape
    if k % group:
        raise ValueError(f"{name}: group size {group} does not divide its {k} input channels")
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    u = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return u.view(n, k), scale, lo


def fp8_per_channel(w: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] → float8_e4m3fn [N, K] and scale [N] with w ≈ q · scale (the row max maps to 448)."""
    check_finite(w, name)
    scale = fp8_channel_scale(w)
    return e4m3_encode(w.float() / scale[:, None]), scale


def fp8_channel_scale(w: torch.Tensor) -> torch.Tensor:
    """Each row's scale [N] that maps its largest magnitude to 448 (1 for a row of zeros)."""
    scale = w.abs().amax(dim=1).float() / FP8_MAX
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E4M3 value (ties to even), saturating at ±448."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to the even code, saturating at ±6) → uint8 codes."""
    mag = x.abs().clamp(max=6.0)
    code = torch.searchsorted(_E2M1_MIDPOINTS, mag.contiguous(), right=True)
    tie = (code > 0) & (mag == _E2M1_MIDPOINTS[(code - 1).clamp(min=0)]) & ((code - 1) % 2 == 0)
    code = code - tie.long()
    return (code | ((x < 0).long() << 3)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    value = E2M1_VALUES[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -value, value)


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """A biased power-of-two exponent: 2^(code − 127); 255 is NaN in the format and never made here."""
    return torch.exp2(codes.float() - 127)


def mxfp4_per_block(w: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] → E2M1 codes uint8 [N, K] and E8M0 scale codes uint8 [N, K / 32]: each block's
    scale is 2^(⌊log2 max|w|⌋ − 2), so its largest element lands in [4, 8) and rounds to ≤ 6."""
    check_finite(w, name)
    n, k = w.shape
    if k % MX_BLOCK:
        raise ValueError(f"{name}: MXFP4 blocks of {MX_BLOCK} do not divide its {k} input channels")
    g = w.float().view(n, k // MX_BLOCK, MX_BLOCK)
    amax = g.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - E2M1_EMAX, torch.zeros_like(amax))
    codes = (exponent + 127).clamp(0, 254).to(torch.uint8)
    elements = e2m1_encode(g / e8m0_decode(codes)[..., None])
    return elements.view(n, k), codes


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """[N, K] values < 16 → [N, K / 2] bytes, even columns in the low nibble (storage format)."""
    return (u[:, 0::2] | (u[:, 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(packed.shape[0], -1)
