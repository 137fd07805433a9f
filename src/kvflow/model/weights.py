"""Copy HF-named tensors into a model whose projections may be fused."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn


def load_stacked_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: dict[str, tuple[str, int]],
    shard_sizes: Callable[[str], list[int]],
) -> None:
    """`stacked` maps a checkpoint projection name (q_proj) to (fused name, shard index);
    every parameter of the model must be written exactly once, shard by shard."""
    params = dict(model.named_parameters())
    pending = {name: p.numel() for name, p in params.items()}
    for name, tensor in weights:
        target, rows = _locate(name, stacked, shard_sizes)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        param = params[target].data
        dest = param if rows is None else param[rows[0]:rows[1]]
        if dest.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(tensor)
        pending[target] -= dest.numel()
    missing = sorted(n for n, left in pending.items() if left != 0)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))


def _locate(name: str, stacked, shard_sizes) -> tuple[str, tuple[int, int] | None]:
    for part, (fused, index) in stacked.items():
        if f".{part}." in name:
            sizes = shard_sizes(fused)
            start = sum(sizes[:index])
            return name.replace(f".{part}.", f".{fused}."), (start, start + sizes[index])
    return name, None
