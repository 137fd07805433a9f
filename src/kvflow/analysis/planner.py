"""Roofline / memory planner: how fast a model can decode on a device, and how many fit.

The model is the one derived in CS336 Lec. 10 (seeds 001 and 003):

* each decode step reads every weight plus every request's KV cache once, and does
  2 FLOPs per weight per token plus attention over the cached context;
* step latency = max(bytes / bandwidth, FLOPs / peak)  (the roofline), throughput = B / latency;
* KV per request = 2 (K and V) · layers · kv_heads · head_dim · context · dtype bytes;
* the batch that fits = (memory − weights) // KV per request;
* speculative decoding speeds decode up by (k·α + 1) / (1 + k·r).

These are ideal ceilings: real engines reach a fraction of them (seed 000: MBU 30-70%).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any

from kvflow.analysis.hardware import Hardware
from kvflow.analysis.model_spec import ModelSpec, canonical_dtype, dtype_bits

DEFAULT_BATCH_SIZES = (1, 16, 64, 256)
DEFAULT_CONTEXT_LEN = 1024  # the seeds' Llama-2-13B example (seed 001, Chapter 4)


@dataclass(frozen=True)
class SpecParams:
    """Speculative decoding: k drafted tokens, acceptance rate α, draft/target cost ratio r."""

    k: int
    alpha: float
    cost_ratio: float

    def __post_init__(self) -> None:
        if self.k < 1 or not 0.0 <= self.alpha <= 1.0 or self.cost_ratio < 0.0:
            raise ValueError("speculative decoding needs k >= 1, 0 <= alpha <= 1, cost_ratio >= 0")


def speculative_speedup(k: int, alpha: float, cost_ratio: float) -> float:
    """(k·α + 1) / (1 + k·r): tokens gained per target pass over the drafting overhead.

    This is the seeds' linear approximation of E[accepted] (seed 001, Chapter 5), not the
    exact (1 − α^(k+1)) / (1 − α) of Leviathan et al.
    """
    return (k * alpha + 1.0) / (1.0 + k * cost_ratio)


def matmul_intensity(rows: int, d_in: int, d_out: int, dtype_bytes: int = 2) -> float:
    """FLOPs per byte of X[rows, d_in] @ W[d_in, d_out], reading X and W and writing Y."""
    flops = 2 * rows * d_in * d_out
    moved = dtype_bytes * (rows * d_in + d_in * d_out + rows * d_out)
    return flops / moved


@dataclass(frozen=True)
class DecodeRow:
    batch_size: int
    kv_bytes: int  # KV held by the whole batch
    total_bytes: int  # memory footprint: all weights + kv_bytes
    bytes_read: int  # moved per step (an MoE step skips experts nobody was routed to)
    flops: float  # per step
    latency_ms: float  # per step, i.e. per token of each request
    throughput_tok_s: float
    arithmetic_intensity: float  # flops / bytes_read
    bound: str  # "memory" or "compute"
    fits: bool


@dataclass(frozen=True)
class PrefillEstimate:
    tokens: int
    flops: float
    bytes: int
    ttft_ms: float
    arithmetic_intensity: float
    bound: str


@dataclass(frozen=True)
class SpecEstimate:
    k: int
    alpha: float
    cost_ratio: float
    tokens_per_step: float  # k·α + 1 accepted per target pass
    speedup: float
    latency_ms: float  # per token at batch 1
    throughput_tok_s: float


@dataclass(frozen=True)
class QuantRow:
    """What storing weights at `weight_bits` changes (KV and compute stay in the plan dtype)."""

    weight_bits: int
    weight_bytes: int
    max_batch_size: int
    latency_ms: float  # batch 1
    throughput_tok_s: float


@dataclass(frozen=True)
class PlanResult:
    model: ModelSpec
    hardware: Hardware
    dtype: str
    weight_bits: int
    context_len: int
    kv_cache_dtype: str
    params: int
    active_params: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int
    max_batch_size: int
    rows: tuple[DecodeRow, ...]
    prefill: PrefillEstimate
    speculative: SpecEstimate | None
    quantization: tuple[QuantRow, ...]

    def to_json(self) -> dict[str, Any]:
        out = {f.name: _plain(getattr(self, f.name)) for f in fields(self)}
        out["model"] = {**asdict(self.model), "attention_kind": self.model.attention_kind}
        out["hardware"] = {
            **self.hardware.to_json(),
            "ridge_point": self.hardware.ridge_point(self.dtype),
        }
        return out


def _plain(value: Any) -> Any:
    """JSON-ready form of a result field (dataclasses and tuples of them)."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if is_dataclass(value) and not isinstance(value, (ModelSpec, Hardware)):
        return asdict(value)
    return value


def roofline(flops: float, nbytes: float, hw: Hardware, dtype: str) -> tuple[float, str]:
    """(seconds, bound): the slower of moving the bytes and doing the math."""
    t_mem = nbytes / hw.memory_bandwidth
    t_compute = flops / hw.peak(dtype)
    return max(t_mem, t_compute), ("compute" if t_compute > t_mem else "memory")


