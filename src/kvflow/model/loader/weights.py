"""Checkpoint tensors into a model's parameters, through each parameter's `weight_loader`."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvflow.phases import progress
from kvflow.quant.base import copy_checked

# checkpoint projection name → (fused layer name, shard id), e.g. "q_proj" → ("qkv_proj", "q")
StackedParams = dict[str, tuple[str, object]]


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], stacked: StackedParams) -> None:
    """Every shard of every parameter must come from the checkpoint; a tensor with no place in the
    model, or of the wrong shape, is an error naming it."""
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {name: set() for name in params}
    for name, tensor in weights:
        target, shard_id = _locate(name, stacked)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        param = params[target]
        loader = getattr(param, "weight_loader", None)
        try:
            if loader is not None:
                loader(param, tensor, shard_id)
            else:
                copy_checked(param.data, tensor)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r} {e}") from None
        loaded[target].add(shard_id)
    missing = sorted(n for n, p in params.items() if not loaded[n] >= set(getattr(p, "shard_ids", (None,))))
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))


def process_weights_after_loading(model: nn.Module) -> None:
    """Let each layer's quant method turn loaded weights into the form it runs (once per layer,
    so a tied embedding/head is processed once)."""
    layers = [(module, m) for module in model.modules() if (m := getattr(module, "quant_method", None)) is not None]
    for done, (module, method) in enumerate(layers, 1):
        method.process_weights_after_loading(module)
        progress(done, len(layers), "layers")
    methods = [method for _, method in layers]
    for method in methods:
        method.finish_loading()


def _locate(name: str, stacked: StackedParams) -> tuple[str, object]:
    for part, (fused, shard_id) in stacked.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard_id
    return name, None
