"""The registry of kvflow's GPU kernels: for each, how to ask its own launch code for the launches
one engine step makes, and what those launches cost in bytes and FLOPs.

`kvflow bench gpu-compile` compiles every launch listed here for each target GPU and checks its
resources; a test fails when a `@triton.jit` function named `*_kernel` anywhere in kvflow is never
launched by an entry. A new kernel joins by adding one `KernelEntry` whose builder calls the
kernel's `*_launch` function on meta tensors shaped as the model would pass them
(`EngineShapes.empty`), once per step it runs in.

Costs are compulsory memory traffic (each byte read or written once; re-reads are assumed to hit
in L2) and useful FLOPs (padding and masked work not counted): the planner's roofline turns them
into the time to expect.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvflow.attention.metadata import AttentionLayerSpec
from kvflow.attention.triton_backend import TritonBackend
from kvflow.bench.engine_shapes import EngineShapes, Step
from kvflow.config import EngineArgs
from kvflow.kernel_launch import KernelLaunch
from kvflow.lora.batch import LoRABatch
from kvflow.lora.triton_ops import lora_launches
from kvflow.model.arch_config import ArchConfig
from kvflow.model.layers.triton_ops.activation import silu_and_mul_launch
from kvflow.model.layers.triton_ops.norm import rms_norm_launch
from kvflow.model.layers.triton_ops.rotary import rotary_launch
from kvflow.model.registry import model_class

F32, I64 = 4, 8  # bytes


@dataclass(frozen=True)
class KernelCase:
    step: str
    role: str  # which of the kernel's launches in the step, e.g. "with residual", "window 4096"
    launch: KernelLaunch
    bytes_moved: int
    flops: int
    per_forward: int = 1  # launches like this one in one forward pass of the model


def per_head_qk_norm(arch: ArchConfig) -> bool:
    """Whether the model's attention normalises each head of q and k (two more RMSNorm launches
    per layer), as its model class says."""
    return model_class(arch.architecture).qk_norm == "per_head"


@dataclass(frozen=True)
class KernelEntry:
    name: str
    build: Callable[[EngineShapes, Step], list[KernelCase]]


def attention_cases(s: EngineShapes, step: Step) -> list[KernelCase]:
    """The triton backend's launches for one layer: its own routing, tiles and splits."""
    a, n = s.arch, step.num_tokens
    heads, kv_heads, dim = a.num_heads, a.num_kv_heads, a.head_dim
    # As LlamaAttention passes them: q and k come out of rotary contiguous, v is a view of the
    # fused q/k/v projection's output.
    _, _, v = _qkv_views(s, n)
    q, k = s.empty(n, heads, dim), s.empty(n, kv_heads, dim)
    backend = TritonBackend(s.max_model_len if step.graph else None)
    meta = s.metadata(step)
    cases = []
    for window in s.windows():
        layer = AttentionLayerSpec(heads, kv_heads, dim, dim**-0.5, window)
        role = "full attention" if window is None else f"window {window}"
        launches = backend.launches(q, k, v, s.kv_cache(), meta, layer, torch.empty_like(q))
        splits = next((x.grid[2] for x in launches if x.name == "_decode_segment_kernel"), 1)
        layers = a.sliding_windows.count(window)
        cases += [KernelCase(step.name, role, x, *_attention_cost(x, s, step, window, splits), layers)
                  for x in launches]
    return cases


def _attention_cost(launch: KernelLaunch, s: EngineShapes, step: Step, window: int | None,
                    splits: int) -> tuple[int, int]:
    a, e = s.arch, s.dtype.itemsize
    q_row, kv_row = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim  # elements per token
    seen = (lambda pos: pos + 1) if window is None else (lambda pos: min(pos + 1, window))
    decodes = [(1, L) for n, L in zip(step.query_lens, step.seq_lens) if n == 1]
    prompts = [(n, L) for n, L in zip(step.query_lens, step.seq_lens) if n != 1]
    if launch.name == "_kv_store_kernel":
        return step.num_tokens * (4 * kv_row * e + I64), 0
    if launch.name == "_paged_prefill_kernel":
        pairs = sum(seen(p) for n, L in prompts for p in range(L - n, L))
        keys = sum(L if window is None else min(L, n + window - 1) for n, L in prompts)
        return sum(2 * n * q_row * e for n, _ in prompts) + 2 * keys * kv_row * e, 4 * pairs * q_row
    if launch.name == "_decode_segment_kernel":
        keys = sum(seen(L - 1) for _, L in decodes)
        partials = 0 if splits == 1 else len(decodes) * a.num_heads * splits * (a.head_dim + 2) * F32
        return 2 * keys * kv_row * e + len(decodes) * 2 * q_row * e + partials, 4 * keys * q_row
    if launch.name == "_merge_segments_kernel":
        parts = len(decodes) * a.num_heads * splits
        return parts * (a.head_dim + 2) * F32 + len(decodes) * q_row * e, 3 * parts * a.head_dim
    raise ValueError(f"no cost model for {launch.name}")


