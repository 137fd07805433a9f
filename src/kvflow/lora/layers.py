"""LoRA around the seam's linear layers, installed from outside the model.

`LoRALinear` wraps one `LinearBase` (whatever its quant method): y = base(x), then each row adds
its adapter's s·(x A^T) B^T. It holds `max_loras` slots of stacked adapter weights:

    lora_a [max_loras, num_slices * max_rank, in]    rows of slice i at i*max_rank
    lora_b [max_loras, num_slices * max_rank, out]   block-diagonal: rows of slice i feed only
                                                     slice i's output columns

A fused layer (q/k/v, gate/up) has one slice per projection, each with its own A and B; smaller
ranks and slices an adapter leaves alone are zeros, which add exactly nothing. Block-diagonal B
costs memory (num_slices times B's size) and a little arithmetic, and buys one matmul per slice
fewer per run of rows, the faster trade on this CPU at every shape measured.

Which slot each row uses is the step's `LoRABatch`, which the model never sees: a hook on the
model reads it from the step's attention metadata into the layers' shared `LoRAContext` before
each forward pass. On CUDA the deltas are `lora.triton_ops`' kernels, elsewhere the torch forms.

Under tensor parallel an adapter is sharded like the layer it wraps (as vLLM's and Punica's
sharding does). A column-parallel layer (q/k/v, gate/up) sees the whole input and makes a slice of
the output: A is whole on every rank, B keeps the rank's rows of each slice, and the delta is the
rank's slice of the output's. A row-parallel layer (o_proj, down_proj) sees a slice of the input
and its ranks' outputs are summed: A keeps the rank's columns, B is whole, and each rank adds its
partial delta (x_r A_r^T) B to its partial output before the layer's one all-reduce, whose sum is
the whole delta; no collective of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from kvflow.attention.metadata import AttentionMetadata
from kvflow.config import triton_installed
from kvflow.lora.batch import LoRABatch
from kvflow.lora.peft_adapter import LoRATarget
from kvflow.model.layers.embedding import VocabParallelEmbedding
from kvflow.model.layers.linear import LinearBase


def lora_kernels_for(x: torch.Tensor) -> Callable | None:
    """The Triton form of the delta (`lora.triton_ops.add_lora`) when x is on CUDA and triton
    is installed; None: the torch forms of `LoRABatch.add_lora`."""
    return _load_kernels() if x.is_cuda else None


@functools.cache
def _load_kernels() -> Callable | None:
    if not triton_installed():
        return None
    from kvflow.lora.triton_ops import add_lora

    return add_lora


class LoRAContext:
    """The LoRABatch of the forward pass in progress, for the LoRA layers of one model."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None

    def read_metadata(self, _model: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the model (with_kwargs=True): take the batch from the step's
        metadata (one per KV group, all carrying the same batch). A model called without metadata
        is a wiring error, never a step without LoRA."""
        found = (m for a in (*args, *kwargs.values()) for m in (a if isinstance(a, (tuple, list)) else (a,))
                 if isinstance(m, AttentionMetadata))
        meta = next(found, None)
        if meta is None:
            raise RuntimeError("LoRA layers are installed, but the model was called without AttentionMetadata")
        self.batch = meta.lora


class LoRALinear(nn.Module):
    def __init__(self, base_layer: LinearBase, max_loras: int, max_rank: int, context: LoRAContext,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.context = context  # shared, not a submodule
        self.max_rank = max_rank
        self.tp_split = base_layer.tp_split if base_layer.tp_size > 1 else None
        sizes = base_layer.output_sizes
        self.out_slices = [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]  # (first column, width)
        self.register_buffer("lora_a", torch.zeros(max_loras, len(sizes) * max_rank, base_layer.input_size,
                                                   dtype=dtype, device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, len(sizes) * max_rank, sum(sizes),
                                                   dtype=dtype, device=device), persistent=False)

    def __getattr__(self, name: str):
        """What the model reads off its layer (a router's score bias, sizes, weights) reads through
        to the wrapped layer: the wrapper is invisible but for the deltas it adds."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base_layer"), name)

    def silu_and_mul(self, x: torch.Tensor) -> None:
        return None  # the deltas go into gate/up before the activation: forward, then the MLP's act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = self.context.batch
        if self.tp_split == "input" and batch is not None:
            return self._row_parallel(x, batch)
        y = self.base_layer(x)
        if batch is not None:
            self._add_deltas(y, x, batch)
        return y

    def _row_parallel(self, x: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        """The rank's partial output and partial delta, summed over the ranks by one all-reduce."""
        base = self.base_layer
        y = base.quant_method.apply(base, x)
        self._add_deltas(y, x, batch)
        if not getattr(base, "reduce_results", True):  # a mixture's expert: its caller reduces the partial sums once
            return y
        y = base.tp.all_reduce(y)
        return y if base.bias is None else y + base.bias

    def _add_deltas(self, y: torch.Tensor, x: torch.Tensor, batch: LoRABatch) -> None:
        kernels = lora_kernels_for(x)
        if kernels is not None:
            kernels(y, x, self.lora_a, self.lora_b, batch, self.max_rank, self.out_slices)
        else:
            batch.add_lora(y, x, self.lora_a, self.lora_b)

    def set_slot(self, slot: int, slices: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill `slot` with an adapter's (A [r, in], B [out, r]) per slice; slices it does not
        adapt, and ranks below max_rank, are zeros (they add exactly nothing)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for index, (a, b) in slices.items():
            a, b = self._rank_part(index, a, b)
            first, width = self.out_slices[index]
            rows = slice(index * self.max_rank, index * self.max_rank + a.shape[0])
            self.lora_a[slot, rows].copy_(a, non_blocking=True)
            self.lora_b[slot, rows, first:first + width].copy_(b.t(), non_blocking=True)

    def _rank_part(self, index: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a slice's whole A [r, in] and B [out, r]: B's rows of the rank's
        output slice (column-parallel), or A's columns of its input slice (row-parallel)."""
        base = self.base_layer
        if self.tp_split == "output":
            _, first = base.tp_shard_rows(index)
            return a, b[first:first + base.output_sizes[index]]
        if self.tp_split == "input":
            width = base.input_size
            return a[:, base.tp_rank * width:(base.tp_rank + 1) * width], b
        return a, b


def install_lora_layers(model: nn.Module, max_loras: int, max_rank: int, context: LoRAContext,
                        dtype: torch.dtype, device) -> dict[str, LoRALinear]:
    """Wrap every seam linear layer of `model` that sees each token's row once, in place; returns
    them by layer prefix. Not wrapped: the embedding and LM head (PEFT adapts those differently),
    and the linears a module lists in `indirect_linears` (routed experts see a gathered subset of
    rows; MLA's kv_b_proj is read whole and absorbed): an adapter naming them is refused."""
    wrapped = {}
    skipped = {f"{name}.{child}".lstrip(".") for name, module in model.named_modules()
               for child in getattr(module, "indirect_linears", ())}
    for name, module in list(model.named_modules()):
        if any(name == s or name.startswith(s + ".") for s in skipped):
            continue
        for child_name, child in list(module.named_children()):
            if f"{name}.{child_name}".lstrip(".") in skipped:
                continue
            if isinstance(child, LinearBase) and not isinstance(child, VocabParallelEmbedding):
                lora = LoRALinear(child, max_loras, max_rank, context, dtype, torch.device(device))
                setattr(module, child_name, lora)
                wrapped[child.prefix or f"{name}.{child_name}".lstrip(".")] = lora
    return wrapped


def lora_targets(layers: dict[str, LoRALinear], stacked_params: dict[str, tuple[str, object]]) -> dict[str, LoRATarget]:
    """Base-model module name → target. A fused layer answers to the checkpoint names it was
    loaded from (`stacked_params`, e.g. q_proj → (qkv_proj, "q")); any other to its own name."""
    targets = {}
    for prefix, lora in layers.items():
        base = lora.base_layer
        parent, _, own = prefix.rpartition(".")
        for part, (fused, shard_id) in stacked_params.items():
            if fused == own and shard_id in base.shard_ids:
                index = base.shard_index(shard_id)
                targets[f"{parent}.{part}"] = LoRATarget(prefix, index, *_whole_sizes(base, index))
        if base.shard_ids == (None,):
            targets[prefix] = LoRATarget(prefix, 0, *_whole_sizes(base, 0))
    return targets


def _whole_sizes(base: LinearBase, index: int) -> tuple[int, int]:
    """(in, out) features of slice `index` as the checkpoint has them, whatever this rank keeps."""
    if base.tp_size == 1 or base.tp_split is None:
        return base.input_size, base.output_sizes[index]
    if base.tp_split == "input":
        return base.input_size * base.tp_size, base.output_sizes[index]
    return base.input_size, base.tp_shard_rows(index)[0]
