"""act(gate) * up, on the fused [.., 2 * intermediate] output of the gate/up projection: SiLU
(Llama, Qwen, Mixtral, DeepSeek) or tanh-approximated GeLU (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.model.layers.triton_ops import kernels_for


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    kernels = kernels_for(gate_up)
    return kernels.silu_and_mul(gate_up) if kernels is not None else torch_silu_and_mul(gate_up)


def torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The torch code, and the reference the kernel is tested against."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul, "gelu_tanh": gelu_tanh_and_mul}
