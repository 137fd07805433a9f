"""Float weights packed once for oneDNN, for the CPU's small-M GEMMs.

F.linear on a bf16 weight reorders W into oneDNN's blocked layout on every call; at decode (M of
1 to a few dozen rows) that reorder costs as much as the product. `torch.ops.mkldnn.
_reorder_linear_weight` does it once (as Inductor's freezing pass does) and `_linear_pointwise`
multiplies by the packed weight. The product is the same oneDNN kernel's: results are bitwise
equal to F.linear's (tests/quant/test_packed_linear.py).
"""

from __future__ import annotations

import os

import torch


DISABLE_ENV = "KVFLOW_PACKED_LINEAR"  # =0: F.linear at every call (for A/B measurements)


def should_pack(weight: torch.Tensor) -> bool:
    return (os.environ.get(DISABLE_ENV, "1") != "0" and weight.device.type == "cpu"
            and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available())


def pack_weight(weight: torch.Tensor, batch_size_hint: int = 1) -> torch.Tensor:
    """W [N, K] bf16 → an opaque mkldnn tensor of the same shape."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_size_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) with W packed by `pack_weight`."""
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1])
