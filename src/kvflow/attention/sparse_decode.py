"""Query-aware sparse attention at decode (Quest, Tang et al. 2024): every key stays in the pool,
but a decode reads only the blocks whose keys can score high for its query.

For each full KV block and KV head the pool keeps the elementwise minimum and maximum of the
block's keys (`KeySummaries`). For a query q, sum_d max(q_d * min_d, q_d * max_d) bounds q . k from
above for every key k of the block. A decode attends, exactly (softmax over the chosen keys
only), to the K blocks of highest bound per (request, KV head), its last block always among them
(it holds the query's own key, and is the one block not yet full), and its first block (the
attention sinks: the first tokens take much of every head's weight whatever the query) unless
`sinks` is off. The G query heads sharing a KV head read the same blocks (the kernel's work item
is the KV head), so a block's bound for the KV head is the largest of its G heads' bounds: a
block any of them may need is kept. Prompt chunks, speculative verifications and windowed layers
stay dense. A request with at most K blocks reads all of them, through the same kernel walk as a
dense decode: bit for bit the dense result.

Where the summaries live, and when they are made. One float32 tensor [num_blocks, kv_heads, 2,
head_dim] beside each pool tensor (12.5% of a bfloat16 pool at block size 16), indexed by the
physical block, like the pool. A block's summary is computed from the pool, the whole block at
once, right after a KV write fills the block's last slot (`KeySummaries.after_write`), rather than
folded in key by key as the C++ or torch write stores each row: a block may hold keys that never
went through this layer's write (a copy-on-write copy's prefix, rows rewritten after rejected
speculative tokens), and a running min/max would keep a previous tenant's or a rejected key's
values; recomputing on fill reads each block once more in its life, against the every-step reads
it saves. A block that is not full is only ever a request's last block, which is read whole, so
its summary is never used. Prefix-cache hits reuse blocks whose summaries were made when they
filled, and cached blocks are never rewritten in place (copy-on-write). What fills a full block
without a KV write — a swap-in, a KV connector's load — must call
`KeySummaries.refresh_everywhere` for the blocks it filled (the worker's hook); a block it misses
keeps a stale bound, which can only make the choice of blocks worse, never the attention over the
chosen ones inexact.

The CPU kernel (csrc/paged_attention_cpu.cpp, `paged_attention_sparse`) chooses each work item's
blocks itself, reading the summaries where they lie: choosing in torch (`pick_blocks`, the step's
decodes at once) and handing the kernel the lists cost as much as the dense attention it saved.
For triton's split-K decode kernel `pick_blocks` chooses, on the GPU, and `compact_tables` hands
it a block table of just the picked blocks per KV head. `reference_decode` is the oracle, one
request and head at a time.
"""

from __future__ import annotations

import torch

from kvflow.attention import kv_quant
from kvflow.attention.metadata import AttentionLayerSpec, AttentionMetadata, gather_kv, slot_blocks_and_offsets
from kvflow.kv_cache_spec import FullAttentionSpec, KVLayout, SlidingWindowSpec

# A request needs its last block and at least one more for a choice to exist.
MIN_BLOCKS = 2


def summary_bytes(layout: KVLayout, layers: range | None = None) -> int:
    """What the key summaries add to one block of the pool (in `layers`' pool tensors): min and max
    per KV head in float32, beside each tensor whose layers attend by K/V heads (latent attention
    and recurrent states stay dense: none)."""
    spec = layout.groups[0].spec
    if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
        return 0
    num_slots = layout.group_size if layers is None else len(layout.slots(layers))
    return num_slots * spec.num_kv_heads * 2 * spec.head_dim * 4


def check_blocks(sparse_decode_blocks: int | None) -> None:
    """ValueError naming the setting where it is not None or an int >= MIN_BLOCKS."""
    if sparse_decode_blocks is None:
        return
    if isinstance(sparse_decode_blocks, bool) or not isinstance(sparse_decode_blocks, int) \
            or sparse_decode_blocks < MIN_BLOCKS:
        raise ValueError(f"sparse_decode_blocks must be an integer >= {MIN_BLOCKS} (the blocks a decode reads, "
                         f"its last one included), got {sparse_decode_blocks!r}")