def max_batch_size(hw: Hardware, weight_bytes: int, kv_per_sequence: int) -> int:
    free = hw.memory_bytes - weight_bytes
    return max(0, int(free // kv_per_sequence)) if free > 0 else 0


def decode_row(
    model: ModelSpec, hw: Hardware, dtype: str, weight_bits: int, batch_size: int, context_len: int,
    kv_cache_dtype: str = "auto",
) -> DecodeRow:
    kv = batch_size * model.kv_bytes_for_context(context_len, dtype, kv_cache_dtype)
    read = model.decode_weight_bytes(batch_size, weight_bits) + kv
    flops = batch_size * model.flops_per_token(context_len)
    seconds, bound = roofline(flops, read, hw, dtype)
    total = model.weight_bytes(weight_bits) + kv
    return DecodeRow(
        batch_size=batch_size,
        kv_bytes=kv,
        total_bytes=total,
        bytes_read=read,
        flops=flops,
        latency_ms=seconds * 1e3,
        throughput_tok_s=batch_size / seconds,
        arithmetic_intensity=flops / read,
        bound=bound,
        fits=total <= hw.memory_bytes,
    )


def prefill_estimate(
    model: ModelSpec, hw: Hardware, dtype: str, weight_bits: int, tokens: int, kv_cache_dtype: str = "auto"
) -> PrefillEstimate:
    """Time to first token for one request: a forward pass over the prompt that writes its KV."""
    flops = model.prefill_flops(tokens)
    nbytes = model.weight_bytes(weight_bits) + model.kv_bytes_for_context(tokens, dtype, kv_cache_dtype)
    seconds, bound = roofline(flops, nbytes, hw, dtype)
    return PrefillEstimate(tokens, flops, nbytes, seconds * 1e3, flops / nbytes, bound)


def spec_estimate(spec: SpecParams, batch1: DecodeRow) -> SpecEstimate:
    speedup = speculative_speedup(spec.k, spec.alpha, spec.cost_ratio)
    latency = batch1.latency_ms / speedup
    return SpecEstimate(
        spec.k,
        spec.alpha,
        spec.cost_ratio,
        spec.k * spec.alpha + 1.0,
        speedup,
        latency,
        1e3 / latency,
    )


def quant_row(model: ModelSpec, hw: Hardware, dtype: str, bits: int, context_len: int,
              kv_cache_dtype: str = "auto") -> QuantRow:
    row = decode_row(model, hw, dtype, bits, 1, context_len, kv_cache_dtype)
    weights = model.weight_bytes(bits)
    fit = max_batch_size(hw, weights, model.kv_bytes_for_context(context_len, dtype, kv_cache_dtype))
    return QuantRow(bits, weights, fit, row.latency_ms, row.throughput_tok_s)


def plan(
    model: ModelSpec,
    hw: Hardware,
    dtype: str = "bfloat16",
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
    context_len: int = DEFAULT_CONTEXT_LEN,
    spec: SpecParams | None = None,
    weight_bits: int | None = None,
    kv_cache_dtype: str = "auto",
) -> PlanResult:
    """Plan decode for `model` on `hw`: every request holds `context_len` tokens of KV.

    `dtype` is the compute and KV dtype; `weight_bits` stores weights narrower (int8 → 8);
    `kv_cache_dtype` fp8/int8 stores KV in one byte per number plus scales, as the engine does.
    """
    if context_len < 1 or not batch_sizes or any(b < 1 for b in batch_sizes):
        raise ValueError("need context_len >= 1 and at least one batch size, all >= 1")
    dtype = canonical_dtype(dtype)
    bits = weight_bits or dtype_bits(dtype)
    kv = kv_cache_dtype
    kv_seq = model.kv_bytes_for_context(context_len, dtype, kv)
    rows = tuple(decode_row(model, hw, dtype, bits, b, context_len, kv) for b in batch_sizes)
    batch1 = decode_row(model, hw, dtype, bits, 1, context_len, kv)
    quant_bits = sorted({dtype_bits(dtype), 8, 4}, reverse=True)
    return PlanResult(
        model=model,
        hardware=hw,
        dtype=dtype,
        weight_bits=bits,
        context_len=context_len,
        kv_cache_dtype=kv,
        params=model.param_count(),
        active_params=model.active_param_count(),
        weight_bytes=model.weight_bytes(bits),
        kv_bytes_per_token=model.kv_bytes_per_token(dtype, kv),
        kv_bytes_per_sequence=kv_seq,
        max_batch_size=max_batch_size(hw, model.weight_bytes(bits), kv_seq),
        rows=rows,
        prefill=prefill_estimate(model, hw, dtype, bits, context_len, kv),
        speculative=spec_estimate(spec, batch1) if spec else None,
        quantization=tuple(quant_row(model, hw, dtype, b, context_len, kv) for b in quant_bits),
    )
