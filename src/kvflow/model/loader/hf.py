"""HF model directories: config.json, safetensors (one file or sharded), tokenizer files.

Only safetensors are read: a pickled `.bin` checkpoint can run code when loaded, so it is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvflow.model.loader import Checkpoint
from kvflow.model.tokenizer import Tokenizer, has_hf_tokenizer

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def load_hf_dir(path: Path, load_tokenizer: bool = True, load_weights: bool = True) -> Checkpoint:
    config = read_hf_config(path)
    weights = _iter_tensors(safetensors_files(path)) if load_weights else iter(())
    tokenizer = Tokenizer.from_hf_dir(path) if load_tokenizer and has_hf_tokenizer(path) else None
    return Checkpoint(hf_config=config, weights=weights, tokenizer=tokenizer,
                      quant_config=config.get("quantization_config"))


def read_hf_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}") from e


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        root = path.resolve()
        outside = [s for s in shards if not (path / s).resolve().is_relative_to(root)]
        if outside:  # a downloaded index must not make us read files elsewhere on the machine
            raise ValueError(f"{index}: shard names must stay inside {path}; got {', '.join(outside)}")
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{path}: shards named in {index.name} are missing: {', '.join(missing)}")
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise ValueError(f"{path} holds only pickled weights (.bin/.pt), which kvflow never loads; "
                         "convert them to safetensors")
    raise FileNotFoundError(f"{path} has no *.safetensors weights")


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    # float weights as float32; quantized ones (int8, packed, fp8 codes) as stored
                    yield name, tensor.float() if tensor.dtype in _FLOATS else tensor
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read weights from {file}: {e}") from e
