"""Weights as 4-bit planes, multiplied by aten's int4 kernel (`_weight_int4pack_mm_for_cpu`).

The kernel computes x · ((q − 8) · scale + zero)ᵀ for 4-bit q with one (scale, zero) per group of
`group` input channels and output channel. Wider integers are split into base-16 digits, one
plane each, whose products add up: u = u₀ + 16·u₁ runs as two kernel calls with scales s and 16·s.
So Q4_0/Q4_1/Q4_K and int4 are one plane; Q5/Q8_0 and MXFP4 are two.

Which path is faster depends on the number of rows M (measured with
`benchmarks/quant_kernels.py`, bf16, SmolLM2 shapes, one thread, medians of interleaved runs,
2026-11-23 on a loaded 2-core EPYC): the kernel dequantizes the weights again for every 4 rows,
so it wins at decode (M=1: 0.07 ms for gate_up 3072×576 against 0.27 ms for the bf16 matmul)
and loses at prefill (M=512: 28 ms against 20 ms for dequantize + bf16 matmul). Above
`KERNEL_MAX_ROWS` the weights are dequantized for the call and multiplied densely.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

KERNEL_MAX_ROWS = 64
GROUP_SIZES = (32, 64, 128, 256)
_ROW_BLOCK = 64  # the kernel packs rows in blocks of 64 (AVX-512); rows are padded to a multiple


def planes_from_affine(u: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                       bits: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """w = scale·u + min (per group, u of `bits` ≤ 8 bits) as planes (q, plane scale, plane zero)
    with w = Σ (q − 8)·scale_p + zero_p.

    u is centred first, v = u − 2^(bits−1), and v is split into base-16 digits: unsigned low
    digits (q = digit, zero = 8·scale_p) and a signed top digit (q = digit + 8, zero = 0). The
    remaining constant, min + 2^(bits−1)·scale, goes to the top plane's zero; it vanishes for
    symmetric formats (Q4_0, Q8_0) and is Q4_1's m + 8d. Centring keeps the planes from carrying
    large opposite constants that bf16 scales would round apart."""
    n_planes = -(-bits // 4)
    if n_planes == 1:  # v + 8 = u: no arithmetic on the weights
        return [(u, scale, minimum + 2 ** (bits - 1) * scale)]
    v = u.to(torch.int16) - 2 ** (bits - 1)
    planes = []
    for p in range(n_planes):
        s = scale * 16**p
        if p < n_planes - 1:
            planes.append(((v >> (4 * p)) & 0x0F, s, 8 * s))
        else:
            planes.append(((v >> (4 * p)) + 8, s, minimum + 2 ** (bits - 1) * scale))
    return planes


class Int4Planes(nn.Module):
    """W [N, K] held as P packed 4-bit planes with per-group scales and zeros."""

    def __init__(self, planes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], group: int,
                 dtype: torch.dtype, name: str) -> None:
        super().__init__()
        n, k = planes[0][0].shape
        if group not in GROUP_SIZES:
            raise ValueError(f"{name}: group size {group} is not one the int4 kernel runs ({GROUP_SIZES})")
        if k % group:
            raise ValueError(f"{name}: group size {group} does not divide its {k} input channels")
        self.out_features, self.in_features, self.group = n, k, group
        pad = -n % _ROW_BLOCK
        packed, scale_zero = [], []
        for q, scale, zero in planes:
            q = F.pad(q.to(torch.int32), (0, 0, 0, pad)) if pad else q.to(torch.int32)
            packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            sz = torch.stack([F.pad(scale.float(), (0, 0, 0, pad)), F.pad(zero.float(), (0, 0, 0, pad))], -1)
            scale_zero.append(sz.transpose(0, 1).contiguous().to(dtype))  # [K / group, N, 2]
        self.register_buffer("packed", torch.stack(packed))
        self.register_buffer("scale_zero", torch.stack(scale_zero))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] > KERNEL_MAX_ROWS and _layout_known():
            y = F.linear(x2, self.dequantize(x2.dtype))
        else:
            y = sum(torch.ops.aten._weight_int4pack_mm_for_cpu(x2, p, self.group, sz)
                    for p, sz in zip(self.packed, self.scale_zero))
            y = y[:, :self.out_features]
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W [N, K] in `dtype` (the scales' dtype by default)."""
        n, k, g = self.out_features, self.in_features, self.group
        if not _layout_known():  # another CPU's packing: let the kernel unpack (slow, exact)
            eye = torch.eye(k, dtype=self.scale_zero.dtype)
            w = sum(torch.ops.aten._weight_int4pack_mm_for_cpu(eye, p, g, sz)
                    for p, sz in zip(self.packed, self.scale_zero))
            return w[:, :n].t().to(dtype or w.dtype)
        w = None
        for p, sz in zip(self.packed, self.scale_zero):
            q = _unpack(p, k)[:n].to(sz.dtype).view(n, k // g, g)
            scale, zero = sz[:, :n, 0].t()[..., None], sz[:, :n, 1].t()[..., None]
            plane = torch.addcmul(zero - 8 * scale, q, scale)
            w = plane if w is None else w + plane
        return w.reshape(n, k).to(dtype or w.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W [len(ids), K] (an embedding lookup)."""
        if not _layout_known():
            return self.dequantize()[ids]
        k, g = self.in_features, self.group
        block, r = ids // _ROW_BLOCK, ids % _ROW_BLOCK
        out = None
        for p, sz in zip(self.packed, self.scale_zero):
            byte = p.view(-1, k, _ROW_BLOCK // 2)[block, :, r % (_ROW_BLOCK // 2)]  # [T, K]
            q = torch.where((r >= _ROW_BLOCK // 2)[:, None], byte >> 4, byte & 0x0F).to(sz.dtype)
            scale, zero = sz[:, ids, 0].t()[..., None], sz[:, ids, 1].t()[..., None]
            plane = torch.addcmul(zero - 8 * scale, q.view(len(ids), k // g, g), scale).reshape(len(ids), k)
            out = plane if out is None else out + plane
        return out

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scale_zero.numel() * self.scale_zero.element_size()


def _unpack(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The kernel's AVX-512 layout back to q [N, K]: per block of 64 rows and each input channel,
    32 bytes whose low nibbles are rows 0–31 and high nibbles rows 32–63."""
    b = packed.view(-1, k, _ROW_BLOCK // 2).transpose(1, 2)  # [blocks, 32, K]
    return torch.cat([b & 0x0F, b >> 4], dim=1).reshape(-1, k)


@functools.cache
def _layout_known() -> bool:
    """Whether this CPU's kernel packs as `_unpack` reads (AVX-512 builds do; AVX2 packs 32 rows)."""
    q = torch.arange(_ROW_BLOCK * 2, dtype=torch.int32).view(_ROW_BLOCK, 2) % 16
    return torch.equal(_unpack(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), 2).int(), q)
