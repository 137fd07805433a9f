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
option that changes the formula, a `rank_pattern` / `alpha_pattern` that is no regular expression
or maps to no positive number, and a weight that is NaN or infinite as it would be served (B
after scaling and the cast to the serving dtype: an fp16 overflow in a fine-tune is enough), whose
requests could only produce NaN. Pickled `.bin` adapters are refused (loading one can run code).

Errors name the adapter, never its directory: a request that names a served adapter may reach
the disk (an adapter evicted from host memory is read again), and its client did not choose, and
must not learn, where the server keeps it. Whoever gave the path knows it.
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
    where = f"LoRA adapter {request.lora_name!r}"
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
        weights[(target.layer, target.slice)] = _served_pair(halves, scale, dtype, f"{where}: {module}")
        rank = max(rank, r)
    if not weights:
        raise ValueError(f"{where} has no LoRA weights in {WEIGHTS_FILE}")
    return LoRAAdapter(request, rank, weights)


def _served_pair(halves: dict[str, torch.Tensor], scale: float, dtype: torch.dtype,
                 where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A and s·B as the layers will hold them, each refused if any value of it is not finite."""
    # Scaled in float32, then cast: the same rounding as PEFT's fp32 forward up to one ulp.
    served = {"A": halves["A"].to(dtype), "B": (halves["B"].float() * scale).to(dtype)}
    for half, tensor in served.items():
        if not bool(tensor.isfinite().all()):
            cause = ("holds NaN or infinite values" if not bool(halves[half].isfinite().all()) else
                     f"overflows {str(dtype).removeprefix('torch.')} once " +
                     (f"multiplied by its scale {scale:g} and cast" if half == "B" else "cast"))
            raise ValueError(f"{where}.lora_{half} {cause}; an adapter must be finite as it is served")
    return served["A"], served["B"]


def _read_config(directory: Path, where: str) -> dict:
    path = directory / CONFIG_FILE
    try:  # a path too long, or a directory the server may not read, is an OSError even to is_dir
        if not directory.is_dir():
            raise ValueError(f"{where}: the adapter directory does not exist")
        if not path.is_file():
            raise ValueError(f"{where}: no {CONFIG_FILE} in the adapter directory")
        config = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"{where}: the adapter directory or its {CONFIG_FILE} cannot be read "
                         f"({_reason(e, directory)})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
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
    _check_patterns(config, where)
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
        raise ValueError(f"{where}: {WEIGHTS_FILE} is not a readable safetensors file "
                         f"({_reason(e, path.parent)})") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.fullmatch(name.removeprefix(_PREFIX))
        if match is None or not name.startswith(_PREFIX):
            raise ValueError(f"{where}: tensor {name!r} is not a LoRA A or B weight that kvflow can apply")
        if tensor.dim() != 2 or not tensor.is_floating_point():
            raise ValueError(f"{where}: tensor {name!r} is not a 2-D float matrix")
        pairs.setdefault(match["module"], {})[match["half"]] = tensor
    return pairs


def _reason(error: Exception, directory: Path) -> str:
    """What went wrong, without the server's path: Python's OSErrors name the file beside their
    strerror, safetensors' inside their message."""
    text = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    return text.replace(str(directory), "<adapter directory>")


def _pattern(key: str) -> str:
    """PEFT's rule: a `rank_pattern` / `alpha_pattern` key matches the end of a module name, at a dot."""
    return rf"(.*\.)?({key})$"


def _check_patterns(config: dict, where: str) -> None:
    """Each pattern a regular expression, each rank a positive integer, each alpha a positive
    number: a bad one is refused here, not met as an exception halfway through the modules."""
    for option, value_type, kind in (("rank_pattern", int, "positive integer"),
                                     ("alpha_pattern", (int, float), "positive number")):
        patterns = config.get(option)
        if patterns is None:
            continue
        if not isinstance(patterns, dict):
            raise ValueError(f"{where}: {CONFIG_FILE}'s {option} must map module patterns to values; "
                             f"got {type(patterns).__name__}")
        for key, value in patterns.items():
            try:
                re.compile(_pattern(key))
            except re.error as e:
                raise ValueError(f"{where}: {CONFIG_FILE}'s {option} key {key!r} is not a valid regular "
                                 f"expression ({e})") from None
            if not isinstance(value, value_type) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{where}: {CONFIG_FILE}'s {option}[{key!r}] must be a {kind}; got {value!r}")


def _rank_and_alpha(config: dict, module: str) -> tuple[int, float]:
    """The first pattern key that matches the module overrides `r` / `lora_alpha` for it
    (patterns checked by `_check_patterns`)."""
    def pick(patterns: dict | None, default):
        for key, value in (patterns or {}).items():
            if re.match(_pattern(key), module):
                return value
        return default

    return int(pick(config.get("rank_pattern"), config["r"])), float(pick(config.get("alpha_pattern"), config["lora_alpha"]))


def _short_names(targets: dict[str, LoRATarget]) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name in targets})
