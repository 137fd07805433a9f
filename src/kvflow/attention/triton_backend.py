"""The GPU backend: Triton kernels for the KV store, paged prefill and split-K decode.

Each layer stores the new K/V into their slots, then routes every request by its query length:
single-token requests (decodes) go to the Flash-Decoding kernel, whose parallelism comes from
splitting the context; everything else (fresh prompts, chunks after a cached prefix, speculative
verification) goes to the paged prefill kernel, whose parallelism comes from the queries. Both
write disjoint rows of one output tensor, so a mixed batch costs two launches and no copies.

The routing depends only on the batch, so it is planned on the first layer and reused by every
layer through `meta.plans`.

With `sparse_decode_blocks` K, decodes of more than K blocks read only K of them per KV head
(attention/sparse_decode.py): after the layer's launches the blocks its writes filled are
summarized, the blocks are picked in torch, and the same split-K kernel walks a table of only the
picked blocks. Picking reads the step's shapes on the host, so it is not captured in CUDA graphs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from kvflow.attention import kv_quant, sparse_decode
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
    sparse_requests: torch.Tensor | None = None  # [Bs] int32: decodes read sparsely (sparse_decode.py)


class TritonBackend:
    name = "triton"

    def __init__(self, max_context_len: int | None = None, sparse_decode_blocks: int | None = None) -> None:
        # With a fixed bound (the model's max length) the decode grid is the same every step, as
        # CUDA graph replay needs; without one it follows this step's longest context, rounded up
        # to a power of two so it changes rarely.
        sparse_decode.check_blocks(sparse_decode_blocks)
        if sparse_decode_blocks is not None and max_context_len is not None:
            raise ValueError("sparse_decode_blocks is not captured in CUDA graphs: use it with enforce_eager")
        self.max_context_len = max_context_len
        self.sparse_decode_blocks = sparse_decode_blocks
        self.key_summaries = None if sparse_decode_blocks is None else sparse_decode.KeySummaries()

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, layer: AttentionLayerSpec) -> torch.Tensor:
        _require_runnable(q)
        out = torch.empty_like(q)
        for launch in self.launches(q, k, v, kv_cache, meta, layer, out):
            launch()
        if self.key_summaries is not None and layer.sliding_window is None:
            self._attend_sparse(q, kv_cache, meta, layer, out)
        return out

    def _attend_sparse(self, q, kv_cache, meta: AttentionMetadata, layer: AttentionLayerSpec, out) -> None:
        """Summarize the blocks this layer's write filled; the long decodes over their picked blocks."""
        if layer.writes_kv:
            self.key_summaries.after_write(kv_cache, meta, layer)
        requests = meta.plans[self._plan_key(q, layer)].sparse_requests
        if requests is None:
            return
        picked = sparse_decode.pick_blocks(q, self.key_summaries.of(kv_cache, layer), meta, requests.long(), layer,
                                           self.sparse_decode_blocks)
        tables, seq_lens = sparse_decode.compact_tables(meta, requests.long(), picked)
        bound = triton.next_power_of_2(self.sparse_decode_blocks * meta.block_size)
        for launch in decode_split_k_launches(q, kv_cache, out, requests, meta.query_start_loc, seq_lens, tables,
                                              layer.scale, None, num_splits=num_splits_for(bound)):
            launch()

    def _plan_key(self, q, layer: AttentionLayerSpec) -> tuple:
        # The tile table depends on the GQA group through block_q; which decodes are sparse on the
        # layer's window.
        block_q = query_tile_size(layer.num_heads, layer.num_kv_heads, layer.head_dim, q.dtype)
        return self.name, block_q, self.key_summaries is not None and layer.sliding_window is None

    def launches(self, q, k, v, kv_cache, meta: AttentionMetadata, layer: AttentionLayerSpec,
                 out: torch.Tensor) -> list[KernelLaunch]:
        """The kernel launches of forward(), in order, writing into `out`: every choice of grid and
        tile is made here, for the GPU run and for `kvflow bench gpu-compile` alike."""
        if kv_quant.is_quantized(kv_cache):
            raise NotImplementedError(f"the triton attention backend cannot read a quantized KV cache "
                                      f"({kv_cache.dtype}) yet; use kv_cache_dtype=auto or attention_backend=torch_sdpa")
        key = self._plan_key(q, layer)
        plan = meta.plans.get(key)
        if plan is None:
            plan = meta.plans[key] = self._plan(meta, key[1], sparse=key[2])
        launches = [kv_store_launch(k, v, kv_cache, meta.slot_mapping) if layer.writes_kv else None]
        batch = (meta.query_start_loc, meta.seq_lens, meta.block_tables, layer.scale, layer.sliding_window)
        if plan.prefill_tiles is not None:
            launches.append(paged_prefill_launch(q, kv_cache, out, plan.prefill_tiles, *batch))
        if plan.decode_requests is not None:
            launches += decode_split_k_launches(q, kv_cache, out, plan.decode_requests, *batch,
                                                num_splits=plan.num_splits)
        return [launch for launch in launches if launch is not None]

    def _plan(self, meta: AttentionMetadata, block_q: int, sparse: bool = False) -> _Plan:
        """`sparse`: decodes of more than sparse_decode_blocks blocks are planned apart."""
        lens = meta.query_lens_cpu
        device = meta.seq_lens.device
        long = [i for i, n in enumerate(lens) if n == 1 and sparse
                and -(-meta.seq_lens_cpu[i] // meta.block_size) > self.sparse_decode_blocks]
        decodes = sorted(set(i for i, n in enumerate(lens) if n == 1) - set(long))
        others = [i for i, n in enumerate(lens) if n != 1]
        sparse_requests = torch.tensor(long, dtype=torch.int32).to(device) if long else None
        if not others and not long:
            # A pure decode step plans without a host-to-device copy, so it may run inside CUDA
            # graph capture.
            decode_requests = torch.arange(len(lens), dtype=torch.int32, device=device)
        else:
            decode_requests = torch.tensor(decodes, dtype=torch.int32).to(device) if decodes else None
        tiles = make_tiles(lens, others, block_q, device) if others else None
        bound = self.max_context_len or triton.next_power_of_2(max(meta.seq_lens_cpu, default=1))
        return _Plan(tiles, decode_requests, num_splits_for(bound), sparse_requests)


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
