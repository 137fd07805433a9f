"""Float weights packed once for oneDNN, for the CPU's GEMMs.

F.linear on a bf16 weight reorders W into oneDNN's blocked layout on every call; at decode (M of
1 to a few dozen rows) that reorder costs as much as the product. `torch.ops.mkldnn.
_reorder_linear_weight` does it once (as Inductor's freezing pass does) and `_linear_pointwise`
multiplies by the packed weight. The product is the same oneDNN kernel's: results are bitwise
equal to F.linear's (tests/quant/test_packed_linear.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.quant import panel_linear

DISABLE_ENV = "KVFLOW_PACKED_LINEAR"  # =0: F.linear at every call (for A/B measurements)


def should_pack(weight: torch.Tensor) -> bool:
    return (os.environ.get(DISABLE_ENV, "1") != "0" and weight.device.type == "cpu"
            and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available())


# oneDNN packs a weight for a row count (`_reorder_linear_weight`'s hint), and a product whose
# kernel wants another layout converts the weight at every call. Packed for 1 row, the products of
# 384-1,280 rows ran fastest; packed for any count from 32 to 4,096, those of fewer or more rows
# did. One layer of SmolLM2, in cache, ms (median of 30) packed for 1 / 512 rows (2026-11-27):
#   qkv   128 rows 0.093 / 0.086   1,024 rows 0.499 / 0.858   2,048 rows 0.933 / 0.935
#   down  128 rows 0.155 / 0.130   1,024 rows 0.900 / 1.536   2,048 rows 1.806 / 1.557
# So a weight is packed for 512 rows, and for 1 row too once a product of middle size first asks
# (from the first packing: the float weight need not be kept; a tied LM head, which never sees
# that many rows, is never packed twice) (docs/performance.md, stop 30).
MIDDLE_ROWS = (384, 1280)


class PackedWeight:
    """A bf16 W [N, K] packed for oneDNN: for 512 rows, and for 1 row once a product of middle size
    needs it (see MIDDLE_ROWS); `for_rows(m)` is the one an [m, K] input multiplies fastest. Where
    the CPU has AVX-512 BF16 (or AMX), products of up to `panel_linear.MAX_ROWS` rows take the
    panel kernel instead, on panels laid out from the packed copy when first asked (`panels_for`)."""

    __slots__ = ("main", "middle", "panels")

    def __init__(self, weight: torch.Tensor) -> None:
        self.main = torch.ops.mkldnn._reorder_linear_weight(weight, 512)
        self.middle: torch.Tensor | None = None
        self.panels: torch.Tensor | None = None

    def panels_for(self, rows: int) -> torch.Tensor | None:
        """The panel kernel's panels for an [rows, K] input, or None: oneDNN's product."""
        if not panel_linear.takes(rows, self.main.shape):
            return None
        if self.panels is None:
            self.panels = panel_linear.pack(self.main.to_dense())
        return self.panels

    def for_rows(self, rows: int) -> torch.Tensor:
        if not MIDDLE_ROWS[0] <= rows <= MIDDLE_ROWS[1]:
            return self.main
        if self.middle is None:
            self.middle = torch.ops.mkldnn._reorder_linear_weight(self.main.to_dense(), 1)
        return self.middle


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) with W packed (`PackedWeight`)."""
    rows = x.reshape(-1, x.shape[-1])
    panels = packed.panels_for(rows.shape[0]) if rows.stride(-1) == 1 else None
    if panels is not None:
        y = panel_linear.linear(rows, panels, bias)
    else:
        y = torch.ops.mkldnn._linear_pointwise(rows, packed.for_rows(rows.shape[0]), bias, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1])


class GatedPair:
    """The gate and up halves of a [2I, K] bf16 weight packed apart, for SiLU(x W_gate^T) * (x W_up^T)
    with the SiLU in oneDNN's epilogue of the gate's product and the multiply in the up's: no
    [M, 2I] intermediate is written and read back, and no separate elementwise pass runs. On this
    CPU, SmolLM2's shape with 30 layers' weights cycling: 2,048 rows 4.6 -> 3.7 ms a layer, 512-1,024
    rows 12-17%, 128 rows ~4%, 64 rows and fewer none (docs/performance.md). The SiLU is taken on
    the float sums, before any bf16 rounding: within a bf16 step of the unfused chain's result."""

    def __init__(self, weight: torch.Tensor) -> None:
        half = weight.shape[0] // 2
        self.gate, self.up = PackedWeight(weight[:half].contiguous()), PackedWeight(weight[half:].contiguous())
        self.panels: torch.Tensor | None = None  # the panel kernel's gate and up panels, side by side

    def panels_for(self, rows: int) -> torch.Tensor | None:
        """The panel kernel's gated panels for an [rows, K] input, or None: oneDNN's two products."""
        if not panel_linear.takes(rows, self.gate.main.shape):
            return None
        if self.panels is None:
            self.panels = panel_linear.pack_gated(self.gate.main.to_dense(), self.up.main.to_dense())
        return self.panels

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        m = x2.shape[0]
        panels = self.panels_for(m) if x2.stride(-1) == 1 else None
        if panels is not None:
            return panel_linear.silu_and_mul(x2, panels).view(*x.shape[:-1], panels.shape[0] * 16)
        act = torch.ops.mkldnn._linear_pointwise(x2, self.gate.for_rows(m), None, "swish", [], "")
        out = torch.ops.mkldnn._linear_pointwise.binary(x2, act, self.up.for_rows(m), None, "mul")
        return out.view(*x.shape[:-1], out.shape[-1])


def gated_silu_and_mul(owner, x: torch.Tensor, weight: Callable[[], torch.Tensor]) -> torch.Tensor:
    """SiLU(gate) * up of x by `owner.gated`, the GatedPair packed from `weight()` on the first call:
    only SiLU MLPs ask, so no other [gate; up] layer holds the halves."""
    if getattr(owner, "gated", None) is None:
        owner.gated = GatedPair(weight())
    return owner.gated(x)


def prepack(weight: torch.Tensor) -> torch.Tensor | PackedWeight:
    """W in the form `linear` multiplies fastest: packed where `should_pack` says so, else W itself."""
    return PackedWeight(weight) if should_pack(weight) else weight


def linear(x: torch.Tensor, prepacked: torch.Tensor | PackedWeight) -> torch.Tensor:
    """x @ W^T for W as `prepack` left it."""
    return packed_linear(x, prepacked, None) if isinstance(prepacked, PackedWeight) else F.linear(x, prepacked)


class DenseWeight(nn.Module):
    """A float weight [N, K] behind the same interface as `int4pack.Int4Planes` (GGUF tensors with
    no int4 form). `weight` stays the float truth (rows, state); bf16 products use the packed copy."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        # An attribute, not a buffer: the opaque tensor stays out of state_dict.
        self.packed_weight = PackedWeight(weight) if should_pack(weight) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None and x.dtype == torch.bfloat16:
            return packed_linear(x, self.packed_weight, None)
        return F.linear(x, self.weight)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """SiLU(gate) * up of this [gate; up] weight in one pass (`GatedPair`), for bf16 x where the
        weight is packed; None: the caller runs the product and the activation."""
        if self.packed_weight is None or x.dtype != torch.bfloat16:
            return None
        return gated_silu_and_mul(self, x, lambda: self.weight)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.weight.to(dtype or self.weight.dtype)
