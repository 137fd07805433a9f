"""Random weights of a real shape (`load_format="dummy"`), for benchmarks that need no download."""

from __future__ import annotations

import torch
from torch import nn


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Small normal weights, drawn where the parameters live (no host round trip for a GPU
    model); norms at 1 so activations keep a sane scale through many layers."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
