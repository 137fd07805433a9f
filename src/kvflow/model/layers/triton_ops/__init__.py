"""Triton kernels for the elementwise work between the matmuls: residual add + RMSNorm, RoPE on q
and k, SiLU(gate)·up.

Torch runs each of these chains as several kernels, every one a round trip through GPU memory
(RMSNorm alone: upcast, square, mean, rsqrt, scale, downcast, weight); each kernel here reads its
inputs once and writes its outputs once, and rounds to the model dtype exactly where the torch
code does, so both paths compute the same numbers.

triton is an optional (GPU) dependency, so it is imported only when a CUDA tensor asks for it.
CPU tensors in float32 or bfloat16 get the C++ kernels of `cpu_ops` (the same seam, the same
contract), where that library loads; otherwise the torch code. A layer built with
`custom_ops="none"` never asks (config.KernelConfig).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor

from kvflow.config import triton_installed
from kvflow.model.layers import cpu_ops


class Kernels(NamedTuple):
    rms_norm: Callable[[Tensor, Tensor, float, Tensor | None], Tensor | tuple[Tensor, Tensor]]
    rotary: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    silu_and_mul: Callable[[Tensor], Tensor]


def kernels_for(x: Tensor) -> Kernels | None:
    """The kernels for x's device and dtype: Triton's on CUDA (where triton is installed), the
    C++ ones on CPU (where they build); None: use the torch code."""
    if x.is_cuda:
        return _load()
    if x.device.type == "cpu" and x.dtype in cpu_ops.DTYPES:
        return _load_cpu()
    return None


@functools.cache
def _load_cpu() -> Kernels | None:
    kernels = cpu_ops.load()
    return None if kernels is None else Kernels(*kernels)


@functools.cache
def _load() -> Kernels | None:
    if not triton_installed():
        return None
    from kvflow.model.layers.triton_ops.activation import silu_and_mul
    from kvflow.model.layers.triton_ops.norm import rms_norm
    from kvflow.model.layers.triton_ops.rotary import rotary

    return Kernels(rms_norm, rotary, silu_and_mul)
