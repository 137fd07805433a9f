"""Batch-invariant execution (`--batch-invariant`): a request's logits, to the last bit, do not
depend on which other requests share its steps, how its prompt was chunked, or whether its
tokens were verified speculatively.

Without it, a bfloat16 request's greedy output can change with the batch (vLLM #5898): the row
count M of a matmul picks the kernel (the int4 planes run their own kernel up to 4 rows and a
dense bf16 copy above; BLAS libraries choose blockings, and with them summation orders, by M),
and the attention path depends on the query count (few queries read the pool in place, fresh
prompts go to SDPA). Each is exact arithmetic done in a different order; in bfloat16 the last
bits differ and near-tie argmaxes flip.

So in this mode every linear layer (the LM head included) runs on tiles of exactly `ROW_TILE`
rows, the last one padded with zero rows: the same kernel with the same blocking for every row,
whatever the batch. Rows of a matmul never mix, so a row's result depends only on itself. A layer
whose weights are all int4 planes in bfloat16 needs no tiles: aten's int4 kernel computes each row
on its own at any row count, so such layers take it at every row count (batch-1 decode then runs
at its usual speed; large batches pay the kernel's cost per row instead of a dense GEMM's). And
attention runs every request through the CPU paged kernel, whose query rows are independent
(`TorchSDPABackend(batch_invariant=True)`). Normalisation, RoPE, activations and sampling are
per row already. The cost: the int4 kernel's per-row price at large batches, small batches
padded to a tile, and prefill attention in the decode kernel (docs/performance-journal.md measures it).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from kvflow.quant.int4pack import Int4Planes
from kvflow.quant.kernel_plan import CallPlan

ROW_TILE = 16


class RowTiledMethod:
    """A quant method whose matmuls see `ROW_TILE` rows at a time; everything else is delegated."""

    def __init__(self, method) -> None:
        self.method = method

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        pad = -n % ROW_TILE
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
        out = torch.cat([self.method.apply(layer, tile, bias) for tile in rows.split(ROW_TILE)])
        return out[:n].reshape(*x.shape[:-1], out.shape[-1])

    def silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> None:
        return None  # the fused pass would see every row at once: apply's tiles instead

    def kernel_plan(self, layer: nn.Module, rows: int, dtype: torch.dtype) -> CallPlan:
        return CallPlan(functools.partial(self.apply, layer))  # the tiles, never the method's own plan

    def silu_and_mul_plan(self, layer: nn.Module, rows: int, dtype: torch.dtype) -> None:
        return None

    def __getattr__(self, name: str):
        return getattr(self.method, name)


def make_batch_invariant(model: nn.Module) -> nn.Module:
    """In place: int4-plane layers take the int4 kernel at every row count; every other layer's
    quant method (linear layers, embeddings used as LM heads) is wrapped in row tiles."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None or isinstance(method, RowTiledMethod):
            continue
        planes = _int4_planes(module)
        if planes:
            for part in planes:
                part.use_kernel_at_any_rows()
        else:
            module.quant_method = RowTiledMethod(method)
    return model


def _int4_planes(layer: nn.Module) -> list[Int4Planes]:
    """The layer's weights when every one is bfloat16 int4 planes (GGUF parts, or an online
    method's runtime); else []."""
    parts = list(getattr(layer, "gguf_parts", None) or [getattr(layer, "quant_runtime", None)])
    if all(isinstance(p, Int4Planes) and p.scale_zero.dtype == torch.bfloat16 for p in parts):
        return parts
    return []
