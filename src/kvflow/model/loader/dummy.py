"""Random weights of a real shape (`load_format="dummy"`), for benchmarks that need no download."""

from __future__ import annotations

import torch
from torch import nn


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
