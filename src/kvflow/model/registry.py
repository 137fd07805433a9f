"""Architecture name (config.json "architectures") → model class."""

from __future__ import annotations

from torch import nn

from kvflow.attention.backend import AttentionBackend
from kvflow.model.arch_config import ArchConfig
from kvflow.model.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def build_model(cfg: ArchConfig, backend: AttentionBackend) -> nn.Module:
    cls = MODEL_REGISTRY.get(cfg.architecture)
    if cls is None:
        raise ValueError(
            f"architecture {cfg.architecture!r} is not supported; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    return cls(cfg, backend)
