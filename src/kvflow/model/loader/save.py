"""Write a loaded (and quantized) model back as an HF-style directory that kvflow loads as is:
config.json with the method's "quantization_config", safetensors under HF names (fused layers
split back into q/k/v and gate/up), and the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from kvflow.model.layers.linear import LinearBase
from kvflow.model.tokenizer import Tokenizer


def save_checkpoint(model: nn.Module, hf_config: dict, quant_config: dict | None, tokenizer: Tokenizer | None,
                    out: str | Path) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(model)
    save_file({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, str(out / "model.safetensors"))
    config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    if quant_config is not None:
        config["quantization_config"] = quant_config
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(out)
    return out


def checkpoint_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """HF-named tensors: what each layer stores (float weights, or a method's quantized tensors)."""
    hf_part = {(fused, shard): part for part, (fused, shard) in getattr(model, "stacked_params", {}).items()}
    tensors: dict[str, torch.Tensor] = {}
    owned = set()
    for prefix, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        stored = getattr(module.quant_method, "stored_tensors", None)
        layer = dict(stored(module)) if stored is not None else {"weight": (module.weight, 0, 1)}
        if module.bias is not None:
            layer["bias"] = (module.bias, 0, 1)
        fused = prefix.rsplit(".", 1)[-1]
        for name, (tensor, out_dim, pack) in layer.items():
            owned.add(f"{prefix}.{name}")
            if len(module.shard_ids) == 1:
                tensors[f"{prefix}.{name}"] = tensor
                continue
            pieces = tensor.split([size // pack for size in module.output_sizes], dim=out_dim)
            for shard, piece in zip(module.shard_ids, pieces):
                tensors[f"{prefix[:-len(fused)]}{hf_part[(fused, shard)]}.{name}"] = piece
    for name, param in model.named_parameters():
        if name not in owned:
            tensors[name] = param
    return tensors
