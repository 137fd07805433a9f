"""The supported architectures: config.json's "architectures" name → model class, and the name
llama.cpp gives the same architecture in a GGUF file. One table, read by `build_model` and by the
GGUF loader; model modules are imported only when built."""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from kvflow.attention.backend import AttentionBackend
from kvflow.model.arch_config import ArchConfig
from kvflow.quant.base import QuantizationConfig


@dataclass(frozen=True)
class Architecture:
    module: str  # under kvflow.model.models
    cls: str
    gguf_name: str | None = None  # general.architecture in a GGUF file


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama", "LlamaForCausalLM", "llama"),
    "MistralForCausalLM": Architecture("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": Architecture("llama", "LlamaForCausalLM", "qwen2"),
    "Qwen3ForCausalLM": Architecture("llama", "Qwen3ForCausalLM", "qwen3"),
    "Gemma3ForCausalLM": Architecture("gemma3", "Gemma3ForCausalLM", "gemma3"),
    "MixtralForCausalLM": Architecture("mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": Architecture("qwen3_moe", "Qwen3MoeForCausalLM"),
    "OlmoeForCausalLM": Architecture("olmoe", "OlmoeForCausalLM"),
    "DeepseekV2ForCausalLM": Architecture("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": Architecture("deepseek_v2", "DeepseekV3ForCausalLM"),
    "Mamba2ForCausalLM": Architecture("mamba2", "ServedMamba2ForCausalLM"),
    "BambaForCausalLM": Architecture("bamba", "BambaForCausalLM"),
    "Lfm2ForCausalLM": Architecture("lfm2", "Lfm2ForCausalLM"),
    "Idefics3ForConditionalGeneration": Architecture("idefics3", "Idefics3ForConditionalGeneration"),
}


# The architectures whose prompts may hold images (kvflow.engine.prompt_images processes them).
IMAGE_ARCHITECTURES = ("Idefics3ForConditionalGeneration",)


def gguf_architectures() -> dict[str, str]:
    """llama.cpp's architecture name → the HF one."""
    return {a.gguf_name: name for name, a in ARCHITECTURES.items() if a.gguf_name}


def model_class(architecture: str) -> type[nn.Module]:
    if not architecture:
        raise ValueError("config.json has no 'architectures' entry: which model class to build is unknown")
    entry = ARCHITECTURES.get(architecture)
    if entry is None:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
    return getattr(importlib.import_module(f"kvflow.model.models.{entry.module}"), entry.cls)


def build_model(cfg: ArchConfig, backend: AttentionBackend, dtype: torch.dtype = torch.float32,
                device: str = "cpu", quant_config: QuantizationConfig | None = None) -> nn.Module:
    """The model with uninitialised parameters of `dtype`, allocated straight on `device`: an 8B
    model never exists as float32 in host memory. Buffers that must stay float32 (RoPE tables)
    say so where they are made."""
    cls = model_class(cfg.architecture)
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
