"""The CPU fast path over the paged cache, in plain torch.

- A chunk that starts a prompt (nothing cached before it) attends to its own keys, without reading
  the cache back: on cpu_prompt.py's kernel where it runs (bfloat16, head_dim 64; AMX tiles or
  AVX-512 BF16 dot products), else with SDPA's fused causal kernel. Its keys are those `write_kv`
  gives back: for an int8/fp8 cache, code x scale, as every later read sees them.
- A chunk of at least PREFIXED_MIN_QUERIES queries after a cached prefix (chunked prefill's next
  chunk, a prompt after a prefix-cache hit) takes the same kernel where it can, over its keys
  gathered from the blocks: in W1's prefill steps the paged kernel spent 20-84 ms a step on one such
  chunk, its 16 queries' 48 rows a time on float multiply-adds (docs/performance-journal.md, stop 34).
- On CPU with the C++ kernel built, the requests `cpu_paged.takes` (decodes, verifications, narrow
  heads' chunks after a cached prefix) are read in place from the pool, whether it holds the
  model's dtype or int8/fp8 codes (cpu_paged.py).
- With `sparse_decode_blocks` K, decodes of more than K blocks read only K of them, chosen for
  their query from per-block key summaries (sparse_decode.py), on the same kernel; layers with a
  window stay dense.
- Everything else (without the kernel: decodes, prompt chunks after a cached prefix) gathers its
  keys from the blocks and runs grouped-query attention as two batched matmuls: on CPU this is
  several times faster than SDPA with an explicit mask in bfloat16. Requests with few queries
  (decodes, and speculative verifications of k + 1 tokens) are batched by query count, in buckets
  of similar context length, so the padding each bucket gathers stays small.

Which rows go where, the gather indices and the masks depend only on the batch, so they are
planned once per step (on the first layer) and reused by every layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvflow.attention import cpu_paged, cpu_prompt, sparse_decode
from kvflow.attention.metadata import (
    AttentionLayerSpec,
    AttentionMetadata,
    gather_index,
    gather_kv,
    write_kv,
    zero_unseen_,
)

# A decode joins the current bucket while its context is at least this fraction of the bucket's
# longest: bounds padded work to 1 / BUCKET_RATIO of the real work, with few buckets.
BUCKET_RATIO = 0.6
# Requests with at most this many queries are batched with others of the same count.
SHORT_QUERY = 33
# A chunk after a cached prefix with at least this many queries takes the prompt kernel
# (cpu_prompt.py); fewer (speculative verifications, short chunks) stay with the paged kernel.
PREFIXED_MIN_QUERIES = 32


@dataclass(frozen=True)
class _Group:
    """Requests with equal query length n, attended together over their gathered blocks."""

    rows: slice | torch.Tensor  # rows of q / out, in request order
    blocks: torch.Tensor  # [B, n_blocks]
    index: torch.Tensor  # gather_index(blocks)
    mask: torch.Tensor | None  # [B, n, n_blocks * block_size]; None when every key is visible
    n: int


@dataclass(frozen=True)
class _Plan:
    fresh_prompts: list[slice]
    groups: list[_Group]
    in_place: torch.Tensor | None = None  # requests the CPU kernel attends in the pool (cpu_paged)
    tiles: bool = False  # the kernel may take their bf16 scores on AMX tiles (cpu_paged.use_tiles)
    prefixed: list[tuple[int, slice]] = ()  # (request, rows): chunks after a prefix, for the prompt kernel
    sparse: torch.Tensor | None = None  # decodes the kernel reads only some blocks of (sparse_decode.py)
    sparse_tiles: bool = False


class TorchSDPABackend:
    name = "torch_sdpa"

    def __init__(self, batch_invariant: bool = False, sparse_decode_blocks: int | None = None,
                 sparse_decode_sinks: bool = True) -> None:
        """`sparse_decode_blocks` K: a decode reads only K of its blocks (sparse_decode.py; None:
        all), its first (`sparse_decode_sinks`) and last among them."""
        sparse_decode.check_blocks(sparse_decode_blocks)
        self.kernel = cpu_paged.load_kernel()  # None: no compiler here
        self.prompt_kernel = cpu_prompt.load()  # None: no AVX-512 BF16 or no compiler here
        # Batch-invariant (model.layers.batch_invariant): every request, whatever its query
        # count, through the kernel, whose query rows never depend on each other.
        self.batch_invariant = batch_invariant
        if batch_invariant and self.kernel is None:
            raise RuntimeError("batch_invariant needs the CPU paged-attention kernel, which could not be built here "
                               "(a C++ compiler is required)")
        if sparse_decode_blocks is not None and self.kernel is None:
            raise RuntimeError("sparse_decode_blocks needs the CPU paged-attention kernel, which could not be built "
                               "here (a C++ compiler is required)")
        self.sparse_decode_blocks = sparse_decode_blocks
        self.sparse_decode_sinks = sparse_decode_sinks
        self.key_summaries = None if sparse_decode_blocks is None else sparse_decode.KeySummaries()

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, layer: AttentionLayerSpec) -> torch.Tensor:
        # Layers may differ in all; backends reading one batch (tests) in their sparse setting.
        key = (self.name, layer.sliding_window, layer.num_kv_heads, layer.head_dim, layer.writes_kv,
               self.sparse_decode_blocks)
        plan = meta.plans.get(key)
        if plan is None:
            in_place = self.kernel is not None and cpu_paged.reads(kv_cache, q.dtype)
            prefixed = self.prompt_kernel is not None and cpu_prompt.reads(q, kv_cache)
            plan = _make_plan(meta, layer.sliding_window, layer.num_kv_heads, layer.writes_kv,
                              layer.head_dim if in_place else None, self.batch_invariant, prefixed)
            if self._sparse(layer) and plan.in_place is not None:
                plan = _split_sparse(plan, meta, self.sparse_decode_blocks, layer.num_kv_heads, self.batch_invariant)
            meta.plans[key] = plan
        if layer.writes_kv:  # fresh prompts see their own keys as the cache will give them back
            k, v = write_kv(k, v, kv_cache, meta, read_back=bool(plan.fresh_prompts))
            if self._sparse(layer):
                self.key_summaries.after_write(kv_cache, meta, layer)
        out = torch.empty_like(q)
        for rows in plan.fresh_prompts:
            if self.prompt_kernel is not None and cpu_prompt.takes(q[rows], k[rows], v[rows]):
                self.prompt_kernel(out[rows], q[rows], k[rows], v[rows], layer.scale)
            else:
                out[rows] = _causal_prompt(q[rows], k[rows], v[rows], layer)
        for i, rows in plan.prefixed:  # the chunk's keys are in the cache: written above, or by the layer it shares
            seq_len = meta.seq_lens_cpu[i]
            keys, values = gather_kv(kv_cache, meta.block_tables[i:i + 1, :-(-seq_len // meta.block_size)])
            self.prompt_kernel(out[rows], q[rows], keys[0].transpose(0, 1)[:seq_len], values[0].transpose(0, 1)[:seq_len],
                               layer.scale)
        if plan.in_place is not None:
            cpu_paged.attend_in_place(self.kernel, q, kv_cache, meta, layer, plan.in_place, out, plan.tiles)
        if plan.sparse is not None:
            cpu_paged.attend_sparse(q, kv_cache, meta, layer, plan.sparse, self.key_summaries.of(kv_cache, layer),
                                    self.sparse_decode_blocks, self.sparse_decode_sinks, out, plan.sparse_tiles)
        for g in plan.groups:
            # Whole blocks: the mask hides the rest.
            keys, values = gather_kv(kv_cache, g.blocks, g.index, meta.block_size, q.dtype)
            queries = q[g.rows].view(len(g.blocks), g.n, layer.num_heads, layer.head_dim)
            out[g.rows] = grouped_attention(queries, keys, values, g.mask, layer).flatten(0, 1)
        return out

    def _sparse(self, layer: AttentionLayerSpec) -> bool:
        """Whether this layer's decodes may read only some blocks: a window already bounds them."""
        return self.key_summaries is not None and layer.sliding_window is None


