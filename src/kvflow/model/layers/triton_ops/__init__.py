"""Triton kernels for the elementwise work between the matmuls: residual add + RMSNorm, RoPE on q
and k, SiLU(gate)·up.

Torch runs each of these chains as several kernels, every one a round trip through GPU memory
(RMSNorm alone: upcast, square, mean, rsqrt, scale, downcast, weight); each kernel here reads its
inputs once and writes its outputs once, and rounds to the model dtype exactly where the torch
code does, so both paths compute the same numbers.

triton is an optional (GPU) dependency, so it is imported only when a CUDA tensor asks for it;
CPU tensors always take the torch code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor

from kvflow.config import triton_installed


class Kernels(NamedTuple):
    rms_norm: Callable[[Tensor, Tensor, float, Tensor | None], Tensor | tuple[Tensor, Tensor]]
    rotary: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    silu_and_mul: Callable[[Tensor], Tensor]


def kernels_for(x: Tensor) -> Kernels | None:
    """The kernels when x is on CUDA and triton is installed; None: use the torch code."""
    return _load() if x.is_cuda else None


@functools.cache
def _load() -> Kernels | None:
    if not triton_installed():
        return None
    from kvflow.model.layers.triton_ops.activation import silu_and_mul
    from kvflow.model.layers.triton_ops.norm import rms_norm
    from kvflow.model.layers.triton_ops.rotary import rotary

    return Kernels(rms_norm, rotary, silu_and_mul)
