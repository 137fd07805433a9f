"""Int4 and int8 weights times bfloat16 activations for the few-row products of decode, on CPU.

At batch 1 every weight is read once per token, so decode runs at the speed the weights stream
from memory. `csrc/int4_gemv_cpu.cpp` turns 32 codes into bfloat16s with one bitwise OR and
multiplies them by 32 activations with one AVX-512 BF16 instruction. The activations are used as
they are: products are exact in float and only the float sums and the bfloat16 output round, so
it computes the dequantized product to float accuracy (tests/quant/test_int4_gemv.py). Rounding
the activations to int8 first, as llama.cpp does, was tried and measured: +2.2% perplexity on
the default model for no speed on this CPU, whose limit is memory, not arithmetic.

`Int4Gemv.from_planes` re-lays an `Int4Planes` layer (Q4_0, Q4_1, Q4_K: one plane; Q5, Q8_0: two)
as w = s·(u − c) + z per group of 32, with the planes' own bfloat16 s and z (c = 8 for 4-bit
codes, 128 for 8-bit). For an 8-bit layer (the default model's Q8_0 head) it reads 1.125 bytes
per weight where two planes read 1.25. Used for bfloat16 calls of up to `MAX_ROWS` rows where the
CPU has AVX-512 BF16 (batch-1 decode 1.14x over aten's int4 kernel when it came:
docs/performance-journal.md, "2026-11-26, an Intel Xeon VM").

One row (batch-1 decode) takes a faster path where the CPU has AVX-512 VNNI: each group's 32
activations become two int8 levels, x ≈ a·q1 + (a/254)·q2 (a = max|x| / 127), off by at most
half of a/254, max|x| / 64,516, where bfloat16 itself keeps 1 part in 256; the codes meet them in
exact integer dot products (`vpdpbusd`, a third of `vdpbf16ps`'s cost for twice the products).
The zeros' term takes the levels' own sums, so the result is the dequantized weights' product
with the levels' x. On the default model: perplexity +0.04–0.06% against the bf16 products (the
two exact kernels, ours and aten's, differ by up to 0.09%; one int8 level, llama.cpp's way, cost
+2.2%). A call can still ask for bfloat16 products (`path`), as the tests and benchmarks do.

A row's whole blocks of 16 groups are stored lane by lane (`_blocks_lane_by_lane`): one integer
dot product then takes 4 bytes of each of 16 groups, and each of its lanes sums one group, so the
scales are applied once per 16 groups instead of once per 4 (4-bit) or 2 (8-bit). That, not
memory, was the limit: batch-1 decode 1.18× for the layers' blocks, more with the head's
(docs/performance-journal.md, "2026-11-26, night").
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kvflow import cpu_extension
from kvflow.quant.kernel_plan import GemvPlan

SOURCE = Path(__file__).parent / "csrc" / "int4_gemv_cpu.cpp"
GROUP = 32
# The most rows a call takes here (the kernel takes up to 8). Its time grows with the rows, the
# dense copy's barely: the default GGUF's 120 layers, ms at 1, 4, 6, 8 rows: 3.9, 9.9, 15.1, 19.0
# here, 16.0, 16.7, 18.5, 23.2 dense; but end to end (offline decode of N requests, alternated)
# 5 and 6 rows gained 12-26% and 8 rows lost 2.5% (docs/performance-journal.md, stop 30).
MAX_ROWS = 6
# How the kernel computes (csrc/int4_gemv_cpu.cpp): its scalar loop, bfloat16 products, or two int8
# levels of the activations for one row of 4-bit codes (bfloat16 products for other calls).
SCALAR, BF16_PRODUCTS, INT8_LEVELS = 0, 1, 2


def load() -> bool:
    """Whether the operator library is loaded (built first if need be)."""
    return cpu_extension.load_library("kvflow_int4_gemv", SOURCE, "the CPU int4 GEMV kernel")


def fast() -> bool:
    """The library is loaded and was built with AVX-512 BF16 (elsewhere it is a scalar loop)."""
    return load() and torch.ops.kvflow_int4_gemv.fast()


def default_path() -> int:
    """INT8_LEVELS where the build has AVX-512 VNNI, else BF16_PRODUCTS."""
    return INT8_LEVELS if _has_int8_levels() else BF16_PRODUCTS


@functools.cache
def _has_int8_levels() -> bool:
    return torch.ops.kvflow_int4_gemv.has_int8_levels()


class Int4Gemv:
    """W [N, K] as unsigned 4- or 8-bit codes u with w = s·(u − c) + z per group of 32 inputs
    (the layout: csrc/int4_gemv_cpu.cpp's header)."""

    def __init__(self, u: torch.Tensor, scale_zero: torch.Tensor, bits: int) -> None:
        n, k = u.shape
        if k % GROUP:
            raise ValueError(f"input width {k} is not a multiple of {GROUP}")
        if scale_zero.shape != (n, k // GROUP, 2) or scale_zero.dtype != torch.bfloat16:
            raise ValueError(f"scale_zero must be bfloat16 [{n}, {k // GROUP}, 2], got {scale_zero.dtype} "
                             f"{tuple(scale_zero.shape)}")
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, not {bits}")
        # An odd group count is padded with a group of zero codes, scales and zeros: the kernel
        # takes groups two at a time.
        pad = (k // GROUP) % 2
        u = torch.nn.functional.pad(u.to(torch.uint8), (0, pad * GROUP))
        if bits == 4:  # byte j of a group: u[j] in the low nibble, u[16 + j] in the high one
            halves = u.view(n, -1, 2, GROUP // 2)
            self.weight = _blocks_lane_by_lane((halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, -1), 4)
        else:
            self.weight = _blocks_lane_by_lane(u.reshape(n, -1), 8)
        self.scale_zero = torch.nn.functional.pad(scale_zero, (0, 0, 0, pad)).contiguous()
        self.bits, self.out_features, self.in_features = bits, n, k
        self.path = default_path()

    @classmethod
    def from_planes(cls, q_per_plane: list[torch.Tensor], scale_zero: torch.Tensor, group: int) -> Int4Gemv | None:
        """From Int4Planes' planes: q_p [N, K] in 0..15 and scale_zero [P, K / group, N, 2] with
        w = Σ_p (q_p − 8)·s_p + z_p. None where they have no exact bfloat16 form here: not one
        base-16 number (s_p ≠ 16^p·s_0), more than two planes, or a zero that rounds."""
        planes = len(q_per_plane)
        if planes > 2 or group % GROUP or scale_zero.dtype != torch.bfloat16:
            return None
        n = q_per_plane[0].shape[0]
        sz = scale_zero[:, :, :n].float().transpose(1, 2)  # [P, N, K / group, 2]
        s = sz[0, ..., 0]
        if any(not torch.equal(sz[p, ..., 0], s * 16**p) for p in range(1, planes)):
            return None
        # Σ_p (q_p − 8)·s_p + z_p = s·(u − c) + z: z = Σ z_p − 8·Σ s_p + c·s.
        bits, c = (4, 8) if planes == 1 else (8, 128)
        z = sz[..., 1].sum(0) - 8 * sz[..., 0].sum(0) + c * s
        if not torch.equal(z.bfloat16().float(), z):
            return None
        u = sum(q.to(torch.int32) * 16**p for p, q in enumerate(q_per_plane))
        per = group // GROUP  # the kernel's groups are 32 wide: a wider group's pair repeats
        pairs = torch.stack([s, z], -1).repeat_interleave(per, 1).bfloat16()
        return cls(u, pairs, bits)

    def state(self) -> dict:
        """Its buffers, for packed_cache (re-laying every layer at each start cost half a second)."""
        return {"weight": self.weight, "scale_zero": self.scale_zero, "bits": self.bits,
                "out_features": self.out_features, "in_features": self.in_features}

    @classmethod
    def from_state(cls, state: dict) -> Int4Gemv:
        gemv = cls.__new__(cls)
        gemv.weight, gemv.scale_zero, gemv.bits = state["weight"], state["scale_zero"], state["bits"]
        gemv.out_features, gemv.in_features = state["out_features"], state["in_features"]
        gemv.path = default_path()
        return gemv

    def __call__(self, x: torch.Tensor, path: int | None = None) -> torch.Tensor:
        """x [M ≤ 8, K] bfloat16 · Wᵀ → [M, N] bfloat16; `path`: SCALAR, BF16_PRODUCTS or
        INT8_LEVELS (None: the one chosen when the weights were laid out)."""
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        torch.ops.kvflow_int4_gemv.int4_gemv(out, x.contiguous(), self.weight, self.scale_zero, self.bits,
                                             self.path if path is None else path)
        return out

    def plan(self) -> GemvPlan:
        """Its products as a kernel plan (quant/kernel_plan.py): the same op on the same tensors."""
        return GemvPlan(self.weight, self.scale_zero, self.bits, self.path, self.out_features)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` [T] of W as [T, K] float32 or bfloat16 (an embedding lookup): one C++ call,
        the numbers of `dequantize()[ids]` rounded to `dtype` (as torch ops it was ~15 small
        operations, ~0.2 ms of a batch-1 token)."""
        out = torch.empty(ids.shape[0], self.in_features, dtype=dtype)
        torch.ops.kvflow_int4_gemv.rows(out, ids.contiguous(), self.weight, self.scale_zero, self.bits)
        return out

    def dequantize(self) -> torch.Tensor:
        """W [N, K] in float32 (the reference the tests hold the kernel to)."""
        n, k = self.out_features, self.in_features
        if self.bits == 4:
            b = _blocks_group_by_group(self.weight, 4).view(n, -1, GROUP // 2)
            u = torch.cat([b & 0x0F, b >> 4], dim=2).view(n, -1, GROUP)
        else:
            u = _blocks_group_by_group(self.weight, 8).view(n, -1, GROUP)
        s, z = self.scale_zero.float().unbind(-1)
        w = (u.float() - (8 if self.bits == 4 else 128)).mul_(s[..., None]).add_(z[..., None])
        return w.view(n, -1)[:, :k]

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scale_zero.numel() * 2


# A row's whole blocks of 16 groups are laid out lane by lane for the kernel (csrc's top): byte
# [group i][4t + j] of a block (t < 4 at 4 bits, 8 at 8) stored at [t][i][j].
BLOCK_GROUPS = 16


def _blocks_lane_by_lane(rows: torch.Tensor, bits: int) -> torch.Tensor:
    """Byte rows [N, Ĝ·4·bits] (a group: `bits` runs of 4 bytes), groups one after another, in the
    kernel's layout."""
    return _swap_in_blocks(rows, (BLOCK_GROUPS, bits, 4))


def _blocks_group_by_group(rows: torch.Tensor, bits: int) -> torch.Tensor:
    """The kernel's byte rows back to groups one after another."""
    return _swap_in_blocks(rows, (bits, BLOCK_GROUPS, 4))


def _swap_in_blocks(rows: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    n, width = rows.shape
    block_bytes = shape[0] * shape[1] * shape[2]
    blocked = width // block_bytes * block_bytes
    head = rows[:, :blocked].reshape(n, -1, *shape).transpose(2, 3).reshape(n, blocked)
    return torch.cat([head, rows[:, blocked:]], dim=1).contiguous()
