"""RMSNorm, computed in float32 whatever the model dtype, as the reference models do; optionally
adding the residual first, so that a decoder layer's residual add costs no pass of its own."""

from __future__ import annotations

import torch
from torch import nn

from kvflow.model.layers.reference import torch_rms_norm
from kvflow.model.layers.triton_ops import kernels_for


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The normed x; with a residual, (normed(x + residual), x + residual)."""
        kernels = kernels_for(x)
        norm = kernels.rms_norm if kernels is not None else torch_rms_norm
        return norm(x, self.weight, self.eps, residual)
