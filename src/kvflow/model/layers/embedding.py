"""The token embedding and the LM head: one [vocab, hidden] matrix read two ways.

Both are loaded like a column-parallel linear whose output channels are vocabulary rows, and both
go through a quant method: the embedding gathers rows, the head multiplies by the matrix. A tied
head is the embedding itself.

Under tensor parallelism rank r keeps vocabulary rows [r·V', (r+1)·V'), V' = ⌈V / ranks⌉ (the
last rank's tail is zero padding). The embedding looks up the ids in its range, zeroes the rest
and all-reduces: exactly one rank contributes each row, so the sum is exact. The head computes
its slice of the logits and all-gathers them; padding columns are cut off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.model.layers.linear import LinearBase, tensor_parallel_for
from kvflow.quant.base import QuantizationConfig


class VocabParallelEmbedding(LinearBase):
    tp_split = "output"
    quant_kind = "embedding"

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", **tp) -> None:
        self.num_embeddings = num_embeddings
        ranks = tensor_parallel_for(**tp).size
        super().__init__(embedding_dim, [-(-num_embeddings // ranks) * ranks], False, quant_config, prefix, **tp)
        self.vocab_start = self.tp_rank * self.output_sizes[0]

    def weight_loader(self, param, loaded: torch.Tensor, shard_id=None) -> None:
        padded = self.output_sizes[0] * self.tp_size
        if self.tp_size > 1 and loaded.shape[0] == self.num_embeddings < padded:
            loaded = F.pad(loaded, (0, 0) * (loaded.dim() - 1) + (0, padded - self.num_embeddings))
        super().weight_loader(param, loaded, shard_id)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.embedding(self, ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.output_sizes[0])
        rows = self.quant_method.embedding(self, local.masked_fill(outside, 0))
        return self.tp.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0))

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor:
        """Logits [T, vocab] (the tied LM head): float32, or with `widen=False` in the dtype the
        head computes them (for a caller that only takes their argmax: widening keeps the order)."""
        logits = self.quant_method.apply(self, hidden)
        if widen:
            logits = logits.float()
        if self.tp_size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[..., :self.num_embeddings]


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: its own matrix, used only for logits."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)
