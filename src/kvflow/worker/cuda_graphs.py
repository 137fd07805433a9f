"""Decode steps replayed from CUDA graphs.

At batch 1 a decode step of a 32-layer model is ~400 small kernel launches; launched one by one
from Python, their host cost rivals the GPU time of reading the weights. A CUDA graph records
the launches once and replays them with one call. A graph fixes every tensor's address and
shape, so:

- decode batches are padded up to one of a few sizes (buckets), each captured once at startup;
- inputs live in static buffers that each step overwrites; a padded row writes no KV (slot −1)
  and attends to nothing (context length 0), so it cannot touch another request's memory;
- the attention backend's decode grid must not depend on the step (TritonBackend with a fixed
  context bound), and nothing inside may synchronise with the host.

Only pure decode steps replay (every row one query token); prompt chunks and mixed steps run
eagerly. Logits and sampling stay outside the graph: they run on a handful of rows.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.attention.metadata import AttentionMetadata


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8, and max_num_seqs itself; a step
    pads to the next one, so padding wastes at most 7 rows (or half of a small batch)."""
    sizes = [1, 2, 4, *range(8, max_num_seqs, 8)]
    return [b for b in sizes if b < max_num_seqs] + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], block_size: int, max_num_seqs: int,
                 max_model_len: int, device: torch.device, num_kv_groups: int = 1) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.buckets = decode_buckets(max_num_seqs)
        size, width = self.buckets[-1], -(-max_model_len // block_size)
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        # One slot mapping and one block table per KV group.
        self.slot_mapping = torch.full((num_kv_groups, size), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(size, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(num_kv_groups, size, width, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def can_replay(self, meta: AttentionMetadata) -> bool:
        query_lens = meta.query_lens_cpu
        return len(query_lens) <= self.buckets[-1] and all(n == 1 for n in query_lens)

    def bucket_for(self, num_requests: int) -> int:
        return next(b for b in self.buckets if b >= num_requests)

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per bucket, largest first so the smaller ones share its memory pool."""
        pool = None
        stream = torch.cuda.Stream()
        for bucket in reversed(self.buckets):
            self._pad_rows(0, bucket)
            meta = self._metadata(bucket, [0] * bucket)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: Triton compiles its kernels outside the capture
                for _ in range(2):
                    self._forward(bucket, meta)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(bucket, meta)
            pool = graph.pool()
            self.graphs[bucket] = (graph, hidden)
        torch.cuda.synchronize()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metas: tuple[AttentionMetadata, ...]) -> torch.Tensor:
        """Hidden states [n, hidden] of a pure decode step (metadata: one per KV group), from the
        captured graph of its bucket (or, before capture, from the same padded computation run
        eagerly)."""
        n = metas[0].num_requests
        bucket = self.bucket_for(n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.seq_lens[:n] = metas[0].seq_lens
        for g, meta in enumerate(metas):
            self.slot_mapping[g, :n] = meta.slot_mapping
            self.block_tables[g, :n, :meta.block_tables.shape[1]] = meta.block_tables
        self._pad_rows(n, bucket)
        if bucket in self.graphs:
            graph, hidden = self.graphs[bucket]
            graph.replay()
            return hidden[:n]
        return self._forward(bucket, self._metadata(bucket, metas[0].seq_lens_cpu + [0] * (bucket - n)))[:n]

    def _pad_rows(self, start: int, end: int) -> None:
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[:, start:end] = -1  # write no KV
        self.seq_lens[start:end] = 0  # attend to nothing

    def _metadata(self, bucket: int, seq_lens_cpu: list[int]) -> tuple[AttentionMetadata, ...]:
        return tuple(AttentionMetadata(
            query_start_loc=self.query_start_loc[:bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=block_tables[:bucket],
            slot_mapping=slot_mapping[:bucket],
            block_size=self.block_size,
            query_lens_cpu=[1] * bucket,
            seq_lens_cpu=seq_lens_cpu,
        ) for block_tables, slot_mapping in zip(self.block_tables, self.slot_mapping))

    def _forward(self, bucket: int, meta: tuple[AttentionMetadata, ...]) -> torch.Tensor:
        return self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, meta)
