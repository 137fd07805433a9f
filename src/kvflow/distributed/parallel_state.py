"""The tensor-parallel group a model is built for, and how attention heads split over it.

A layer learns its rank and group size when it is constructed. Instead of threading a group
through every model constructor, `build_model` puts one in scope (`tensor_parallel_scope`) for
the duration of construction, the way `torch.device(...)` puts a device in scope; layers read it
with `current_tensor_parallel()` and keep it. Outside a scope it is the single-rank group, so a
model built anywhere else is exactly today's model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.scoped import Scoped


@dataclass(frozen=True)
class TensorParallel:
    """Rank `rank` of `size`; `group` is the torch.distributed process group that joins them (None
    for one rank, or for a rank built only to load its slice, as tests do)."""

    rank: int = 0
    size: int = 1
    group: object | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place."""
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' tensors concatenated along `dim`, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)


SINGLE = TensorParallel()
_IN_SCOPE = Scoped("kvflow_tensor_parallel", SINGLE)
tensor_parallel_scope = _IN_SCOPE.scope
current_tensor_parallel = _IN_SCOPE.current


@dataclass(frozen=True)
class HeadSplit:
    """One rank's attention heads: `num_heads` query heads and `num_kv_heads` KV heads, the first
    of them global KV head `first_kv_head`. With fewer KV heads than ranks each rank keeps one
    KV head, shared by the ranks whose query heads read it (replicated, as vLLM does)."""

    num_heads: int
    num_kv_heads: int
    first_kv_head: int


def split_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel, what: str = "the model") -> HeadSplit:
    size = tp.size
    if num_heads % size or (num_kv_heads and (num_kv_heads % size if num_kv_heads >= size else size % num_kv_heads)):
        works = [n for n in range(1, num_heads + 1) if num_heads % n == 0
                 and (not num_kv_heads or (num_kv_heads % n == 0 if num_kv_heads >= n else n % num_kv_heads == 0))]
        raise ValueError(f"tensor_parallel_size={size} does not split {what}'s {num_heads} attention heads and "
                         f"{num_kv_heads} KV heads evenly over ranks; sizes that would work: "
                         f"{', '.join(map(str, works))}")
    if not num_kv_heads:
        return HeadSplit(num_heads // size, 0, 0)
    if num_kv_heads >= size:
        per_rank = num_kv_heads // size
        return HeadSplit(num_heads // size, per_rank, tp.rank * per_rank)
    return HeadSplit(num_heads // size, 1, tp.rank * num_kv_heads // size)
