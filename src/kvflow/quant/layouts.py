"""Every resident copy of a layer's weights, by layout: what `kvflow bench memory` reports.

One weight can be held in several layouts at once, each for the products it is fastest at: int4
planes (aten's kernel), GEMV codes (kvflow's few-row kernel), a dense bf16 copy of quantized
weights, oneDNN-packed copies, panels (the panel kernel), gated pairs (SiLU·up in one product).
A layer reports its own (`LinearBase.layouts()`, from its quant method and the modules it forwards
to) as layout name → tensors, so that a report neither probes a quant method nor counts a tensor
twice (tensors shared by two layouts are told apart by their storage).
"""

from __future__ import annotations

import torch

PLANES = "int4 planes"
GEMV = "GEMV codes"
DENSE = "dense copy"  # a quantized weight's bf16 copy, for products past its own kernel's rows
PACKED = "packed"  # float weights reordered for oneDNN
PANELS = "panels"
GATED = "gated pairs"  # a [gate; up] weight's halves for SiLU·up in one product, with their panels
WEIGHTS = "weights"  # the weights as loaded: float, or a method's stored codes and scales
LAYOUTS = (PLANES, GEMV, DENSE, PACKED, PANELS, GATED, WEIGHTS)

Layouts = dict[str, list[torch.Tensor]]


def merged(*parts: Layouts) -> Layouts:
    """The layouts of several holders, tensors of one layout listed together."""
    out: Layouts = {}
    for part in parts:
        for name, tensors in part.items():
            out.setdefault(name, []).extend(t for t in tensors if t is not None)
    return out
