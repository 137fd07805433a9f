"""The token embedding and the LM head: one [vocab, hidden] matrix read two ways.

Both are loaded like a column-parallel linear whose output channels are vocabulary rows (a
tensor-parallel rank keeps a slice of the vocabulary), and both go through a quant method: the
embedding gathers rows, the head multiplies by the matrix. A tied head is the embedding itself.
"""

from __future__ import annotations

import torch

from kvflow.model.layers.linear import LinearBase
from kvflow.quant.base import QuantizationConfig


class VocabParallelEmbedding(LinearBase):
    tp_split = "output"
    quant_kind = "embedding"

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", **tp) -> None:
        super().__init__(embedding_dim, [num_embeddings], False, quant_config, prefix, **tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._check_unsplit()
        return self.quant_method.embedding(self, ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [T, vocab] (the tied LM head)."""
        self._check_unsplit()
        return self.quant_method.apply(self, hidden).float()

    def _check_unsplit(self) -> None:
        if self.tp_size > 1:
            raise NotImplementedError("a vocabulary split over ranks needs masking and a gather, which kvflow does not have yet")


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: its own matrix, used only for logits."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)
