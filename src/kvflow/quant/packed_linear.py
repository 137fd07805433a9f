"""Float weights packed once for oneDNN, for the CPU's GEMMs.

F.linear on a bf16 weight reorders W into oneDNN's blocked layout on every call; at decode (M of
1 to a few dozen rows) that reorder costs as much as the product. `torch.ops.mkldnn.
_reorder_linear_weight` does it once (as Inductor's freezing pass does) and `_linear_pointwise`
multiplies by the packed weight. The product is the same oneDNN kernel's: results are bitwise
equal to F.linear's (tests/quant/test_packed_linear.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvflow.quant import panel_linear
from kvflow.quant.base import WeightsModule
from kvflow.quant.kernel_plan import CallPlan, KernelPlan, PanelPlan, Product
from kvflow.quant.layouts import GATED, PACKED, PANELS, WEIGHTS, Layouts, merged


def should_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


# oneDNN packs a weight for a row count (`_reorder_linear_weight`'s hint), and a product whose
# kernel wants another layout converts the weight at every call. Packed for 1 row, the products of
# 384-1,280 rows ran fastest; packed for any count from 32 to 4,096, those of fewer or more rows
# did. One layer of SmolLM2, in cache, ms (median of 30) packed for 1 / 512 rows (2026-11-27):
#   qkv   128 rows 0.093 / 0.086   1,024 rows 0.499 / 0.858   2,048 rows 0.933 / 0.935
#   down  128 rows 0.155 / 0.130   1,024 rows 0.900 / 1.536   2,048 rows 1.806 / 1.557
# Those were a Xeon's (AMX). So a weight is packed for 512 rows, and, where the CPU has AMX tiles,
# for 1 row too once a product of middle size first asks (from the first packing: the float
# weight need not be kept; a tied LM head, which never sees that many rows, is never packed twice)
# (docs/performance-journal.md, stop 30). On the AMD EPYC (AVX-512, no AMX) the second layout ran every
# middle size within 2% of the first for 202 MiB of the default model (docs/performance-journal.md,
# "issue 40"): there it is never laid out.
MIDDLE_ROWS = (384, 1280)


class PackedWeight:
    """A bf16 W [N, K] packed for oneDNN: for 512 rows, and, on AMX, for 1 row once a product of
    middle size needs it (see MIDDLE_ROWS); `for_rows(m)` is the one an [m, K] input multiplies
    fastest. Where the CPU has AVX-512 BF16 (or AMX), products of up to `panel_linear.MAX_ROWS`
    rows take the panel kernel instead, on panels laid out from the packed copy when first asked
    (`panels_for`)."""

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
        if not MIDDLE_ROWS[0] <= rows <= MIDDLE_ROWS[1] or not panel_linear.has_tiles():
            return self.main
        if self.middle is None:
            self.middle = torch.ops.mkldnn._reorder_linear_weight(self.main.to_dense(), 1)
        return self.middle

    def layouts(self, packed: str = PACKED) -> Layouts:
        """Its oneDNN copies under `packed` (the name of what they copy) and its panels."""
        return {packed: [self.main, self.middle], PANELS: [self.panels]}


def product_plan(packed: PackedWeight | None, rows: int, fallback: Product) -> KernelPlan:
    """The plan of a product of `rows` bf16 rows by `packed` (`packed_linear` runs its panels where
    they take the rows); `fallback`, the holder's own call, elsewhere."""
    panels = packed.panels_for(rows) if packed is not None else None
    return CallPlan(fallback) if panels is None else PanelPlan(panels, False, panel_linear.has_tiles())


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
    """SiLU(x W_gate^T) * (x W_up^T) of a [2I, K] bf16 weight in one product, laid out when a SiLU MLP
    first asks: on the panel kernel's gated panels (the gate's and the up's side by side, SiLU of the
    gate's float sums times the up's) for the rows that kernel takes; and, where the CPU has AMX
    tiles (or no panel kernel at all), past them on oneDNN with the SiLU in the gate product's
    epilogue and the multiply in the up's (the halves packed apart). Neither writes the [M, 2I]
    intermediate and reads it back. SmolLM2's shape, 30 layers' weights cycling, against the unfused
    product and activation: on panels (AMD EPYC, no AMX) 9-13% faster at 16-512 rows; oneDNN's on a
    Xeon (AMX) 2,048 rows 4.6 -> 3.7 ms a layer, 512-1,024 rows 12-17%, but on the EPYC 3.4% at
    1,024 rows and 1.3% at 2,048, for a second copy of the weight (101 MiB of the default model's):
    so there products past the panels run unfused (`takes`) (docs/performance-journal.md, issue 40). The
    SiLU is taken on the float sums, before any bf16 rounding: within a bf16 step of the unfused
    chain's result."""

    def __init__(self, weight: torch.Tensor) -> None:
        half = weight.shape[0] // 2
        self.shape = (weight.shape[0], weight.shape[1])
        gate, up = weight[:half].contiguous(), weight[half:].contiguous()
        # the panel kernel's gate and up panels, side by side, where it takes the shape at all
        self.panels = panel_linear.pack_gated(gate, up) if panel_linear.takes(1, gate.shape) else None
        self.gate = self.up = None
        if _halves_pay():
            self.gate, self.up = PackedWeight(gate), PackedWeight(up)

    def takes(self, rows: int) -> bool:
        return gated_takes(rows, self.shape)

    def panels_for(self, rows: int) -> torch.Tensor | None:
        """The gated panels for an [rows, K] input, or None: oneDNN's two products (`takes`)."""
        return self.panels if panel_linear.takes(rows, (self.shape[0] // 2, self.shape[1])) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        m = x2.shape[0]
        panels = self.panels_for(m)
        if panels is not None:
            rows = x2 if x2.stride(-1) == 1 else x2.contiguous()
            return panel_linear.silu_and_mul(rows, panels).view(*x.shape[:-1], panels.shape[0] * 16)
        act = torch.ops.mkldnn._linear_pointwise(x2, self.gate.for_rows(m), None, "swish", [], "")
        out = torch.ops.mkldnn._linear_pointwise.binary(x2, act, self.up.for_rows(m), None, "mul")
        return out.view(*x.shape[:-1], out.shape[-1])

    def plan(self, rows: int) -> KernelPlan:
        """What `self(x)` runs for x of `rows` rows it `takes` (quant/kernel_plan.py)."""
        panels = self.panels_for(rows)
        return CallPlan(self) if panels is None else PanelPlan(panels, True, panel_linear.has_tiles())

    def layouts(self) -> Layouts:
        halves = merged(*(h.layouts(GATED) for h in (self.gate, self.up) if h is not None))
        return {GATED: [*halves.get(GATED, []), *halves.get(PANELS, []), self.panels]}


def gated_takes(rows: int, weight_shape: tuple[int, int] | torch.Size) -> bool:
    """Whether a GatedPair of a [2I, K] weight runs SiLU·up of `rows` rows (else the caller runs the
    product and the activation): on its panels, or on oneDNN's halves where it keeps them."""
    return panel_linear.takes(rows, (weight_shape[0] // 2, weight_shape[1])) or _halves_pay()


def _halves_pay() -> bool:
    """oneDNN's fused halves measured to pay where the CPU has AMX tiles; where there is no panel
    kernel they are the only fused form (no measurement says otherwise)."""
    return panel_linear.has_tiles() or not panel_linear.available()


def gated_pair(owner, rows: int, weight_shape: torch.Size, weight: Callable[[], torch.Tensor]) -> GatedPair | None:
    """`owner.gated`, the GatedPair packed from `weight()` (of `weight_shape`) when first asked for,
    where it takes a product of `rows` rows; None: the caller runs the product and the activation.
    Only SiLU MLPs ask, so no other [gate; up] layer holds a pair."""
    if not gated_takes(rows, weight_shape):
        return None
    if getattr(owner, "gated", None) is None:
        owner.gated = GatedPair(weight())
    return owner.gated


def prepack(weight: torch.Tensor) -> torch.Tensor | PackedWeight:
    """W in the form `linear` multiplies fastest: packed where `should_pack` says so, else W itself."""
    return PackedWeight(weight) if should_pack(weight) else weight


def linear(x: torch.Tensor, prepacked: torch.Tensor | PackedWeight) -> torch.Tensor:
    """x @ W^T for W as `prepack` left it."""
    return packed_linear(x, prepacked, None) if isinstance(prepacked, PackedWeight) else F.linear(x, prepacked)


class DenseWeight(WeightsModule):
    """A float weight [N, K] behind the same interface as `int4pack.Int4Planes` (GGUF tensors with
    no int4 form). `weight` stays the float truth (rows, state); bf16 products use the packed copy."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        # An attribute, not a buffer: the opaque tensor stays out of state_dict.
        self.packed_weight = PackedWeight(weight) if should_pack(weight) else None
        self.gated: GatedPair | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None and x.dtype == torch.bfloat16:
            return packed_linear(x, self.packed_weight, None)
        return F.linear(x, self.weight)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """SiLU(gate) * up of this [gate; up] weight in one pass (`GatedPair`), for bf16 x where the
        weight is packed; None: the caller runs the product and the activation."""
        if self.packed_weight is None or x.dtype != torch.bfloat16:
            return None
        pair = gated_pair(self, x.numel() // x.shape[-1], self.weight.shape, lambda: self.weight)
        return None if pair is None else pair(x)

    def kernel_plan(self, rows: int, dtype: torch.dtype) -> KernelPlan:
        return product_plan(self.packed_weight if dtype == torch.bfloat16 else None, rows, self.forward)

    def silu_and_mul_plan(self, rows: int, dtype: torch.dtype) -> KernelPlan | None:
        if self.packed_weight is None or dtype != torch.bfloat16:
            return None
        pair = gated_pair(self, rows, self.weight.shape, lambda: self.weight)
        return None if pair is None else pair.plan(rows)

    def layouts(self) -> Layouts:
        packed = self.packed_weight.layouts() if self.packed_weight is not None else {}
        return merged({WEIGHTS: [self.weight]}, packed, self.gated.layouts() if self.gated is not None else {})

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.weight.to(dtype or self.weight.dtype)
