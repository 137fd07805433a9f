"""The GPU backend: Triton kernels for the KV store, paged prefill and split-K decode.

Each layer stores the new K/V into their slots, then routes every request by its query length:
single-token requests (decodes) go to the Flash-Decoding kernel, whose parallelism comes from
splitting the context; everything else (fresh prompts, chunks after a cached prefix, speculative
verification) goes to the paged prefill kernel, whose parallelism comes from the queries. Both
write disjoint rows of one output tensor, so a mixed batch costs two launches and no copies.

The routing depends only on the batch, so it is planned on the first layer and reused by every
layer through `meta.plans`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from kvflow.attention import kv_quant
from kvflow.attention.metadata import AttentionLayerSpec, AttentionMetadata
from kvflow.attention.triton_kernels import (
    decode_split_k_launches,
    kv_store_launch,
    make_tiles,
    num_splits_for,
    paged_prefill_launch,
    query_tile_size,
)
from kvflow.kernel_launch import KernelLaunch


@dataclass(frozen=True)
class _Plan:
    prefill_tiles: torch.Tensor | None  # [num_tiles, 2] (request, first query); None: no prefill rows
    decode_requests: torch.Tensor | None  # [Bd] int32; None: no decodes
    num_splits: int


class TritonBackend:
    name = "triton"

    def __init__(self, max_context_len: int | None = None) -> None:
        # With a fixed bound (the model's max length) the decode grid is the same every step, as
        # CUDA graph replay needs; without one it follows this step's longest context, rounded up
        # to a power of two so it changes rarely.
        self.max_context_len = max_context_len

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, layer: AttentionLayerSpec) -> torch.Tensor:
        _require_runnable(q)
        out = torch.empty_like(q)
        for launch in self.launches(q, k, v, kv_cache, meta, layer, out):
            launch()
        return out

    def launches(self, q, k, v, kv_cache, meta: AttentionMetadata, layer: AttentionLayerSpec,
                 out: torch.Tensor) -> list[KernelLaunch]:
        """The kernel launches of forward(), in order, writing into `out`: every choice of grid and
        tile is made here, for the GPU run and for `kvflow bench gpu-compile` alike."""
        if kv_quant.is_quantized(kv_cache):
            raise NotImplementedError(f"the triton attention backend cannot read a quantized KV cache "
                                      f"({kv_cache.dtype}) yet; use kv_cache_dtype=auto or attention_backend=torch_sdpa")
        block_q = query_tile_size(layer.num_heads, layer.num_kv_heads, layer.head_dim, q.dtype)
        key = (self.name, block_q)  # the tile table depends on the GQA group through block_q
        plan = meta.plans.get(key)
        if plan is None:
            plan = meta.plans[key] = self._plan(meta, block_q)
        launches = [kv_store_launch(k, v, kv_cache, meta.slot_mapping) if layer.writes_kv else None]
        batch = (meta.query_start_loc, meta.seq_lens, meta.block_tables, layer.scale, layer.sliding_window)
        if plan.prefill_tiles is not None:
            launches.append(paged_prefill_launch(q, kv_cache, out, plan.prefill_tiles, *batch))
        if plan.decode_requests is not None:
            launches += decode_split_k_launches(q, kv_cache, out, plan.decode_requests, *batch,
                                                num_splits=plan.num_splits)
        return [launch for launch in launches if launch is not None]

    def _plan(self, meta: AttentionMetadata, block_q: int) -> _Plan:
        lens = meta.query_lens_cpu
        device = meta.seq_lens.device
        decodes = [i for i, n in enumerate(lens) if n == 1]
        others = [i for i, n in enumerate(lens) if n != 1]
        if not others:
            # A pure decode step plans without a host-to-device copy, so it may run inside CUDA
            # graph capture.
            decode_requests = torch.arange(len(lens), dtype=torch.int32, device=device)
        else:
            decode_requests = torch.tensor(decodes, dtype=torch.int32).to(device) if decodes else None
        tiles = make_tiles(lens, others, block_q, device) if others else None
        bound = self.max_context_len or triton.next_power_of_2(max(meta.seq_lens_cpu, default=1))
        return _Plan(tiles, decode_requests, num_splits_for(bound))


def _require_runnable(q: torch.Tensor) -> None:
    """The kernels run on a CUDA GPU. Triton's interpreter (TRITON_INTERPRET=1) also takes CPU
    tensors, and kvflow's test suite runs them that way, but only with tests/conftest.py's fixes
    of the interpreter's own defects (a loop bound numpy >= 2.4 refuses; bfloat16 products and
    casts unlike the GPU's): without them a model fails, or computes other numbers. And it
    executes a kernel as numpy, program by program: a way to test kernels, not to run a model. So
    the advice for CPU is the CPU backends, never the interpreter."""
    if q.device.type == "cuda":  # the path that runs: no environment read per call
        return
    if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"):
        raise RuntimeError(
            f"the triton attention backend needs a CUDA GPU (got {q.device.type} tensors); on CPU use "
            "attention_backend='torch_sdpa' (--attention-backend torch_sdpa, the CPU default) or 'torch_reference'"
        )
