"""Loaders turn a model reference into one `Checkpoint`: an HF-style config, HF-named weights
and (when present) a tokenizer. Model classes only ever see HF names, whatever the file format."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvflow.model.tokenizer import Tokenizer


@dataclass
class Checkpoint:
    hf_config: dict
    # (HF parameter name, tensor) pairs, e.g. "model.layers.0.self_attn.q_proj.weight".
    # A generator, so a large checkpoint never sits in memory twice.
    weights: Iterator[tuple[str, torch.Tensor]]
    tokenizer: Tokenizer | None
    # How the weights are stored, as HF's config.json "quantization_config" says (None: float).
    quant_config: dict | None = None
