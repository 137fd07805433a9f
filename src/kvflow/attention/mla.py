"""Multi-head latent attention over the paged latent cache (DeepSeek-V2/V3).

Each cached position holds one vector of C = kv_lora_rank + qk_rope_head_dim numbers: the
compressed latent c (shared by every head) and the RoPE key k_pe. With the up-projections
absorbed into the query and the output, every head attends over those vectors directly:

    score_h(t, s) = [W_UK_h^T q_nope_h(t), q_pe_h(t)] · [c(s), k_pe(s)]
    out_h(t)      = W_UV_h Σ_s softmax(score_h)(t, s) c(s)

so attention here is multi-query attention whose keys are the whole cached vector and whose
values are its first kv_lora_rank numbers; per-head K and V are never expanded for the context.
The caller (the model's MLA layer) absorbs W_UK into the query and applies W_UV to the result.
Heads never mix here, so under tensor parallelism a rank passes its own heads' queries and gets
its heads' outputs, against the whole latent cache every rank keeps.

`mla_reference` is the oracle (one request at a time, float32); `mla_batched` gathers every
decode's latents at once and attends with two batched matmuls.
"""

from __future__ import annotations

import torch

from kvflow.attention.metadata import AttentionMetadata, allowed_keys, slot_blocks_and_offsets, zero_unseen_


def write_latents(entries: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """entries [T, C] into their slots of cache [1, num_blocks, block_size, C]."""
    blocks, offsets, rows = slot_blocks_and_offsets(meta)
    if rows is not None:
        entries = entries[rows]
    cache[0][blocks, offsets] = entries.to(cache.dtype)


def gather_latents(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """block_tables [B, n] → the requests' cached vectors [B, n * block_size, C]."""
    return cache[0][block_tables].flatten(1, 2)


def mla_attention(query: torch.Tensor, entries: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, rank: int, reference: bool = False) -> torch.Tensor:
    """Store the new positions' `entries` [T, C], then attend: query [T, H, C] (absorbed nope part,
    then the rotated RoPE part) → the attention-weighted latents [T, H, rank]."""
    write_latents(entries, cache, meta)
    if reference:
        return mla_reference(query, cache, meta, scale, rank)
    return mla_batched(query, cache, meta, scale, rank)


def mla_reference(query, cache, meta: AttentionMetadata, scale: float, rank: int) -> torch.Tensor:
    out = query.new_empty(*query.shape[:2], rank)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        n_blocks = -(-seq_len // meta.block_size)
        latents = gather_latents(cache, meta.block_tables[i:i + 1, :n_blocks])[0, :seq_len].float()  # [L, C]
        scores = torch.einsum("nhc,lc->hnl", query[start:start + q_len].float(), latents) * scale
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        scores.masked_fill_(~allowed_keys(query_pos, seq_len, None), float("-inf"))
        out[start:start + q_len] = torch.einsum("hnl,lr->nhr", scores.softmax(dim=-1), latents[:, :rank]).to(out.dtype)
        start += q_len
    return out


def mla_batched(query, cache, meta: AttentionMetadata, scale: float, rank: int) -> torch.Tensor:
    out = query.new_empty(*query.shape[:2], rank)
    starts = meta.query_start_loc.tolist()
    decodes = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
    if decodes:
        index = torch.tensor(decodes, device=query.device)
        rows = torch.tensor([starts[i] for i in decodes], device=query.device)
        n_blocks = -(-max(meta.seq_lens_cpu[i] for i in decodes) // meta.block_size)
        latents = gather_latents(cache, meta.block_tables[index, :n_blocks])  # [B, L, C]
        key_pos = torch.arange(latents.shape[1], device=query.device)
        visible = key_pos[None, :] < meta.seq_lens[index][:, None]  # [B, L]
        latents = zero_unseen_(latents, visible)
        out[rows] = _attend(query[rows], latents, visible[:, None, :], scale, rank)
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if q_len == 1:
            continue
        n_blocks = -(-seq_len // meta.block_size)
        latents = gather_latents(cache, meta.block_tables[i:i + 1, :n_blocks])[:, :seq_len]  # [1, L, C]
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        visible = allowed_keys(query_pos, seq_len, None)  # [n, L]
        rows = slice(starts[i], starts[i + 1])
        out[rows] = _attend(query[rows].transpose(0, 1)[None], latents, visible[None, None], scale, rank)[0].transpose(0, 1)
    return out


def _attend(q: torch.Tensor, latents: torch.Tensor, visible: torch.Tensor, scale: float, rank: int) -> torch.Tensor:
    """q [B, H, C] or [B, H, n, C] against latents [B, L, C]; visible broadcasts to the scores."""
    keys = latents.transpose(-1, -2)  # [B, C, L]
    if q.dim() == 4:
        keys = keys[:, None]
    scores = torch.matmul(q, keys).float() * scale
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1).to(latents.dtype)
    values = latents[..., :rank] if q.dim() == 3 else latents[:, None, :, :rank]
    return torch.matmul(probs, values)
