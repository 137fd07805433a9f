"""C++ kernels for the elementwise work between the matmuls on CPU: residual add + RMSNorm, RoPE
on q and k, SiLU(gate)·up (`csrc/fused_ops_cpu.cpp`); and greedy sampling's argmax over the
vocabulary (torch's max(dim) took 28–66 µs a 49,152-wide row, this ~4).

On a small model these memory-bound chains, run as torch ops over float32 temporaries, cost
more than the matmuls (W1 on SmolLM2-135M: casts, mul, add, pow and sum were over half the CPU
time). Each kernel reads its inputs once and writes its outputs once, and rounds where the
torch code rounds, so the numbers are the torch path's (tests/model/test_cpu_ops.py).

Two of them work in place, as vLLM's CPU kernels do: RoPE rotates q and k where they lie (views
of the qkv projection's output, which nothing else reads), and the residual add overwrites the
residual stream (the decoder loop's own tensor, dead once the sum is taken).

The library is built once per machine (kvflow/cpu_extension.py); where it cannot be, or in a
model built with `custom_ops="none"` (config.KernelConfig), the torch code runs.
Inputs the kernels do not take (other dtypes, mixed dtypes, a strided last dimension) take the
torch code too.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from kvflow import cpu_extension
from kvflow.model.layers.reference import Rope, torch_rms_norm, torch_rotary

SOURCE = Path(__file__).parent / "csrc" / "fused_ops_cpu.cpp"
DTYPES = (torch.float32, torch.bfloat16)


def load() -> tuple | None:
    """(rms_norm, rotary, silu_and_mul), the library built if need be; None where it cannot be."""
    if not cpu_extension.load_library("kvflow_cpu_ops", SOURCE, "the fused CPU elementwise kernels",
                                      extra_cflags=("-ffp-contract=off", *cpu_extension.WIDE_VECTORS)):
        return None
    return rms_norm, rotary, silu_and_mul


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """As reference.torch_rms_norm; with a residual, the sum x + residual is written into `residual`
    (which is returned as the new residual stream) where it is a contiguous tensor of x's dtype."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    in_place = residual is not None and residual.is_contiguous() and residual.shape == x.shape
    if (weight.dtype != x.dtype or rows.stride(-1) != 1
            or (residual is not None and (residual.dtype != x.dtype or not in_place))):
        return torch_rms_norm(x, weight, eps, residual)
    out = torch.empty(rows.shape, dtype=x.dtype)
    torch.ops.kvflow_cpu_ops.rms_norm(out, rows, None if residual is None else residual.view(-1, width), weight, eps)
    return out.view(x.shape) if residual is None else (out.view(x.shape), residual)


def rotary(q: Tensor, k: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """As reference.torch_rotary on q [T, heads, head_dim] and k [T, kv_heads, head_dim], in place."""
    if q.dtype != k.dtype or q.stride(-1) != 1 or k.stride(-1) != 1 or positions.dtype != torch.int64:
        rope = Rope(positions, cos, sin)
        return torch_rotary(q, rope), torch_rotary(k, rope)
    torch.ops.kvflow_cpu_ops.rotary(q, k, positions.contiguous(), cos.contiguous(), sin.contiguous())
    return q, k


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """As activation.torch_silu_and_mul on gate_up [..., 2 * width]."""
    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], width, dtype=gate_up.dtype)
    torch.ops.kvflow_cpu_ops.silu_and_mul(out, rows)
    return out.view(*gate_up.shape[:-1], width)


def first_argmax(x: Tensor) -> Tensor:
    """As x.max(dim=-1).indices on float32 or bfloat16 x [rows, width] (rows with unit stride): the
    first of equal maxima, or the first NaN."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    torch.ops.kvflow_cpu_ops.first_argmax(out, x)
    return out
