"""What a linear layer's product runs at a given row count: its kernel plan.

A layer answers "at this many rows, which product on which tensors" (`LinearBase.kernel_plan`,
implemented by each quant method and the runtime modules it forwards to), so that a caller that
runs the products itself (the CPU decode step, worker/cpu_decode.py) never looks inside a quant
method. A plan is one of:

- `GemvPlan`: kvflow's few-row int4/int8 GEMV (`int4_gemv.Int4Gemv`) on these codes;
- `PanelPlan`: the panel kernel's bf16 product (`panel_linear`) on these panels; for the fused
  SiLU·up of a [gate; up] layer (`gated=True`), its gated panels;
- `CallPlan`: "call me": the layer's own callable, for a form no caller runs by itself.

Each is exactly what the layer's own call does at that row count (the same kernel on the same
tensors), so a caller running the plan computes the layer's numbers bit for bit. Asking for a plan
lays out what its product needs if the layer has not yet (panels, a gated pair), as the first such
call would.

A quant method that publishes nothing gets `CallPlan`s: a new method runs everywhere without a
caller changing, and publishes a GEMV or panel plan once it multiplies on one of those kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Product = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class GemvPlan:
    """x [rows, K] · Wᵀ by `int4_gemv`'s kernel: W as `codes` of `bits` bits with bf16 (scale,
    zero) pairs per group (`scale_zero`), computed the way `path` says (int4_gemv.SCALAR, ...)."""

    codes: torch.Tensor
    scale_zero: torch.Tensor
    bits: int
    path: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        torch.ops.kvflow_int4_gemv.int4_gemv(out, x, self.codes, self.scale_zero, self.bits, self.path)
        return out


@dataclass(frozen=True)
class PanelPlan:
    """x [rows, K] · Wᵀ on `panels` (`panel_linear.pack`), or, `gated`, SiLU(x W_gateᵀ) · (x W_upᵀ)
    on a gated pair's panels (`panel_linear.pack_gated`); on AMX tiles where `tiles`."""

    panels: torch.Tensor
    gated: bool
    tiles: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.panels.shape[0] * 16, dtype=x.dtype)
        torch.ops.kvflow_panel_linear.linear(out, x, self.panels, None, self.gated, self.tiles)
        return out


@dataclass(frozen=True)
class CallPlan:
    """The layer's own callable (x [rows, K] → [rows, N], or the gated product's [rows, N / 2])."""

    product: Product

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)


KernelPlan = GemvPlan | PanelPlan | CallPlan