def rms_norm_cases(s: EngineShapes, step: Step) -> list[KernelCase]:
    """The first layer's input norm (no residual yet), every other norm (residual added), and
    Qwen3's per-head q and k norms (on views of the fused projection's output)."""
    a, n, e = s.arch, step.num_tokens, s.dtype.itemsize
    hidden, layers = s.empty(n, a.hidden_size), a.num_layers
    # Layer 0's input norm has no residual yet; every later norm adds it (the final norm too).
    inputs = [("first layer", hidden, None, 1), ("with residual", hidden, s.empty(n, a.hidden_size), 2 * layers)]
    if per_head_qk_norm(a):
        q, k, _ = _qkv_views(s, n)
        inputs += [("q norm", q, None, layers), ("k norm", k, None, layers)]
    cases = []
    for role, x, residual, count in inputs:
        launch, _ = rms_norm_launch(x, s.empty(x.shape[-1]), a.rms_norm_eps, residual)
        traffic = x.numel() * e * (2 if residual is None else 4) + x.shape[-1] * e
        cases.append(KernelCase(step.name, role, launch, traffic, 4 * x.numel(), count))
    return cases


def _qkv_views(s: EngineShapes, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, heads, dim], k and v [T, kv_heads, dim]: views of the fused projection's output."""
    a = s.arch
    sizes = [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]
    q, k, v = s.empty(num_tokens, sum(sizes)).split(sizes, dim=-1)
    return tuple(x.unflatten(-1, (-1, a.head_dim)) for x in (q, k, v))


def rotary_cases(s: EngineShapes, step: Step) -> list[KernelCase]:
    a, n, e = s.arch, step.num_tokens, s.dtype.itemsize
    q, k, _ = _qkv_views(s, n)
    if per_head_qk_norm(a):  # normed q and k are fresh tensors
        q, k = s.empty(n, a.num_heads, a.head_dim), s.empty(n, a.num_kv_heads, a.head_dim)
    tables = s.empty(a.max_position_embeddings, a.head_dim // 2, dtype=torch.float32)
    launch, _ = rotary_launch(q, k, s.empty(n, dtype=torch.int64), tables, tables)
    elements = n * (a.num_heads + a.num_kv_heads) * a.head_dim
    traffic = 2 * elements * e + n * (a.head_dim * F32 + I64)  # q, k in and out; cos, sin rows; positions
    return [KernelCase(step.name, "q and k", launch, traffic, 3 * elements, a.num_layers)]


def silu_and_mul_cases(s: EngineShapes, step: Step) -> list[KernelCase]:
    n, width = step.num_tokens, s.arch.intermediate_size
    launch, _ = silu_and_mul_launch(s.empty(n, 2 * width))
    return [KernelCase(step.name, "MLP", launch, 3 * n * width * s.dtype.itemsize, 5 * n * width, s.arch.num_layers)]


LORA_ADAPTERS = 4  # adapters mixed in one step of a LoRA-enabled engine (requests round-robin over them)


def lora_cases(s: EngineShapes, step: Step) -> list[KernelCase]:
    """Each dense linear's LoRA delta at the engine's default max rank, the step's requests spread
    over LORA_ADAPTERS adapters and sorted by adapter as the runner sorts them: one shrink and an
    expand per output slice. (MoE and MLA layers' own linears are not modelled: a dense layer's.)"""
    a, e, rank = s.arch, s.dtype.itemsize, EngineArgs.max_lora_rank
    slots = sorted(i % LORA_ADAPTERS for i, n in enumerate(step.query_lens) for _ in range(n))
    batch = LoRABatch.build(slots, s.dtype, "meta", masked=False)
    n, segs = step.num_tokens, len(batch.segments)
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    linears = [("q/k/v", a.hidden_size, [q, kv, kv]), ("o", q, [a.hidden_size]),
               ("gate/up", a.hidden_size, [a.intermediate_size] * 2), ("down", a.intermediate_size, [a.hidden_size])]
    names = {"q/k/v": ("q", "k", "v"), "gate/up": ("gate", "up")}
    cases = []
    for name, width_in, widths in linears:
        ranks = len(widths) * rank
        out_slices = [(sum(widths[:i]), w) for i, w in enumerate(widths)]
        shrink, *expands = lora_launches(
            s.empty(n, sum(widths)), s.empty(n, width_in), s.empty(LORA_ADAPTERS, ranks, width_in),
            s.empty(LORA_ADAPTERS, ranks, sum(widths)), batch, rank, out_slices)
        partials = shrink.grid[2] * n * ranks * F32  # written by the shrink, read by the expands
        traffic = (n * width_in + segs * ranks * width_in) * e + partials
        cases.append(KernelCase(step.name, f"{name} shrink", shrink, traffic, 2 * n * width_in * ranks, a.num_layers))
        cases += [KernelCase(step.name, f"{part} expand", x,
                             (segs * rank * w + 2 * n * w) * e + partials // len(widths), 2 * n * rank * w, a.num_layers)
                  for part, x, w in zip(names.get(name, (name,)), expands, widths)]
    return cases


REGISTRY: tuple[KernelEntry, ...] = (
    KernelEntry("attention: KV store, paged prefill, split-K decode", attention_cases),
    KernelEntry("rms_norm", rms_norm_cases),
    KernelEntry("rotary", rotary_cases),
    KernelEntry("silu_and_mul", silu_and_mul_cases),
    KernelEntry("LoRA shrink and expand (SGMV)", lora_cases),
)
