"""Linear layers that own their weights through a quantization method.

A layer knows its shape and where each checkpoint tensor lands in its parameters: which rows a
shard of a fused projection fills (q/k/v, gate/up) and, under tensor parallelism, which slice
rank `tp_rank` of `tp_size` keeps (output channels for column-parallel layers, input channels for
row-parallel ones). Its `quant_method` decides what the parameters are and how x @ W^T runs.
Models build these layers and never branch on quantization or sharding.

A layer takes its rank and group from the tensor-parallel scope it is built in
(`kvflow.distributed.parallel_state`); `tp_rank`/`tp_size` given explicitly build one rank's
slice with no group (to load and inspect shards). A row-parallel layer's ranks each hold part
of the sum x W^T: they all-reduce it, then add the bias once.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.cpu_extension import current_kernels
from kvflow.distributed.parallel_state import TensorParallel, current_tensor_parallel, split_heads
from kvflow.quant.base import QuantizationConfig, QuantMethod, copy_checked, set_weight_attrs
from kvflow.quant.kernel_plan import CallPlan, KernelPlan
from kvflow.quant.layouts import Layouts
from kvflow.quant.unquantized import UnquantizedMethod


def quant_method_for(quant_config: QuantizationConfig | None, kind: str, prefix: str) -> QuantMethod:
    method = quant_config.get_quant_method(kind, prefix) if quant_config is not None else None
    return method if method is not None else UnquantizedMethod()


class LinearBase(nn.Module):
    """y = x W^T + b, W [sum(output_sizes), input_size], made of shards named by `shard_ids`."""

    tp_split: str | None = None  # "output" (column-parallel), "input" (row-parallel) or None
    quant_kind = "linear"

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 shard_ids: tuple = (None,), tp_rank: int | None = None, tp_size: int | None = None) -> None:
        super().__init__()
        self.prefix, self.shard_ids = prefix, shard_ids
        self.tp = tensor_parallel_for(tp_rank, tp_size)
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        if self.tp_split == "input":
            input_size = _divide(input_size, self.tp_size, prefix)
        if self.tp_split == "output":
            output_sizes = [_divide(s, self.tp_size, prefix) for s in output_sizes]
        self.input_size, self.output_sizes = input_size, list(output_sizes)  # this rank's
        self.kernels = current_kernels()  # which layouts its method keeps (cpu_extension.kernel_scope)
        self.quant_method = quant_method_for(quant_config, self.quant_kind, prefix)
        self.quant_method.create_weights(self, input_size, self.output_sizes, torch.get_default_dtype())
        if bias:
            b = nn.Parameter(torch.empty(sum(self.output_sizes)), requires_grad=False)
            self.register_parameter("bias", set_weight_attrs(b, output_dim=0, weight_loader=self.weight_loader))
        else:
            self.register_parameter("bias", None)
        for param in self.parameters(recurse=False):
            param.shard_ids = shard_ids  # the loader reports shards a checkpoint never filled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def kernel_plan(self, rows: int, dtype: torch.dtype) -> KernelPlan:
        """What this layer's call runs for x of `rows` rows of `dtype`: the product its quant method
        publishes (quant/kernel_plan.py), or, with a bias, hooks or ranks to reduce over, itself."""
        if self.bias is not None or self._forward_pre_hooks or self._forward_hooks or self.tp_size > 1:
            return CallPlan(self)
        return self.quant_method.kernel_plan(self, rows, dtype)

    def layouts(self) -> Layouts:
        """Every resident copy of its weights, by layout (quant/layouts.py)."""
        return self.quant_method.layouts(self)

    def shard_index(self, shard_id) -> int:
        if shard_id not in self.shard_ids:
            raise ValueError(f"{self.prefix or type(self).__name__} has no shard {shard_id!r} "
                             f"(shards: {', '.join(map(repr, self.shard_ids))})")
        return self.shard_ids.index(shard_id)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy checkpoint tensor `loaded` (the whole, unsharded tensor of one shard) into this
        rank's part of `param`. Parameters may be packed along a dimension (`packed_dim`,
        `packed_factor`: several values per element), so offsets along it shrink by the factor."""
        dest, index = param.data, self.shard_index(shard_id)
        full_shape = list(dest.shape)
        out_dim, in_dim = getattr(param, "output_dim", None), getattr(param, "input_dim", None)
        first = 0
        if out_dim is not None:
            pack = getattr(param, "packed_factor", 1) if getattr(param, "packed_dim", None) == out_dim else 1
            start, size = sum(self.output_sizes[:index]) // pack, self.output_sizes[index] // pack
            dest = dest.narrow(out_dim, start, size)
            full_shape = list(dest.shape)
            if self.tp_split == "output":
                full_rows, first = self.tp_shard_rows(index)
                full_shape[out_dim], first = full_rows // pack, first // pack
        if in_dim is not None and self.tp_split == "input":
            full_shape[in_dim] *= self.tp_size
        if list(loaded.shape) != full_shape:
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(full_shape)}")
        if out_dim is not None and self.tp_split == "output":
            loaded = loaded.narrow(out_dim, first, dest.shape[out_dim])
        if in_dim is not None and self.tp_split == "input":
            loaded = loaded.narrow(in_dim, self.tp_rank * dest.shape[in_dim], dest.shape[in_dim])
        copy_checked(dest, loaded)

    def tp_shard_rows(self, index: int) -> tuple[int, int]:
        """(rows of shard `index` in the checkpoint, the first of them this rank keeps): a
        column-parallel rank keeps an equal consecutive slice."""
        rows = self.output_sizes[index]
        return rows * self.tp_size, rows * self.tp_rank


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(input_size, [output_size], bias, quant_config, prefix)


