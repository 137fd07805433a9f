"""The seam between layers and quantization.

A layer (linear, embedding, LM head) knows its shape and where each checkpoint tensor goes; its
`QuantMethod` decides what its parameters are and how it multiplies by them. So a model is written
once and runs float, int8, int4 or GGUF blocks alike. This module must not import `kvflow.model`:
layers call down into it, never the other way.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod

import torch
from torch import nn

from kvflow.quant.kernel_plan import CallPlan, KernelPlan
from kvflow.quant.layouts import WEIGHTS, Layouts


class QuantMethod(ABC):
    """How one layer stores and applies its weight W [output_size, input_size].

    `create_weights` registers the layer's parameters (each with a `weight_loader` and the
    attributes the layer's loader reads: `output_dim`, `input_dim`); the checkpoint fills them;
    `process_weights_after_loading` turns them into the form `apply` runs fastest (quantizing a
    float checkpoint, repacking for a kernel)."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None: ...

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        return None

    def finish_loading(self) -> None:
        """Called once every layer is processed (e.g. to store what processing computed)."""
        return None

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T (+ bias) for x [T, input_size]."""

    def silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """SiLU(x W_gate^T) * (x W_up^T) for a [gate; up] layer, in one pass where the method has
        one for this x (packed bf16 weights on CPU: `packed_linear.GatedPair`); None: the caller
        runs `apply` and the activation."""
        return None

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W, in the model dtype (only for methods an embedding can use)."""
        raise NotImplementedError(f"{type(self).__name__} cannot serve as an embedding")

    def kernel_plan(self, layer: nn.Module, rows: int, dtype: torch.dtype) -> KernelPlan:
        """What `apply` (without a bias) runs for x of `rows` rows of `dtype` (quant/kernel_plan.py);
        by default "call me"."""
        return CallPlan(functools.partial(self.apply, layer))

    def silu_and_mul_plan(self, layer: nn.Module, rows: int, dtype: torch.dtype) -> KernelPlan | None:
        """What `silu_and_mul` runs for such x, or None where it returns None (the caller then runs
        the plain product and the activation)."""
        return None

    def layouts(self, layer: nn.Module) -> Layouts:
        """Every resident copy of the layer's weights by layout (quant/layouts.py); by default its own
        parameters and buffers, as loaded."""
        return {WEIGHTS: [*layer.parameters(recurse=False), *layer.buffers(recurse=False)]}


class WeightsModule(nn.Module):
    """A layer's weights in one form, where a quant method forwards its products (an online
    method's runtime, a GGUF part): `forward` multiplies, `kernel_plan` says what it runs at a row
    count (by default "call me"), `layouts` reports its resident copies (by default its buffers)."""

    def kernel_plan(self, rows: int, dtype: torch.dtype) -> KernelPlan:
        return CallPlan(self.forward)

    def silu_and_mul_plan(self, rows: int, dtype: torch.dtype) -> KernelPlan | None:
        return None

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """SiLU(gate) · up of a [gate; up] weight in one pass where this form has one; None: the caller
        runs `forward` and the activation."""
        return None

    def layouts(self) -> Layouts:
        return {WEIGHTS: list(self.buffers())}


class QuantizationConfig(ABC):
    """Which method each layer gets; `kind` is "linear" or "embedding" (the LM head counts as an
    embedding: it is the same matrix, tied or not). None means: leave this layer unquantized."""

    name: str

    @abstractmethod
    def get_quant_method(self, kind: str, prefix: str) -> QuantMethod | None: ...

    def prepare_model(self, model: nn.Module) -> None:
        """A pass over the whole loaded float model before any layer is rounded (w4a8 and w4a4
        rotate it: quant/rotation.py); most methods need none."""
        return None


def set_weight_attrs(param: nn.Parameter, **attrs) -> nn.Parameter:
    for key, value in attrs.items():
        setattr(param, key, value)
    return param


def copy_checked(dest: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a checkpoint tensor into (a slice of) a parameter; a wrong shape is an error that the
    loader prefixes with the tensor's name."""
    if dest.shape != src.shape:
        raise ValueError(f"has shape {tuple(src.shape)}, expected {tuple(dest.shape)}")
    with torch.no_grad():
        dest.copy_(src)
