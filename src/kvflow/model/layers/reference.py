"""The torch code of the elementwise ops between the matmuls (RMSNorm with its residual add, rotary
embedding), in float32 as the reference models compute them: what the layers run where no kernel
does, and the reference the C++ and Triton kernels (`cpu_ops`, `triton_ops`) are tested against.
It imports no kernel package, so those can fall back to it."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


def torch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The torch code, and the reference the kernel is tested against."""
    if residual is None:
        return _norm(x, weight, eps)
    x = x + residual
    return _norm(x, weight, eps), x


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


@dataclass
class Rope:
    """One forward pass's rotary inputs, shared by all its layers."""

    positions: torch.Tensor  # [T]
    cos_table: torch.Tensor  # [max_positions, head_dim / 2] float32
    sin_table: torch.Tensor
    custom_ops: bool = True  # False: the torch code rotates, never a kernel (the model's `custom_ops`)

    @cached_property
    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's (cos, sin), [T, 1, head_dim / 2]: the torch code's operands, looked up
        by the first layer that needs them (the kernel looks them up itself)."""
        return self.cos_table[self.positions].unsqueeze(1), self.sin_table[self.positions].unsqueeze(1)


def torch_rotary(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """The torch code, and the reference the kernel is tested against."""
    cos, sin = rope.cos_sin
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