def _split_sparse(plan: _Plan, meta: AttentionMetadata, top_k: int, kv_heads: int, batch_invariant: bool) -> _Plan:
    """The kernel's decodes of more than `top_k` blocks go to the sparse walk; its other requests
    stay dense. Tiles are decided anew for each call's keys (cpu_paged.use_tiles)."""
    dense, sparse = [], []
    for i in plan.in_place.tolist():
        blocks = -(-meta.seq_lens_cpu[i] // meta.block_size)
        (sparse if meta.query_lens_cpu[i] == 1 and blocks > top_k else dense).append(i)
    if not sparse:
        return plan
    device = meta.seq_lens.device
    return dataclasses.replace(
        plan, in_place=torch.tensor(dense, device=device) if dense else None,
        tiles=cpu_paged.use_tiles((meta.seq_lens_cpu[i] for i in dense), kv_heads, batch_invariant),
        sparse=torch.tensor(sparse, device=device),
        sparse_tiles=cpu_paged.use_tiles([top_k * meta.block_size] * len(sparse), kv_heads, batch_invariant))


def _make_plan(meta: AttentionMetadata, window: int | None, kv_heads: int, layer_writes: bool,
               in_place_head_dim: int | None = None, all_in_place: bool = False, prefixed_ok: bool = False) -> _Plan:
    """A fresh prompt attends to its own new keys, unless the layer writes none (it reads a
    shared layer's cache) or has a window (the masked path keeps only the window's blocks).
    `in_place_head_dim` (the layer's head_dim where the CPU kernel can read the cache, else
    None): the other requests the kernel takes (`cpu_paged.takes`: decodes, speculative
    verifications, narrow heads' chunks after a cached prefix) go to it; otherwise those of equal
    query length are batched together. `all_in_place`: every request goes to the kernel
    (batch-invariant mode). `prefixed_ok`: the prompt kernel can take this layer's chunks
    after a cached prefix (of PREFIXED_MIN_QUERIES queries or more, and no window)."""
    if all_in_place:
        if in_place_head_dim is None:
            raise ValueError("batch_invariant: the paged-attention kernel cannot read this cache "
                             f"(device {meta.seq_lens.device.type}, or a KV cache of another dtype than the model's)")
        # No AMX scores (cpu_paged.use_tiles): whether a call takes them would depend on the batch.
        return _Plan([], [], torch.arange(len(meta.query_lens_cpu), device=meta.seq_lens.device))
    starts = meta.query_start_loc.tolist()
    fresh, groups, short, kernel, prefixed = [], [], {}, [], []
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        is_fresh = q_len == seq_len and window is None and layer_writes
        if prefixed_ok and not is_fresh and window is None and q_len >= PREFIXED_MIN_QUERIES:
            prefixed.append((i, slice(starts[i], starts[i + 1])))
        elif in_place_head_dim is not None and not is_fresh and cpu_paged.takes(q_len, seq_len, in_place_head_dim):
            kernel.append(i)
        elif q_len == 1 or (q_len <= SHORT_QUERY and not is_fresh):
            short.setdefault(q_len, []).append(i)
        elif is_fresh:
            fresh.append(slice(starts[i], starts[i + 1]))
        else:
            groups.append(_group(meta, [i], slice(starts[i], starts[i + 1]), q_len, window, kv_heads))
    for n, requests in short.items():
        for bucket in _length_buckets(requests, meta.seq_lens_cpu):
            rows = torch.tensor([starts[i] + j for i in bucket for j in range(n)], device=meta.seq_lens.device)
            groups.append(_group(meta, bucket, rows, n, window, kv_heads))
    return _Plan(fresh, groups, torch.tensor(kernel, device=meta.seq_lens.device) if kernel else None,
                 tiles=cpu_paged.use_tiles((meta.seq_lens_cpu[i] for i in kernel), kv_heads, batch_invariant=False),
                 prefixed=prefixed)


def _group(meta: AttentionMetadata, requests: list[int], rows, n: int, window: int | None, kv_heads: int) -> _Group:
    n_blocks = -(-max(meta.seq_lens_cpu[i] for i in requests) // meta.block_size)
    # A window needs no block before the one holding the earliest key any query sees.
    first = 0 if window is None else max(0, min(meta.seq_lens_cpu[i] for i in requests) - n - window + 1) // meta.block_size
    index = torch.tensor(requests, device=meta.seq_lens.device)
    seq_lens = meta.seq_lens[index]
    query_pos = seq_lens[:, None] - n + torch.arange(n, device=seq_lens.device)  # [B, n]
    key_pos = torch.arange(first * meta.block_size, n_blocks * meta.block_size, device=seq_lens.device)
    mask = key_pos[None, None, :] <= query_pos[:, :, None]
    if window is not None:
        mask &= query_pos[:, :, None] - key_pos[None, None, :] < window
    blocks = meta.block_tables[index, first:n_blocks]
    return _Group(rows, blocks, gather_index(blocks, kv_heads), None if bool(mask.all()) else mask, n)


def grouped_attention(q, k, v, mask: torch.Tensor | None, layer: AttentionLayerSpec) -> torch.Tensor:
    """q [B, n, H, D], k/v [B, Hkv, L, D] contiguous (v is overwritten where masked), mask [B, n, L]
    or None → [B, n, H, D]. The
    G = H / Hkv query heads that share a KV head are stacked, so K and V are read once per KV head."""
    batch, n, heads, dim = q.shape
    kv_heads = layer.num_kv_heads
    group = heads // kv_heads
    q = q.view(batch, n, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, group * n, dim)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * layer.scale  # [B, Hkv, G*n, L]
    if mask is not None:
        scores = scores.view(batch, kv_heads, group, n, -1).masked_fill(~mask[:, None, None], float("-inf"))
        v = zero_unseen_(v, mask.any(1)[:, None])
    probs = scores.softmax(dim=-1).to(v.dtype).view(batch, kv_heads, group * n, -1)
    out = torch.matmul(probs, v)  # [B, Hkv, G*n, D]
    return out.view(batch, kv_heads, group, n, dim).permute(0, 3, 1, 2, 4).reshape(batch, n, heads, dim)


def _causal_prompt(q, k, v, layer: AttentionLayerSpec) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        is_causal=True, scale=layer.scale, enable_gqa=layer.num_heads != layer.num_kv_heads,
    )
    return out.squeeze(0).transpose(0, 1)


def _length_buckets(requests: list[int], seq_lens: list[int]) -> list[list[int]]:
    buckets: list[list[int]] = []
    longest = 0
    for i in sorted(requests, key=lambda r: seq_lens[r], reverse=True):
        if not buckets or seq_lens[i] < BUCKET_RATIO * longest:
            buckets.append([])
            longest = seq_lens[i]
        buckets[-1].append(i)
    return buckets
