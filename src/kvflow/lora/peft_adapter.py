"""PEFT LoRA adapters from disk, checked against the base model before anything runs with them.

A PEFT adapter directory holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`,
`target_modules`, per-module `rank_pattern` / `alpha_pattern`) and `adapter_model.safetensors`,
whose tensors are named after the base model's modules:
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]. PEFT computes
y = base(x) + s·B(A x), s = alpha / r (alpha / sqrt(r) with rsLoRA).

Here each module's A and s·B land on a `LoRATarget`: the kvflow layer that runs that module's
matmul and, for fused layers (q/k/v in `qkv_proj`, gate/up in `gate_up_proj`), which slice of its
output. Every way an adapter can fail to fit is an error naming the adapter: missing files, a
rank above `max_lora_rank`, a module kvflow cannot adapt, a shape from another base model, a PEFT
option that changes the formula. Pickled `.bin` adapters are refused (loading one can run code).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvflow.lora.request import LoRARequest

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."
_TENSOR = re.compile(r"(?P<module>.+)\.lora_(?P<half>[AB])\.weight")
# PEFT options that change the math beyond y = xW + s·(xA)B, refused when set rather than ignored.
_UNSUPPORTED = ("use_dora", "lora_bias", "fan_in_fan_out", "modules_to_save", "layer_replication",
                "trainable_token_indices", "alora_invocation_tokens", "target_parameters", "use_qalora",
                "use_bdlora")


@dataclass(frozen=True)
class LoRATarget:
    """Where one base-model module's adapter goes: `layer` (a kvflow layer prefix), output slice
    `slice` of it, which maps `in_features` to `out_features`."""

    layer: str
    slice: int
    in_features: int
    out_features: int


@dataclass
class LoRAAdapter:
    """An adapter in host memory, ready to copy into a device slot: per (layer, slice), A [r, in]
    and B [out, r] with the scale already folded into B."""

    request: LoRARequest
    rank: int  # the largest rank of any module
    weights: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_peft_adapter(request: LoRARequest, targets: dict[str, LoRATarget], max_rank: int,
                      dtype: torch.dtype) -> LoRAAdapter:
    """Read and check the adapter `request` names. `targets`: base-model module name (as PEFT
    names it, e.g. "model.layers.0.self_attn.q_proj") → where it lands."""
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path or 'no path'})"
    config = _read_config(Path(request.lora_path), where)
    _check_options(config, targets, where)
    pairs = _read_pairs(Path(request.lora_path) / WEIGHTS_FILE, where)
    weights, rank = {}, 0
    for module, halves in sorted(pairs.items()):
        if module not in targets:
            raise ValueError(f"{where} adapts module {module!r}, which this model has no LoRA layer for "
                             f"(adaptable: {', '.join(_short_names(targets))})")
        if set(halves) != {"A", "B"}:
            raise ValueError(f"{where}: module {module!r} has lora_{next(iter(halves))} but no "
                             f"lora_{'B' if 'A' in halves else 'A'}")
        r, alpha = _rank_and_alpha(config, module)
        if r > max_rank:
            raise ValueError(f"{where} has rank {r} (module {module!r}), above max_lora_rank {max_rank}; "
                             "raise --max-lora-rank")
        target = targets[module]
        for half, expected in (("A", (r, target.in_features)), ("B", (target.out_features, r))):
            if tuple(halves[half].shape) != expected:
                raise ValueError(f"{where}: {module}.lora_{half} has shape {tuple(halves[half].shape)}, expected "
                                 f"{expected}; was it trained for another base model?")
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        # Scaled in float32, then cast: the same rounding as PEFT's fp32 forward up to one ulp.
        weights[(target.layer, target.slice)] = (halves["A"].to(dtype),
                                                 (halves["B"].float() * scale).to(dtype))
        rank = max(rank, r)
    if not weights:
        raise ValueError(f"{where} has no LoRA weights in {WEIGHTS_FILE}")
    return LoRAAdapter(request, rank, weights)


def _read_config(directory: Path, where: str) -> dict:
    path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise ValueError(f"{where}: the adapter directory does not exist")
    if not path.is_file():
        raise ValueError(f"{where}: no {CONFIG_FILE} in the adapter directory")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: {CONFIG_FILE} is not readable JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: {CONFIG_FILE} is not a LoRA adapter's (peft_type "
                         f"{config.get('peft_type') if isinstance(config, dict) else None!r})")
    return config


def _check_options(config: dict, targets: dict[str, LoRATarget], where: str) -> None:
    for option in _UNSUPPORTED:
        if config.get(option) not in (None, False, [], {}, ""):
            raise ValueError(f"{where} uses the PEFT option {option}={config[option]!r}, which kvflow does not support")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where} trains biases (bias={config['bias']!r}); kvflow supports bias='none'")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or isinstance(config.get(key), bool) or config[key] <= 0:
            raise ValueError(f"{where}: {CONFIG_FILE} needs a positive number {key!r}; got {config.get(key)!r}")
    modules = config.get("target_modules")
    if isinstance(modules, list):  # a string is a regex (or "all-linear"): the tensors tell what it matched
        known = set(_short_names(targets))
        unknown = [m for m in modules if not isinstance(m, str) or m.rsplit(".", 1)[-1] not in known]
        if unknown:
            raise ValueError(f"{where} targets modules kvflow cannot adapt: {', '.join(map(str, unknown))} "
                             f"(adaptable: {', '.join(sorted(known))})")


def _read_pairs(path: Path, where: str) -> dict[str, dict[str, torch.Tensor]]:
    """module → {"A": tensor, "B": tensor}, from the safetensors file (never a pickle)."""
    if not path.is_file():
        pickled = path.with_name("adapter_model.bin").is_file()
        raise ValueError(f"{where}: no {WEIGHTS_FILE} in the adapter directory" +
                         ("; adapter_model.bin is a pickle, which kvflow does not load (convert it to safetensors)"
                          if pickled else ""))
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{where}: {WEIGHTS_FILE} is not a readable safetensors file ({e})") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.fullmatch(name.removeprefix(_PREFIX))
        if match is None or not name.startswith(_PREFIX):
            raise ValueError(f"{where}: tensor {name!r} is not a LoRA A or B weight that kvflow can apply")
        if tensor.dim() != 2 or not tensor.is_floating_point():
            raise ValueError(f"{where}: tensor {name!r} is not a 2-D float matrix")
        pairs.setdefault(match["module"], {})[match["half"]] = tensor
    return pairs


def _rank_and_alpha(config: dict, module: str) -> tuple[int, float]:
    """PEFT's rule: the first pattern key that matches the end of the module name (at a dot)
    overrides `r` / `lora_alpha` for that module."""
    def pick(patterns: dict | None, default):
        for key, value in (patterns or {}).items():
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        return default

    return int(pick(config.get("rank_pattern"), config["r"])), float(pick(config.get("alpha_pattern"), config["lora_alpha"]))


def _short_names(targets: dict[str, LoRATarget]) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name in targets})
