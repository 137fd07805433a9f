"""RMSNorm, computed in float32 whatever the model dtype, as the reference models do; optionally
adding the residual first, so that a decoder layer's residual add costs no pass of its own. On the
fused kernels of `triton_ops.kernels_for` unless the model was built with `custom_ops="none"`."""

from __future__ import annotations

import torch
from torch import nn

from kvflow.cpu_extension import current_kernels
from kvflow.model.layers.reference import torch_rms_norm
from kvflow.model.layers.triton_ops import kernels_for


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.custom_ops = current_kernels().custom_ops  # False: the torch code, always

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The normed x; with a residual, (normed(x + residual), x + residual)."""
        kernels = kernels_for(x) if self.custom_ops else None
        norm = kernels.rms_norm if kernels is not None else torch_rms_norm
        return norm(x, self.weight, self.eps, residual)
