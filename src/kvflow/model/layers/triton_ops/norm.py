"""RMSNorm, optionally after adding the residual, one tile of rows per program.

A row is read once and reduced in registers, so a program holds BLOCK_T whole rows: one for a
wide model, several for a narrow one, so that programs have enough work to amortise the launch
(and the CPU interpreter runs few of them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernel_launch import KernelLaunch

_TILE_ELEMENTS = 4096  # rows x padded width per program


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    num_rows, width, eps,
    stride_xt, stride_xd, stride_rt, stride_rd, stride_ot, stride_rot,
    HAS_RESIDUAL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (cols < width)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xt + cols[None, :] * stride_xd, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_rt + cols[None, :] * stride_rd, mask=mask, other=0.0)
        # The sum is rounded to the model dtype before it is normalised, as torch's add rounds it.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows[:, None] * stride_rot + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=1) / width + eps)
    # As the reference models: normalise in float32, round to the input dtype, then scale.
    normed = (xf * inv_rms[:, None]).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=cols < width, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_ot + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * rmsnorm(x) over the last dim; with a residual, (weight * rmsnorm(x + residual),
    x + residual). x and residual: [..., width], any strides."""
    launch, result = rms_norm_launch(x, weight, eps, residual)
    if launch is not None:
        launch()
    return result


def rms_norm_launch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> tuple[KernelLaunch | None, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    """The launch rms_norm makes (None: no rows) and the outputs it will fill."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)  # a view for [T, width] inputs; q/k [T, heads, d] views may copy
    num_rows = rows.shape[0]
    res_rows = res_out = None
    normed_dtype = x.dtype
    if residual is not None:
        res_rows = residual.reshape(-1, width)
        normed_dtype = torch.promote_types(x.dtype, residual.dtype)
        res_out = torch.empty(num_rows, width, dtype=normed_dtype, device=x.device)
    out = torch.empty(num_rows, width, dtype=torch.promote_types(normed_dtype, weight.dtype), device=x.device)
    result = out.view(x.shape) if res_out is None else (out.view(x.shape), res_out.view(x.shape))
    if not num_rows:
        return None, result
    block_d = triton.next_power_of_2(width)
    block_t = max(1, min(_TILE_ELEMENTS // block_d, triton.next_power_of_2(num_rows)))
    launch = KernelLaunch(
        _rms_norm_kernel,
        grid=(triton.cdiv(num_rows, block_t),),
        args=(rows, res_rows, weight, out, res_out,
              num_rows, width, eps,
              *rows.stride(), *(res_rows.stride() if res_rows is not None else (0, 0)),
              out.stride(0), res_out.stride(0) if res_out is not None else 0),
        constexprs=dict(HAS_RESIDUAL=residual is not None, BLOCK_T=block_t, BLOCK_D=block_d),
    )
    return launch, result
