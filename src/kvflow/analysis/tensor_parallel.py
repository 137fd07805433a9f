"""Tensor parallelism in the roofline: what N devices joined by all-reduce buy a decode step.

Megatron-style TP (what `--tensor-parallel-size` runs) splits each layer's matrices over N
ranks: every rank reads 1/N of the weights and of the KV heads (all of them when there are
fewer KV heads than ranks: each rank then keeps one head; MLA's latent is never split) and does
1/N of the FLOPs. The price is communication on the critical path of every step:

* two all-reduces per layer (after the attention output and the MLP down projections) and one
  for the vocab-parallel embedding, each of [tokens, hidden] activations;
* one all-gather of the vocab-parallel LM head's logits (float32).

A ring all-reduce moves 2(N-1)/N of the message through each rank's link and an all-gather
(N-1)/N; each collective also pays a fixed latency (launch, synchronisation, the protocol's
hops), which dominates the KB-sized messages of decode. Decode cannot hide it behind compute
(each collective's output feeds the next layer), so it adds:

    step = max(bytes_per_rank / bandwidth, flops_per_rank / peak) + collectives.

The bandwidth is the per-direction link of one device (NVLink 4 on H100 SXM: 900 GB/s both
ways, i.e. 450 GB/s each way); the per-collective latency is a parameter, not a datasheet
figure: `docs/performance-journal.md` derives it from gpt-fast's published 8xA100 scaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvflow.analysis.hardware import Hardware
from kvflow.analysis.model_spec import ModelSpec, dtype_bits
from kvflow.analysis.planner import roofline

DEFAULT_ALLREDUCE_LATENCY_S = 10e-6
LOGIT_BYTES = 4  # the LM head's logits are gathered in float32


@dataclass(frozen=True)
class TPRow:
    batch_size: int
    bytes_per_rank: int  # weights + KV read by one rank per step
    memory_per_rank: int  # weights + KV held by one rank
    compute_ms: float  # the roofline of one rank's share
    comm_ms: float  # collectives per step
    latency_ms: float  # compute_ms + comm_ms: per token of each request
    throughput_tok_s: float
    comm_share: float  # comm_ms / latency_ms
    speedup: float  # over one device's roofline (which may not fit in its memory)
    fits: bool


@dataclass(frozen=True)
class TPPrefill:
    tokens: int
    compute_ms: float
    comm_ms: float
    ttft_ms: float


@dataclass(frozen=True)
class TPEstimate:
    size: int
    link_bandwidth: float  # bytes/s per direction per device
    allreduce_latency_s: float
    allreduces_per_step: int
    kv_fraction_per_rank: float
    rows: tuple[TPRow, ...]
    prefill: TPPrefill


def kv_fraction_per_rank(model: ModelSpec, size: int) -> float:
    """Share of a request's KV one rank holds: its KV heads (at least one), or all of MLA's latent."""
    if model.mla is not None:
        return 1.0
    return math.ceil(model.num_kv_heads / size) / model.num_kv_heads


def allreduce_seconds(nbytes: float, size: int, link_bandwidth: float, latency_s: float) -> float:
    """Ring all-reduce: each rank's link carries 2(N-1)/N of the message, plus a fixed latency."""
    if size == 1:
        return 0.0
    return latency_s + 2 * (size - 1) / size * nbytes / link_bandwidth


def allgather_seconds(nbytes: float, size: int, link_bandwidth: float, latency_s: float) -> float:
    """Ring all-gather of a `nbytes` result: (N-1)/N of it crosses each rank's link."""
    if size == 1:
        return 0.0
    return latency_s + (size - 1) / size * nbytes / link_bandwidth


def collectives_seconds(model: ModelSpec, tokens: int, size: int, act_bytes: float,
                        link_bandwidth: float, latency_s: float, logit_rows: int) -> float:
    activations = tokens * model.hidden_size * act_bytes
    reduces = (2 * model.num_layers + 1) * allreduce_seconds(activations, size, link_bandwidth, latency_s)
    logits = allgather_seconds(logit_rows * model.vocab_size * LOGIT_BYTES, size, link_bandwidth, latency_s)
    return reduces + logits


def tensor_parallel_estimate(
    model: ModelSpec, hw: Hardware, size: int, dtype: str, weight_bits: int,
    batch_sizes: tuple[int, ...], context_len: int, kv_cache_dtype: str = "auto",
    allreduce_latency_s: float = DEFAULT_ALLREDUCE_LATENCY_S,
) -> TPEstimate:
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if model.num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide {model.name}'s {model.num_heads} heads")
    if hw.interconnect_bandwidth is None:
        raise ValueError(f"{hw.name} has no device-to-device link figure for tensor parallelism")
    if allreduce_latency_s < 0:
        raise ValueError(f"allreduce latency must be >= 0 s, got {allreduce_latency_s}")
    act_bytes = dtype_bits(dtype) / 8
    link = hw.interconnect_bandwidth
    kv_share = kv_fraction_per_rank(model, size)
    weights = model.weight_bytes(weight_bits)
    rows = []
    for b in batch_sizes:
        kv = b * model.kv_bytes_for_context(context_len, dtype, kv_cache_dtype)
        read = model.decode_weight_bytes(b, weight_bits) / size + kv * kv_share
        flops = b * model.flops_per_token(context_len)
        compute, _ = roofline(flops / size, read, hw, dtype)
        one_device, _ = roofline(flops, model.decode_weight_bytes(b, weight_bits) + kv, hw, dtype)
        comm = collectives_seconds(model, b, size, act_bytes, link, allreduce_latency_s, logit_rows=b)
        step = compute + comm
        held = int(weights / size + kv * kv_share)
        rows.append(TPRow(b, int(read), held, compute * 1e3, comm * 1e3, step * 1e3, b / step,
                          comm / step, one_device / step, held <= hw.memory_bytes))
    flops = model.prefill_flops(context_len)
    nbytes = weights / size + model.kv_bytes_for_context(context_len, dtype, kv_cache_dtype) * kv_share
    compute, _ = roofline(flops / size, nbytes, hw, dtype)
    comm = collectives_seconds(model, context_len, size, act_bytes, link, allreduce_latency_s, logit_rows=1)
    return TPEstimate(
        size=size,
        link_bandwidth=link,
        allreduce_latency_s=allreduce_latency_s,
        allreduces_per_step=2 * model.num_layers + 1,
        kv_fraction_per_rank=kv_share,
        rows=tuple(rows),
        prefill=TPPrefill(context_len, compute * 1e3, comm * 1e3, (compute + comm) * 1e3),
    )
