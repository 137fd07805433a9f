"""GPTQ (Frantar et al., 2022): round a layer's weights so that its outputs on calibration inputs,
not its weights one by one, stay close to the float layer's.

The input columns are rounded one at a time, those that see the largest inputs first. Each
column's rounding error is then moved onto the columns not yet rounded, in the proportions that
cancel it best on the calibration inputs: with H = E[x xᵀ] and U the upper Cholesky factor of
H⁻¹, rounding column i by e moves e · U[i, j] / U[i, i] into every later column j. Blocks of
columns take the moves lazily, so the whole layer is updated once a block.

Used by fp8 (quant/fp8.py), whose E4M3 grid is off by up to 1/16 of every weight: rounded to
nearest, SmolLM2-135M's perplexity rose 4.3%; rounded this way, 0.85% (docs/performance-journal.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

DAMP = 0.1  # added to H's diagonal, times its mean: keeps H invertible where inputs are few or collinear
BLOCK = 64


def gptq_round(weight: torch.Tensor, gram: torch.Tensor,
               round_column: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """weight [N, K], gram [K, K] = mean of x xᵀ over the calibration inputs, round_column: one
    column [N] → its nearest values on the format's grid [N]. Returns the rounded weight [N, K]
    in float32, every value one that `round_column` produced."""
    k = weight.shape[1]
    w = weight.float().clone()
    h = gram.double().clone()
    unseen = h.diagonal() == 0  # never a nonzero input: nothing to weigh its error by
    h[unseen, unseen] = 1
    order = torch.argsort(h.diagonal(), descending=True)
    w, h = w[:, order], h[order][:, order]
    h.diagonal().add_(DAMP * h.diagonal().mean())
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    w = w.t().contiguous()  # [K, N]: each column of the weight a contiguous row (2-3× faster)
    rounded = torch.empty_like(w)
    for start in range(0, k, BLOCK):
        end = min(start + BLOCK, k)
        block, u_block = w[start:end].clone(), u[start:end, start:end]
        moved = torch.empty_like(block)
        for i in range(end - start):
            column = round_column(block[i])
            rounded[start + i] = column
            torch.div(block[i] - column, u_block[i, i], out=moved[i])
            block[i + 1:].addr_(u_block[i, i + 1:], moved[i], alpha=-1)
        w[end:].addmm_(u[start:end, end:].t(), moved, alpha=-1)
    return rounded[torch.argsort(order)].t().contiguous()
