"""MBU and MFU: how much of this machine's measured ceilings a benchmark run used.

MBU = bytes the run had to move / elapsed time / measured memory bandwidth, and
MFU = FLOPs it had to do / elapsed time / measured peak FLOP/s (`kvflow.bench.ceilings`).

"Had to" is the roofline's count, from `ModelSpec`'s closed forms: every engine step reads the
weights once, every decoded token reads its request's KV once, every prompt writes its KV once
and does its causal-prefill FLOPs. Activations, padding and the engine's own overheads are not
counted, so both figures say how close a run came to the ideal, not how busy the chip was.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvflow.analysis.model_spec import ModelSpec
from kvflow.bench.ceilings import Ceilings, measure_ceilings


@dataclass(frozen=True)
class Work:
    """What a piece of a run had to do: bytes moved to or from memory, and FLOPs."""

    bytes: float = 0.0
    flops: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(self.bytes + other.bytes, self.flops + other.flops)


@dataclass(frozen=True)
class Utilization:
    mbu: float  # fraction of measured memory bandwidth
    mfu: float  # fraction of measured peak FLOP/s

    def describe(self) -> str:
        # Three significant digits: a tiny model's MFU is far below 0.1% and must not print as 0.
        return f"MBU {100 * self.mbu:.3g}%   MFU {100 * self.mfu:.3g}%"


@dataclass(frozen=True)
class EngineShape:
    """What the formulas need to know about a running engine."""

    spec: ModelSpec
    dtype: str  # "bfloat16", ...
    dtype_bytes: int
    device: str
    # Bytes a step's weights take as the engine holds them (quantized: their packed form); None:
    # the parameter count at dtype_bytes.
    weight_bytes: int | None = None

    @classmethod
    def from_engine(cls, engine: Any) -> EngineShape:
        dtype = engine.config.model.dtype
        name = str(dtype).removeprefix("torch.")
        runner = getattr(engine, "runner", None)  # None where the model lives in worker processes
        held = held_weight_bytes(runner.model) if runner is not None else None
        return cls(ModelSpec.from_arch(engine.arch), name, dtype.itemsize, engine.config.device, held)


def held_weight_bytes(model: Any) -> int | None:
    """Bytes of the weights one forward pass reads, as `model` holds them, where it holds quantized
    weights (None: it does not, and the parameter count says it): every linear layer's stored
    form (int4 planes: what a few-row call reads, `Int4Planes.nbytes`), the norms, and the LM
    head; an untied input embedding is left out (a step reads its tokens' rows)."""
    from kvflow.model.layers.linear import LinearBase
    from kvflow.model.layers.norm import RMSNorm
    from kvflow.quant.int4pack import Int4Planes

    def own(module) -> list[torch.Tensor]:
        return [*module.parameters(recurse=False), *module.buffers(recurse=False)]

    def layer_bytes(layer) -> int:
        return sum(sub.nbytes if isinstance(sub, Int4Planes) else sum(t.numel() * t.element_size() for t in own(sub))
                   for sub in layer.modules())

    if not any(not t.is_floating_point() for m in model.modules() for t in own(m)):
        return None
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    skip = embedding if embedding is not None and getattr(model, "lm_head", None) is not embedding else None
    return sum(layer_bytes(m) if isinstance(m, LinearBase) else m.weight.numel() * m.weight.element_size()
               for m in model.modules() if m is not skip and isinstance(m, (LinearBase, RMSNorm)))


# ---- the formulas ---------------------------------------------------------------------------


def step_weight_bytes(spec: ModelSpec, dtype_bytes: int) -> int:
    """Weight bytes one forward pass reads: every layer, the norms and the LM head.

    An untied input embedding is left out: a step gathers only its tokens' rows of it.
    """
    params = spec.param_count() - spec.embedding_params() + spec.lm_head_params()
    return params * dtype_bytes


def decode_token_work(spec: ModelSpec, context: int, dtype_bytes: int) -> Work:
    """One decoded token attending to `context` positions (its own included): KV read, FLOPs."""
    kv = spec.kv_bytes_for_context(context, 8 * dtype_bytes)
    return Work(kv, spec.flops_per_token(context))


def prefill_work(spec: ModelSpec, prompt_len: int, dtype_bytes: int) -> Work:
    """A whole prompt: its KV written once and a causal prefill's FLOPs (logits for the last)."""
    return Work(spec.kv_bytes_for_context(prompt_len, 8 * dtype_bytes), spec.prefill_flops(prompt_len))


def weights_work(spec: ModelSpec, dtype_bytes: int, steps: int, held_bytes: int | None = None) -> Work:
    """`held_bytes`: a step's weight bytes as the engine holds them (EngineShape.weight_bytes)."""
    return Work(float(steps * (step_weight_bytes(spec, dtype_bytes) if held_bytes is None else held_bytes)), 0.0)


def request_decode_work(spec: ModelSpec, prompt_len: int, output_len: int, dtype_bytes: int) -> Work:
    """Decode tokens of one request (weights excluded): the first output token comes from the
    prefill, so the k-th of the other output_len − 1 attends to prompt_len + k positions."""
    return _sum(decode_token_work(spec, prompt_len + k, dtype_bytes) for k in range(1, output_len))


def latency_decode_work(spec: ModelSpec, prompt_len: int, output_len: int, dtype_bytes: int,
                        held_bytes: int | None = None) -> Work:
    """The decode phase of a lone request: output_len − 1 steps, each reading all weights."""
    steps = max(0, output_len - 1)
    return request_decode_work(spec, prompt_len, output_len, dtype_bytes) + weights_work(
        spec, dtype_bytes, steps, held_bytes
    )


def batch_work(
    spec: ModelSpec, requests: Sequence[tuple[int, int]], num_steps: int, dtype_bytes: int,
    held_bytes: int | None = None,
) -> Work:
    """A whole offline run of (prompt_len, output_len) requests that took `num_steps` steps.

    Under continuous batching the weights are read once per step whatever the step holds, so
    the step count, not the request count, sets the weight traffic.
    """
    per_request = _sum(
        prefill_work(spec, p, dtype_bytes) + request_decode_work(spec, p, n, dtype_bytes)
        for p, n in requests
    )
    return per_request + weights_work(spec, dtype_bytes, num_steps, held_bytes)


def _sum(parts: Iterable[Work]) -> Work:
    total = Work()
    for part in parts:
        total = total + part
    return total


# ---- against the ceilings -------------------------------------------------------------------


def utilization(work: Work, seconds: float, ceilings: Ceilings) -> Utilization:
    bandwidth = ceilings.memory_bandwidth_gb_s * 1e9
    return Utilization(work.bytes / seconds / bandwidth, work.flops / seconds / ceilings.peak_flops)


def roofline_seconds(work: Work, ceilings: Ceilings) -> float:
    """The ideal time for `work`: the slower of moving its bytes and doing its FLOPs."""
    return max(work.bytes / (ceilings.memory_bandwidth_gb_s * 1e9), work.flops / ceilings.peak_flops)


def add_ceilings_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ceilings-json",
        metavar="FILE",
        default=None,
        help="ceilings from `kvflow bench ceilings --json` (default: measure them now, a few s)",
    )


def load_ceilings(path: str | Path) -> Ceilings:
    data = json.loads(Path(path).read_text())
    try:
        return Ceilings(
            memory_bandwidth_gb_s=float(data["memory_bandwidth_gb_s"]),
            peak_flops=float(data["peak_flops"]),
            dtype=str(data["dtype"]),
            device=str(data["device"]),
            peak_product=str(data.get("peak_product", "")),
        )
    except KeyError as err:
        raise ValueError(f"{path}: not a `kvflow bench ceilings --json` file (no {err})") from None


def get_ceilings(path: str | None, dtype: str, device: str) -> Ceilings:
    """The ceilings from `path`, or measured now for the engine's dtype and device."""
    if path is None:
        return measure_ceilings(dtype=dtype, device=device)
    ceilings = load_ceilings(path)
    if ceilings.dtype != dtype:
        # Not an error: a user may compare against another dtype's peak on purpose.
        print(
            f"warning: ceilings were measured in {ceilings.dtype}, the engine runs {dtype}; "
            "MFU is against the file's peak",
            file=sys.stderr,
        )
    return ceilings
