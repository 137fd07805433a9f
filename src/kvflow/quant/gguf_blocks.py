"""llama.cpp's quantized blocks, decoded in torch into one affine form: w = scale · u + min.

`u` is an unsigned integer per weight (`bits` wide), `scale` and `min` are per group of `group`
consecutive weights of a row. Every GGUF block type this file knows fits that form exactly
(Q8_0: u = q + 128, min = −128·d; Q6_K: groups of 16, min = −32·d·sc), so one decoder feeds both
the int4 kernels (`int4pack.planes_from_affine`) and the float reference. Rows are output
channels: a tensor arrives as `GGUFBlocks` [N rows, bytes per row] and may be row-sliced
(fused shards, tensor-parallel ranks, llama.cpp's Q/K row order) before decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GGUFBlocks:
    """A quantized GGUF tensor kept as its raw blocks: `data` [N, bytes per row] (uint8)."""

    qtype: str  # "Q4_1", ...
    data: torch.Tensor
    shape: tuple[int, int]  # (N, K) as HF names it: rows = output channels

    def narrow_rows(self, start: int, length: int) -> GGUFBlocks:
        return GGUFBlocks(self.qtype, self.data.narrow(0, start, length), (length, self.shape[1]))


@dataclass
class Affine:
    u: torch.Tensor  # [N, K] uint8 (int16 would not be needed: at most 8 bits)
    scale: torch.Tensor  # [N, K // group] float32
    min: torch.Tensor  # [N, K // group] float32
    group: int
    bits: int

    def dequantize(self) -> torch.Tensor:
        n, k = self.u.shape
        w = self.u.view(n, k // self.group, self.group).float() * self.scale[..., None] + self.min[..., None]
        return w.view(n, k)


# qtype → (weights per block, bytes per block)
BLOCK_SIZES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
               "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


def decode(blocks: GGUFBlocks) -> Affine:
    qtype = blocks.qtype
    if qtype not in BLOCK_SIZES:
        raise ValueError(f"GGUF block type {qtype} has no native decoder (supported: {', '.join(BLOCK_SIZES)})")
    n, k = blocks.shape
    per_block, nbytes = BLOCK_SIZES[qtype]
    b = blocks.data.reshape(n * (k // per_block), nbytes)
    affine = _DECODERS[qtype](b)
    rows = lambda t: t.reshape(n, -1)  # noqa: E731
    return Affine(rows(affine.u), rows(affine.scale), rows(affine.min), affine.group, affine.bits)


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    return b[:, at:at + 2].contiguous().view(torch.float16).float()  # [B, 1]


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[B, 16] bytes → [B, 32]: the 16 low nibbles, then the 16 high ones (Q4_0/Q4_1/Q5 order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """[B, 4] bytes of a little-endian uint32 → [B, 32] bits (bit j is weight j's fifth bit)."""
    bits = (qh[:, :, None] >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.reshape(qh.shape[0], 32)


def _q4_0(b):
    d = _f16(b, 0)
    return Affine(_nibbles(b[:, 2:18]), d, -8 * d, 32, 4)


def _q4_1(b):
    return Affine(_nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2), 32, 4)


def _q5_0(b):
    d = _f16(b, 0)
    return Affine(_nibbles(b[:, 6:22]) | (_high_bits(b[:, 2:6]) << 4), d, -16 * d, 32, 5)


def _q5_1(b):
    return Affine(_nibbles(b[:, 8:24]) | (_high_bits(b[:, 4:8]) << 4), _f16(b, 0), _f16(b, 2), 32, 5)


def _q8_0(b):
    d = _f16(b, 0)
    u = (b[:, 2:34].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return Affine(u, d, -128 * d, 32, 8)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of a K-quant super-block → eight 6-bit scales and eight 6-bit mins."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.float(), mn.float()


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[B, 128] → [B, 8, 32]: 64-weight chunks of 32 bytes, low nibbles first, then high."""
    q = qs.reshape(-1, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, 8, 32)


def _q4_k(b):
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales(b[:, 4:16])
    return Affine(_k_low_nibbles(b[:, 16:144]).reshape(-1, 256), d * sc, -dmin * mn, 32, 4)


def _q5_k(b):
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales(b[:, 4:16])
    qh = (b[:, 16:48].reshape(-1, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
    u = _k_low_nibbles(b[:, 48:176]) | (qh << 4)
    return Affine(u.reshape(-1, 256), d * sc, -dmin * mn, 32, 5)


def _q6_k(b):
    ql, qh, sc, d = b[:, 0:128], b[:, 128:192], b[:, 192:208].view(torch.int8).float(), _f16(b, 208)
    low = (ql.reshape(-1, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 0x03
    u = low.reshape(-1, 2, 4, 32) | (high.reshape(-1, 2, 4, 32) << 4)
    scale = d * sc
    return Affine(u.reshape(-1, 256), scale, -32 * scale, 16, 6)


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
             "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
