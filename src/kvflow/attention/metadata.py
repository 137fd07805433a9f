"""What attention needs to know about the flat batch: where each request's queries start, how
long its context is, where its KV blocks are, and which cache slot each new token writes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvflow.attention import cpu_kv_write, kv_quant


@dataclass(frozen=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B+1] int64: request i's queries are rows qsl[i]:qsl[i+1]
    seq_lens: torch.Tensor  # [B] int64: context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_size: int
    # Host copies, so backends can branch and slice without a device sync per request.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # What a backend derives from this batch once and reuses in every layer (gather indices,
    # masks): keyed by backend name, filled on the first layer's call.
    plans: dict = field(default_factory=dict, compare=False)
    # Which LoRA adapter slot each row uses (a kvflow.lora.batch.LoRABatch), for the LoRA layers
    # wrapped around the linear layers; None when no row of the step has an adapter.
    lora: object | None = None

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass(frozen=True)
class AttentionLayerSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None  # a query at p sees keys k with p - k < window
    kv_group: int = 0  # whose block tables this layer reads (kvflow.kv_cache_spec)
    writes_kv: bool = True  # False: the layer reads an earlier layer's KV (cross-layer sharing)


def slot_blocks_and_offsets(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(block, offset) of each written slot, and the rows that write (None: all). A negative slot
    writes nothing: padding, or a position outside its block table."""
    if "slots" not in meta.plans:
        slots, rows = meta.slot_mapping, None
        if bool((slots < 0).any()):  # once per step, not per layer
            rows = (slots >= 0).nonzero().squeeze(1)
            slots = slots[rows]
        meta.plans["slots"] = (slots // meta.block_size, slots % meta.block_size, rows)
    return meta.plans["slots"]


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
             read_back: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the new tokens' K and V. kv_cache: [2, num_blocks, num_kv_heads, block_size, head_dim]
    (head-major inside a block, so a request's keys gather into contiguous [heads, len, dim]), or
    a quantized cache (kvflow.attention.kv_quant), which stores codes and scales. Returns k and v:
    with `read_back`, as every later read of the cache will see them (a quantized cache's code x
    scale), for a prompt attending to its own keys. On CPU one C++ op copies (or quantizes) the
    rows into their blocks (cpu_kv_write), where it is built."""
    written = cpu_kv_write.try_write(k, v, kv_cache, meta.slot_mapping, read_back)
    if written is not None:
        return written
    blocks, offsets, rows = slot_blocks_and_offsets(meta)
    k_rows, v_rows = (k, v) if rows is None else (k[rows], v[rows])
    if kv_quant.is_quantized(kv_cache):
        kv_quant.write(k_rows, v_rows, kv_cache, blocks, offsets, meta.block_size)
        if read_back:
            return kv_quant.round_trip(k, kv_cache.dtype), kv_quant.round_trip(v, kv_cache.dtype)
        return k, v
    kv_cache[0].transpose(1, 2)[blocks, offsets] = k_rows.to(kv_cache.dtype)
    kv_cache[1].transpose(1, 2)[blocks, offsets] = v_rows.to(kv_cache.dtype)
    return k, v


def gather_index(block_tables: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Rows of the cache viewed as [num_blocks * heads, block_size, head_dim] that, in order, form
    [B, heads, n * block_size, head_dim]: one copy gathers a batch straight into matmul layout."""
    heads = torch.arange(num_kv_heads, device=block_tables.device)
    return (block_tables[:, None, :] * num_kv_heads + heads[None, :, None]).flatten()


def gather_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor, index: torch.Tensor | None = None,
              block_size: int = 0, dtype: torch.dtype | None = None):
    """The cached keys and values of a batch of requests: block_tables [B, n] → K and V as
    [B, num_kv_heads, n * block_size, head_dim], contiguous. `index`: gather_index(), if precomputed.
    A quantized cache is dequantized to `dtype` on the way (its packed rows need `block_size`)."""
    batch, n = block_tables.shape
    if kv_quant.is_quantized(kv_cache):
        index = gather_index(block_tables, kv_cache.shape[2]) if index is None else index
        return kv_quant.gather(kv_cache, index, batch, block_size, dtype)
    _, num_blocks, heads, block_size, dim = kv_cache.shape
    index = gather_index(block_tables, heads) if index is None else index
    return tuple(kv_cache[i].view(num_blocks * heads, block_size, dim).index_select(0, index)
                 .view(batch, heads, n * block_size, dim) for i in (0, 1))


def allowed_keys(query_pos: torch.Tensor, key_len: int, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) mask: [num_queries, key_len] bool, True where attention may look."""
    key_pos = torch.arange(key_len, device=query_pos.device)
    mask = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        mask &= query_pos[:, None] - key_pos[None, :] < window
    return mask


def zero_unseen_(values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Zero, in place, the positions of `values` [..., L, D] that no query sees (`visible` [..., L]
    False); pass a copy (what a gather returns). A masked key's probability is 0, but 0 × NaN is
    NaN. The pool starts zeroed (`worker.kv_cache.zeros_untouched`) and freed blocks keep finite
    values, so today no unseen slot holds NaN; this keeps attention's result independent of what
    unseen slots hold, at one masked_fill per gathered layer (the CPU kernel never reads them)."""
    return values.masked_fill_(~visible[..., None], 0)
