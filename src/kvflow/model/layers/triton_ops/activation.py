"""SiLU(gate) * up on the fused [T, 2 * intermediate] output of the gate/up projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernel_launch import KernelLaunch

_BLOCK = 1024  # columns per program


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, width, stride_t, stride_d, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate_ptr = gate_up_ptr + row * stride_t + cols * stride_d
    gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptr + width * stride_d, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # Rounded to the model dtype between the two, as torch's silu and mul each round.
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    tl.store(out_ptr + row * stride_out + cols, (silu.to(tl.float32) * up).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2 * I] (gate, then up; any strides) → [..., I]."""
    launch, out = silu_and_mul_launch(gate_up)
    if launch is not None:
        launch()
    return out


def silu_and_mul_launch(gate_up: torch.Tensor) -> tuple[KernelLaunch | None, torch.Tensor]:
    """The launch silu_and_mul makes (None: no rows) and the output it will fill."""
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    width = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], width, dtype=gate_up.dtype, device=gate_up.device)
    result = out.view(*gate_up.shape[:-1], width)
    if not rows.shape[0]:
        return None, result
    launch = KernelLaunch(
        _silu_and_mul_kernel,
        grid=(rows.shape[0], triton.cdiv(width, _BLOCK)),
        args=(rows, out, width, *rows.stride(), out.stride(0)),
        constexprs=dict(BLOCK=_BLOCK),
    )
    return launch, result