class ColumnParallelLinear(LinearBase):
    """Each rank holds a slice of the output channels; its output is that slice."""

    tp_split = "output"

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", **tp) -> None:
        super().__init__(input_size, [output_size], bias, quant_config, prefix, **tp)


class MergedColumnParallelLinear(LinearBase):
    """Several projections of the same input run as one matmul (gate/up: shard ids 0, 1)."""

    tp_split = "output"

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", **tp) -> None:
        super().__init__(input_size, output_sizes, bias, quant_config, prefix,
                         shard_ids=tuple(range(len(output_sizes))), **tp)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """SiLU(gate) * up of a gate/up layer in one pass where its method has one for x, else None
        (`QuantMethod.silu_and_mul`)."""
        if not self._fusable():
            return None
        return self.quant_method.silu_and_mul(self, x)

    def silu_and_mul_plan(self, rows: int, dtype: torch.dtype) -> KernelPlan | None:
        """What `silu_and_mul` runs for x of `rows` rows of `dtype`, or None where it returns None."""
        return self.quant_method.silu_and_mul_plan(self, rows, dtype) if self._fusable() else None

    def _fusable(self) -> bool:
        # hooks (calibration's) must see the layer's call
        return len(self.output_sizes) == 2 and self.bias is None and not (self._forward_pre_hooks or self._forward_hooks)


class QKVParallelLinear(LinearBase):
    """q, k and v as one matmul (shard ids "q", "k", "v"); a rank keeps whole heads of each: its
    share of the query heads, and its KV heads (with fewer KV heads than ranks, the one KV head
    its query heads read, which other ranks keep too). With no KV heads it is q alone (a layer
    that reads another layer's KV)."""

    tp_split = "output"

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", **tp) -> None:
        self.head_dim, self.num_kv_heads = head_dim, num_kv_heads
        self.heads = split_heads(num_heads, num_kv_heads, tensor_parallel_for(**tp), prefix or "qkv_proj")
        size = tensor_parallel_for(**tp).size
        # Sizes as if every rank kept an equal slice; the base class divides them by the ranks.
        sizes = [num_heads * head_dim] + [self.heads.num_kv_heads * head_dim * size] * (2 if num_kv_heads else 0)
        shard_ids = ("q", "k", "v") if num_kv_heads else ("q",)
        super().__init__(hidden_size, sizes, bias, quant_config, prefix, shard_ids=shard_ids, **tp)

    def tp_shard_rows(self, index: int) -> tuple[int, int]:
        if index == 0:
            return super().tp_shard_rows(index)
        return self.num_kv_heads * self.head_dim, self.heads.first_kv_head * self.head_dim


class RowParallelLinear(LinearBase):
    """Each rank holds a slice of the input channels; the ranks' partial outputs sum to y.
    `reduce_results=False` returns this rank's partial sum, for a caller that adds several such
    layers' outputs and reduces them once (a mixture of experts); such a layer has no bias."""

    tp_split = "input"

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", reduce_results: bool = True,
                 **tp) -> None:
        if bias and not reduce_results:
            raise ValueError(f"{prefix}: a bias must be added once, after the reduce: reduce_results=False takes none")
        super().__init__(input_size, [output_size], bias, quant_config, prefix, **tp)
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1 or not self.reduce_results:
            return super().forward(x)
        y = self.tp.all_reduce(self.quant_method.apply(self, x))
        return y if self.bias is None else y + self.bias


def tensor_parallel_for(tp_rank: int | None = None, tp_size: int | None = None) -> TensorParallel:
    """The group in scope, or rank `tp_rank` of `tp_size` with no group when they are given."""
    if tp_rank is None and tp_size is None:
        return current_tensor_parallel()
    return TensorParallel(tp_rank or 0, tp_size or 1)


def _divide(size: int, parts: int, prefix: str) -> int:
    if size % parts:
        raise ValueError(f"{prefix}: {size} channels do not split evenly over {parts} tensor-parallel ranks")
    return size // parts