def summarize(kv_cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """[len(blocks), kv_heads, 2, head_dim] float32: each block's keys' elementwise min and max, as
    attention reads them (a quantized cache's code x scale)."""
    if kv_quant.is_quantized(kv_cache):
        codes, scales = kv_quant.split(kv_cache, block_size)
        keys = kv_quant.dequantize(codes[0][blocks], scales[0][blocks], torch.float32)
    else:
        keys = kv_cache[0][blocks].float()  # [n, kv_heads, block_size, head_dim]
    low, high = torch.aminmax(keys, dim=2)
    return torch.stack((low, high), dim=2)


class KeySummaries:
    """The key summaries of every pool a backend's layers read, made on first use (zeros: no block
    has filled yet). Layers whose caches are views of one pool tensor (one per KV group, blocks
    apart) share its summaries, as they share its blocks."""

    def __init__(self) -> None:
        self._by_pool: dict[tuple[int, int, int], torch.Tensor] = {}
        self._pools: dict[tuple[int, int, int], tuple[torch.Tensor, AttentionLayerSpec]] = {}  # for refresh_everywhere

    def of(self, kv_cache: torch.Tensor, layer: AttentionLayerSpec) -> torch.Tensor:
        key = (kv_cache.untyped_storage().data_ptr(), layer.num_kv_heads, layer.head_dim)
        summaries = self._by_pool.get(key)
        if summaries is None:
            summaries = self._by_pool[key] = torch.zeros(kv_cache.shape[1], layer.num_kv_heads, 2, layer.head_dim,
                                                         device=kv_cache.device)
            self._pools[key] = (kv_cache, layer)
        return summaries

    def after_write(self, kv_cache: torch.Tensor, meta: AttentionMetadata, layer: AttentionLayerSpec) -> None:
        """Summarize the blocks whose last slot this step's KV write filled (found once per step)."""
        if "filled_blocks" not in meta.plans:
            blocks, offsets, _ = slot_blocks_and_offsets(meta)
            meta.plans["filled_blocks"] = blocks[offsets == meta.block_size - 1]
        filled = meta.plans["filled_blocks"]
        if filled.numel():
            self.refresh(kv_cache, filled, meta.block_size, layer)

    def refresh(self, kv_cache: torch.Tensor, blocks: torch.Tensor, block_size: int,
                layer: AttentionLayerSpec) -> None:
        """Summarize `blocks` of this pool again from what they hold now: for whatever filled them
        without a KV write (swap-in, a connector's load)."""
        self.of(kv_cache, layer)[blocks] = summarize(kv_cache, blocks, block_size)

    def refresh_everywhere(self, blocks: torch.Tensor, block_size: int) -> None:
        """`refresh` in every pool summarized so far: the hook for the worker, which fills blocks
        by id (swap-in, a connector's load) without knowing the layers. A pool tensor's groups own
        its blocks apart, and each reads only its own blocks' summaries."""
        for kv_cache, layer in list(self._pools.values()):
            self.refresh(kv_cache, blocks, block_size, layer)


def pick_blocks(q: torch.Tensor, summaries: torch.Tensor, meta: AttentionMetadata, requests: torch.Tensor | list[int],
                layer: AttentionLayerSpec, top_k: int, sinks: bool = True) -> torch.Tensor:
    """The logical blocks each decode of `requests` reads, per KV head: [len(requests), kv_heads,
    min(top_k, widest)] int64, ascending, -1 after a request's last; a request of at most top_k
    blocks reads all of them."""
    rows = meta.query_start_loc[requests]  # decodes: one query each
    n_blocks = -(-meta.seq_lens[requests] // meta.block_size)  # [R]
    width = int(n_blocks.max())
    tables = meta.block_tables[requests, :width]
    bounds = _bounds(q[rows].float(), summaries[tables], layer)  # [R, width, kv_heads]
    index = torch.arange(width, device=q.device)[None, :, None]
    last = (n_blocks - 1)[:, None, None]
    bounds = bounds.masked_fill(index > last, float("-inf"))
    forced = (index == last) | ((index == 0) & sinks)
    bounds = bounds.masked_fill(forced, float("inf"))
    k = min(top_k, width)
    chosen = bounds.topk(k, dim=1).indices  # [R, k, kv_heads]
    chosen = chosen.masked_fill(chosen > last, width).sort(dim=1).values  # past the last: sorted to the end
    return chosen.masked_fill(chosen == width, -1).transpose(1, 2).contiguous()


def compact_tables(meta: AttentionMetadata, requests: torch.Tensor,
                   picked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a kernel that walks a context through a block table (triton's decode_split_k): each of
    `requests`' picked blocks (pick_blocks) as a table per KV head, [B, kv_heads, width] physical
    blocks, and its context as that walk sees it: the picked blocks whole, then the last one's keys
    up to the query's, [B]. Rows of other requests are zeros / their own lengths, never read."""
    block_size = meta.block_size
    tables = meta.block_tables[requests]  # [R, max_blocks]
    physical = tables[:, None, :].expand(-1, picked.shape[1], -1).gather(2, picked.clamp(min=0))
    n_picked = (picked[:, 0] >= 0).sum(-1)
    seq_lens = meta.seq_lens[requests]
    last = (seq_lens - 1) // block_size
    compact = torch.zeros(meta.num_requests, *picked.shape[1:], dtype=tables.dtype, device=tables.device)
    compact[requests] = physical
    walk_lens = meta.seq_lens.clone()
    walk_lens[requests] = (n_picked - 1 - last) * block_size + seq_lens
    return compact, walk_lens


def _bounds(q: torch.Tensor, summaries: torch.Tensor, layer: AttentionLayerSpec) -> torch.Tensor:
    """q [R, heads, D] float, summaries [R, n, kv_heads, 2, D] → each block's largest bound over
    the heads of each KV head, [R, n, kv_heads]. Since min <= max, max(q_d min_d, q_d max_d) is
    max_d's product where q_d > 0 and min_d's elsewhere: the bound is q+ . max + q- . min, two
    batched matmuls instead of a [R, n, heads, D] temporary (which took 5x the dense attention's time)."""
    group = layer.num_heads // layer.num_kv_heads
    queries = q.view(q.shape[0], layer.num_kv_heads, group, layer.head_dim)  # [R, Hkv, G, D]
    low, high = (summaries[:, :, :, i].permute(0, 2, 3, 1) for i in (0, 1))  # [R, Hkv, D, n]
    bounds = queries.clamp(min=0) @ high + queries.clamp(max=0) @ low  # [R, Hkv, G, n]
    return bounds.amax(2).transpose(1, 2)


def reference_decode(q: torch.Tensor, kv_cache: torch.Tensor, summaries: torch.Tensor, meta: AttentionMetadata,
                     layer: AttentionLayerSpec, request: int, top_k: int,
                     sinks: bool = True) -> tuple[torch.Tensor, list[list[int]]]:
    """The oracle, slow and obvious: request `request`'s decode output [heads, head_dim] (float32)
    attending only to its chosen blocks, and the logical blocks chosen for each KV head."""
    seq_len, block_size = meta.seq_lens_cpu[request], meta.block_size
    n_blocks = -(-seq_len // block_size)
    table = meta.block_tables[request, :n_blocks]
    query = q[int(meta.query_start_loc[request])].float()  # [heads, D]
    group = layer.num_heads // layer.num_kv_heads
    out = torch.empty(layer.num_heads, layer.head_dim)
    chosen_per_head = []
    for kv_head in range(layer.num_kv_heads):
        heads = range(kv_head * group, (kv_head + 1) * group)
        bound = {j: max(float(torch.maximum(query[h] * summaries[table[j], kv_head, 0],
                                            query[h] * summaries[table[j], kv_head, 1]).sum()) for h in heads)
                 for j in range(n_blocks)}
        forced = {n_blocks - 1} | ({0} if sinks else set())
        rest = sorted((j for j in range(n_blocks) if j not in forced), key=lambda j: -bound[j])
        chosen = sorted(forced | set(rest[:max(top_k - len(forced), 0)]))
        chosen_per_head.append(chosen)
        positions = [j * block_size + t for j in chosen for t in range(block_size) if j * block_size + t < seq_len]
        keys, values = _keys_and_values(kv_cache, table, positions, block_size, kv_head)
        for h in heads:
            probs = (keys @ query[h] * layer.scale).softmax(0)
            out[h] = probs @ values
    return out, chosen_per_head


def _keys_and_values(kv_cache, table, positions: list[int], block_size: int, kv_head: int):
    """Float32 keys and values [len(positions), D] of one KV head at these logical positions."""
    keys, values = gather_kv(kv_cache, table[None], None, block_size, torch.float32)
    index = torch.tensor(positions)
    return keys[0, kv_head, index].float(), values[0, kv_head, index].float()
