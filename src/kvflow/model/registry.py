"""Architecture name (config.json "architectures") → model class."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from kvflow.attention.backend import AttentionBackend
from kvflow.model.arch_config import ArchConfig
from kvflow.model.models.llama import LlamaForCausalLM
from kvflow.quant.base import QuantizationConfig

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def build_model(cfg: ArchConfig, backend: AttentionBackend, dtype: torch.dtype = torch.float32,
                device: str = "cpu", quant_config: QuantizationConfig | None = None) -> nn.Module:
    """The model with uninitialised parameters of `dtype`, allocated straight on `device`: an 8B
    model never exists as float32 in host memory. Buffers that must stay float32 (RoPE tables)
    say so where they are made."""
    cls = MODEL_REGISTRY.get(cfg.architecture)
    if cls is None:
        raise ValueError(
            f"architecture {cfg.architecture!r} is not supported; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    with torch.device(device), _default_dtype(dtype):
        return cls(cfg, backend, quant_config).eval()


@contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
