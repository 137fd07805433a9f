"""Weights as 4-bit planes, multiplied by aten's int4 kernel (`_weight_int4pack_mm_for_cpu`).

The kernel computes x · ((q − 8) · scale + zero)ᵀ for 4-bit q with one (scale, zero) per group of
`group` input channels and output channel. Wider integers are split into base-16 digits, one
plane each, whose products add up: u = u₀ + 16·u₁ runs as two kernel calls with scales s and 16·s.
So Q4_0/Q4_1/Q4_K and int4 are one plane; Q5/Q8_0 and MXFP4 are two.

Which path is faster depends on the number of rows M: the kernel dequantizes the weights again
for every few rows, so its time grows with M from the first rows on, while a bf16 GEMM on weights
packed once for oneDNN (`packed_linear`) reads twice (one plane) or equally many (two) bytes and
stays memory-bound up to dozens of rows. Measured (bf16, one thread, 30 layers so the weights come
from memory, medians, 2026-11-23, loaded 2-core EPYC; ms per layer, kernel / packed bf16):
SmolLM2 gate_up 3072×576, one plane: M=1 0.09 / 0.40, M=8 0.48 / 0.30, M=128 5.6 / 2.2; Gemma-3
gate_up 4096×640, two planes: M=1 0.37 / 0.45, M=8 1.2 / 0.53, M=128 16.5 / 3.2. So each layer
also holds its weights dequantized once, in the packed bf16 form, for calls of more than
`KERNEL_MAX_ROWS` rows (decode batches, prefill): 2 bytes per weight of memory for W1's speed.
Without it (`dense_copy=False`: `--cpu-weight-layouts compact`), above `KERNEL_MAX_ROWS_NO_COPY`
rows each call dequantizes (at M=128 that costs far more than the product).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.disk_cache import drop_mapped_pages
from kvflow.quant import int4_gemv
from kvflow.quant.base import WeightsModule
from kvflow.quant.kernel_plan import KernelPlan
from kvflow.quant.layouts import DENSE, GEMV, PLANES, Layouts, merged
from kvflow.quant.packed_linear import PackedWeight, gated_pair, linear, prepack, product_plan

KERNEL_MAX_ROWS = 4  # above: the dense copy
# The kernel is vectorised for bf16 only: in float32 or float16 it took 2.6 ms at M = 1 and 10 ms
# at M = 4 for SmolLM2's gate_up (bf16: 0.06 / 0.10 ms; one thread), so those dtypes always take
# the dense copy when there is one.
KERNEL_MAX_ROWS_NO_COPY = 64  # without a dense copy, above: dequantize for the call
GROUP_SIZES = (32, 64, 128, 256)
_ROW_BLOCK = 64  # the kernel packs rows in blocks of 64 (AVX-512); rows are padded to a multiple
_DEQUANTIZE_ROWS = 64 * _ROW_BLOCK


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


def planes_sum(planes, group: int) -> torch.Tensor:
    """Σ_p (q_p − 8)·scale_p + zero_p in float32 [R, K] from (q [R, K], scale, zero [R, K/group]) per
    plane, as the kernel holds them: `Int4Planes` unpacks with it, and AWQ's search scores with it
    what the layer will multiply by. In place in float32: a broadcast addcmul in bf16 is ~20× slower."""
    acc = None
    for q, scale, zero in planes:
        r, k = q.shape
        scale, zero = scale.float()[..., None], zero.float()[..., None]
        plane = q.float().view(r, k // group, group).mul_(scale).add_(zero - 8 * scale)
        acc = plane if acc is None else acc.add_(plane)
    return acc.flatten(1)


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 [R, C] holding 32/bits values each along `dim` (the first in the lowest bits) → the values."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if dim == 0:
        values = (packed[:, None, :] >> shifts[None, :, None]) & (2**bits - 1)  # [R, 32/bits, C]
        return values.reshape(-1, packed.shape[1])
    values = (packed[..., None] >> shifts) & (2**bits - 1)  # [R, C, 32/bits]
    return values.reshape(packed.shape[0], -1)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """`unpack(·, bits, dim=1)`'s inverse: non-negative values [R, C] → int32 [R, C·bits/32]."""
    v = values.to(torch.int64).reshape(values.shape[0], -1, 32 // bits)
    packed = sum(v[..., i] << (bits * i) for i in range(32 // bits))
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def runtime_group(group: int, name: str) -> int:
    """The largest group the int4 kernel runs that divides the checkpoint's: scales repeat into it."""
    for g in sorted(GROUP_SIZES, reverse=True):
        if group % g == 0:
            return g
    raise ValueError(f"{name}: group_size={group} is not a multiple of a group int4's kernel runs {GROUP_SIZES}")


def check_group(name: str, fmt: str, group: int, input_size: int, pack_factor: int) -> None:
    """A checkpoint's group and packing fit the layer's input channels, and the kernel runs the
    group: refused when the layer is built, not after its weights are read."""
    if input_size % group or input_size % pack_factor:
        raise ValueError(f"{name}: {fmt} group_size={group} does not divide its {input_size} input channels")
    runtime_group(group, name)


def kernel_planes(u: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int, dtype: torch.dtype,
                  name: str, dense_copy: bool) -> Int4Planes:
    """w = scale·u + min, u [N, K] of `bits`, scale and min [N, K/G], on int4's kernel: G split into the
    largest group the kernel runs (scale and min repeated), `bits` > 4 into planes."""
    group = runtime_group(u.shape[1] // scale.shape[1], name)
    repeat = u.shape[1] // scale.shape[1] // group
    scale, minimum = (t.repeat_interleave(repeat, dim=1) for t in (scale, minimum))
    return Int4Planes(planes_from_affine(u, scale, minimum, bits), group, dtype, name, dense_copy)


class Int4Planes(WeightsModule):
    """W [N, K] held as P packed 4-bit planes with per-group scales and zeros; with `dense_copy`,
    also dequantized once for products of many rows (the module's comment)."""

    def __init__(self, planes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], group: int,
                 dtype: torch.dtype, name: str, dense_copy: bool = True) -> None:
        super().__init__()
        n, k = planes[0][0].shape
        if group not in GROUP_SIZES:
            raise ValueError(f"{name}: group size {group} is not one the int4 kernel runs ({GROUP_SIZES})")
        if k % group:
            raise ValueError(f"{name}: group size {group} does not divide its {k} input channels")
        pad = -n % _ROW_BLOCK
        packed, scale_zero = [], []
        for q, scale, zero in planes:
            q = F.pad(q.to(torch.int32), (0, 0, 0, pad)) if pad else q.to(torch.int32)
            packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            sz = torch.stack([F.pad(scale.float(), (0, 0, 0, pad)), F.pad(zero.float(), (0, 0, 0, pad))], -1)
            scale_zero.append(sz.transpose(0, 1).contiguous().to(dtype))  # [K / group, N, 2]
        self._hold(torch.stack(packed), torch.stack(scale_zero), group, n, dense_copy)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, scale_zero: torch.Tensor, group: int, out_features: int,
                    dense: torch.Tensor | None = None, gemv: dict | None = None,
                    dense_copy: bool = True) -> Int4Planes:
        """The module again from its own buffers and, if given, its `dequantize()` and its GEMV form's
        state (as `packed_cache` stored them: rebuilding them at every start would cost seconds)."""
        planes = cls.__new__(cls)
        nn.Module.__init__(planes)
        planes._hold(packed, scale_zero, group, out_features, dense_copy, dense, gemv)
        return planes

    def _hold(self, packed: torch.Tensor, scale_zero: torch.Tensor, group: int, out_features: int,
              dense_copy: bool, dense: torch.Tensor | None = None, gemv: dict | None = None) -> None:
        self.out_features, self.in_features, self.group = out_features, scale_zero.shape[1] * group, group
        self.register_buffer("packed", packed)  # [P, N padded, K / 2] uint8
        self.register_buffer("scale_zero", scale_zero)  # [P, K / group, N padded, 2]
        self._padded = packed.shape[1] != out_features
        self._unbind_planes()
        # An attribute, not a buffer: derived from the planes, so out of state_dict.
        self.dense = None
        self.gated = None  # the dense copy's [gate; up] halves, once silu_and_mul asks (packed_linear.GatedPair)
        self.kernel_at_any_rows = False  # batch-invariant mode: one kernel, whatever the row count
        if dense_copy:
            self.dense = prepack(dense if dense is not None else self.dequantize())
            if dense is not None and isinstance(self.dense, PackedWeight):
                # The cache's dequantized weights (a view of its memory-mapped file) were read only to
                # be packed: 300 MiB of the default model's resident set until the kernel reclaims them.
                drop_mapped_pages(dense.data_ptr(), dense.numel() * dense.element_size())
        # The same weights for kvflow's GEMV (few bfloat16 rows), where the CPU has AVX-512 BF16:
        # an attribute too (derived from the planes; packed_cache keeps it beside them).
        self.gemv = None
        if _layout_known() and int4_gemv.fast():
            k = self.in_features
            self.gemv = (int4_gemv.Int4Gemv.from_state(gemv) if gemv is not None else int4_gemv.Int4Gemv.from_planes(
                [_unpack(p, k)[:out_features] for p in self.packed], self.scale_zero, group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        m, bf16 = x2.shape[0], x2.dtype == torch.bfloat16
        if m == 0:  # a step with no rows for this layer (a drafter's head sampling nothing): no kernel takes 0
            return x.new_empty(*x.shape[:-1], self.out_features)
        if bf16 and m <= int4_gemv.MAX_ROWS and self.gemv is not None:
            return self.gemv(x2).reshape(*x.shape[:-1], self.out_features)
        if not (bf16 and (m <= self.max_kernel_rows or self.kernel_at_any_rows)):  # the dense copy's rows
            if self.dense is not None and x2.dtype == self._scale_dtype:
                return linear(x2, self.dense).reshape(*x.shape[:-1], self.out_features)
            if m > KERNEL_MAX_ROWS_NO_COPY and _layout_known():
                return F.linear(x2, self.dequantize(x2.dtype)).reshape(*x.shape[:-1], self.out_features)
        # Batch-1 decode makes ~120 of these calls a token: per-call Python and tensor views
        # (iterating the stacked planes, sum()'s extra add, the padding slice) were ~20 µs each.
        y = None
        for p, sz in self._planes:
            part = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, p, self.group, sz)
            y = part if y is None else y.add_(part)
        if self._padded:
            y = y[:, :self.out_features]
        return y.reshape(*x.shape[:-1], self.out_features)

    @property
    def max_kernel_rows(self) -> int:
        """The most bfloat16 rows `forward` multiplies with the int4 kernels (kvflow's GEMV, else
        aten's) rather than the dense copy."""
        return max(KERNEL_MAX_ROWS, int4_gemv.MAX_ROWS if self.gemv is not None else 0)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """SiLU(gate) * up of this [gate; up] weight in one pass (`packed_linear.GatedPair`, built
        from the dense copy's weights on first use) where `forward` would take the dense copy and
        the pair takes the rows; None elsewhere (few rows: the GEMV; batch-invariant: the int4
        kernel; past the panels' rows without AMX), and the caller runs `forward` and the activation."""
        pair = self._gated_pair(x.numel() // self.in_features, x.dtype)
        return None if pair is None else pair(x)

    def _gated_pair(self, rows: int, dtype: torch.dtype):
        """The gated pair where `silu_and_mul` runs one for these rows (laid out when first asked,
        from the packed dense copy, unpacked: a reorder, well under a millisecond a layer, where
        the dequantization it came from took ~40), else None."""
        if self.packed_for(rows, dtype) is None:
            return None
        return gated_pair(self, rows, (self.out_features, self.in_features), lambda: self.dense.main.to_dense())

    def kernel_plan(self, rows: int, dtype: torch.dtype) -> KernelPlan:
        """What `forward` runs for `rows` rows of `dtype` (quant/kernel_plan.py): the GEMV, the dense
        copy's panels, or itself."""
        if dtype == torch.bfloat16 and rows <= int4_gemv.MAX_ROWS and self.gemv is not None:
            return self.gemv.plan()
        return product_plan(self.packed_for(rows, dtype), rows, self.forward)

    def silu_and_mul_plan(self, rows: int, dtype: torch.dtype) -> KernelPlan | None:
        pair = self._gated_pair(rows, dtype)
        return None if pair is None else pair.plan(rows)

    def layouts(self) -> Layouts:
        dense = self.dense.layouts(DENSE) if isinstance(self.dense, PackedWeight) else {DENSE: [self.dense]}
        return merged({PLANES: [self.packed, self.scale_zero]}, dense,
                      {GEMV: [self.gemv.weight, self.gemv.scale_zero]} if self.gemv is not None else {},
                      self.gated.layouts() if self.gated is not None else {})

    def packed_for(self, rows: int, dtype: torch.dtype) -> PackedWeight | None:
        """The packed dense copy a bf16 product of `rows` rows of `dtype` multiplies (`forward` and
        `silu_and_mul` both go there), or None: the int4 kernels run, or there is no packed copy."""
        if (dtype != torch.bfloat16 or rows <= self.max_kernel_rows or self.kernel_at_any_rows
                or not isinstance(self.dense, PackedWeight) or dtype != self._scale_dtype):
            return None
        return self.dense

    def _unbind_planes(self) -> None:
        """(packed, scale_zero) per plane as plain attributes, made once, and the scales' dtype:
        reading buffers goes through nn.Module.__getattr__, and unbinding at every call cost more
        than batch-1 decode's small kernels."""
        self._planes = list(zip(self.packed.unbind(0), self.scale_zero.unbind(0)))
        self._scale_dtype = self.scale_zero.dtype

    def _apply(self, fn, recurse: bool = True):  # .to(), .float(), ...: new buffers, new views
        module = super()._apply(fn, recurse)
        self._unbind_planes()
        return module

    def use_kernel_at_any_rows(self) -> None:
        """Every bfloat16 call through aten's int4 kernel, which computes each row on its own
        whatever the row count (tests/engine/test_batch_invariant.py holds it to that), so a row's
        result never depends on the batch; the dense copy is then dropped."""
        self.kernel_at_any_rows, self.dense, self.gemv, self.gated = True, None, None, None

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W [N, K] in `dtype` (the scales' dtype by default), computed in float32 and rounded once."""
        n, k, g = self.out_features, self.in_features, self.group
        if not _layout_known():  # another CPU's packing: let the kernel unpack (slow, exact)
            eye = torch.eye(k, dtype=self.scale_zero.dtype)
            w = sum(torch.ops.aten._weight_int4pack_mm_for_cpu(eye, p, g, sz)
                    for p, sz in zip(self.packed, self.scale_zero))
            return w[:, :n].t().to(dtype or w.dtype)
        w = torch.empty(n, k, dtype=dtype or self.scale_zero.dtype)
        for start in range(0, n, _DEQUANTIZE_ROWS):  # float32 temporaries of bounded size
            stop = min(start + _DEQUANTIZE_ROWS, n)
            q = (_unpack(p[start:stop + -stop % _ROW_BLOCK], k)[:stop - start] for p in self.packed)
            w[start:stop] = self._planes_sum(q, slice(start, stop))
        return w

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W [len(ids), K] (an embedding lookup)."""
        if self.gemv is not None:
            return self.gemv.rows(ids, self.scale_zero.dtype)
        if not _layout_known():
            return self.dequantize()[ids]
        block, r = ids // _ROW_BLOCK, ids % _ROW_BLOCK
        bytes_ = (p.view(-1, self.in_features, _ROW_BLOCK // 2)[block, :, r % (_ROW_BLOCK // 2)] for p in self.packed)
        high = (r >= _ROW_BLOCK // 2)[:, None]
        q = (torch.where(high, b >> 4, b & 0x0F) for b in bytes_)  # [T, K] each
        return self._planes_sum(q, ids).to(self.scale_zero.dtype)

    def _planes_sum(self, q_per_plane, rows: slice | torch.Tensor) -> torch.Tensor:
        """`planes_sum` for rows `rows`, given their 4-bit values per plane [R, K]."""
        return planes_sum(((q, sz[:, rows, 0].t(), sz[:, rows, 1].t()) for q, sz in zip(q_per_plane, self.scale_zero)),
                          self.group)

    @property
    def nbytes(self) -> int:
        """Bytes a few-row call reads: the GEMV's layout where there is one, else the planes."""
        if self.gemv is not None:
            return self.gemv.nbytes
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
