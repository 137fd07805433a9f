"""QuaRot-style rotations (Ashkboos et al., 2024) of a loaded float Llama-family model, so that
weights and activations round to 4 bits with their outliers spread (quant/w4a.py).

The residual stream h becomes h·R, R = diag(s)·H (random signs s, H orthogonal: quant/hadamard.py),
and the model computes the same function:

- RMSNorm(h·R) = RMSNorm(h)·R once the norm has no scale (an orthogonal R keeps the mean square),
  so each norm's scale g is folded first into the layers it feeds (W·diag(g)) and set to 1;
- layers that read the stream (q/k/v, gate/up, the LM head) take W·diag(g)·R: (x·R)·(W·R)ᵀ = x·Wᵀ;
- layers that write it (o_proj, down_proj) and the embedding rows take Rᵀ·W and E·R (a bias b·R);
- each value head's rows take H_dᵀ (v ↦ v·H_d) and o_proj's columns of each head H_d: attention
  mixes values across positions only, so o_proj's inputs arrive rotated and spread too (a layer
  that reads another layer's KV gets that layer's rotated values: every layer uses the same H_d);
- down_proj's input (SiLU(gate)·up: not linear in anything earlier) is rotated at run time,
  x ↦ x·H_I (`OnlineHadamardMethod`), and its columns take H_I to cancel it.

A tied LM head is untied: the embedding wants E·R, the head E·diag(g_final)·R, and g_final is not
uniform (the head's float copy is vocabulary × hidden more memory; the w4a methods keep both float).
Refused, naming what: families other than Llama's dense decoder (Gemma's norms, experts, latent
attention), and pipeline stages (a stage lacks the embedding or the head the rotation must reach).
Under tensor parallelism each rank rotates its own slices, down_proj's input over its own shard
(block-diagonal overall: still orthogonal).
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from kvflow.model.layers.mlp import GatedMLP
from kvflow.model.layers.norm import RMSNorm
from kvflow.model.models.blocks import DecoderLayer, RopeAttention
from kvflow.quant.hadamard import HadamardTransform
from kvflow.quant.kernel_plan import CallPlan, KernelPlan


class OnlineHadamardMethod:
    """A layer's quant method whose input is rotated first (x·H), its weight having taken W·H;
    everything else is delegated to the method it wraps."""

    def __init__(self, method, transform: HadamardTransform) -> None:
        self.method = method
        self.transform = transform

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.method.apply(layer, self.transform(x), bias)

    def silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> None:
        return None  # a rotated input is down_proj's, never a gate/up pair's

    def kernel_plan(self, layer: nn.Module, rows: int, dtype: torch.dtype) -> KernelPlan:
        return CallPlan(functools.partial(self.apply, layer))  # the rotation, then the method's product

    def silu_and_mul_plan(self, layer: nn.Module, rows: int, dtype: torch.dtype) -> None:
        return None

    def __getattr__(self, name: str):
        if name == "method":  # not set yet (a copy being built): no endless lookup through itself
            raise AttributeError(name)
        return getattr(self.method, name)


class _ResidualRotation:
    """R = diag(s)·H over the hidden size, applied to weights (in float32, rounded once)."""

    def __init__(self, size: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.signs = torch.randint(0, 2, (size,), generator=gen).float() * 2 - 1
        self.transform = HadamardTransform(size, seed)

    def reading(self, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """W·diag(scale)·R for a layer [N, hidden] that reads the stream."""
        w = weight.float() if scale is None else weight.float() * scale.float()
        return self.transform(w * self.signs)

    def writing(self, weight: torch.Tensor) -> torch.Tensor:
        """Rᵀ·W for a layer [hidden, K] that writes it (as (Wᵀ·R)ᵀ); a bias [hidden] as b·R."""
        if weight.dim() == 1:
            return self.transform(weight.float() * self.signs)
        return self.transform(weight.float().t() * self.signs).t()


def _assign(param: torch.Tensor, value: torch.Tensor) -> None:
    param.data.copy_(value.to(param.dtype))


def check_rotatable(model: nn.Module) -> None:
    """Raise, naming what, unless `model` is a whole Llama-family dense decoder the rotation reaches."""
    decoder = getattr(model, "model", None)
    name = type(model).__name__
    layers = getattr(decoder, "layers", None)
    if layers is None or not all(hasattr(decoder, part) for part in ("embed_tokens", "norm")):
        raise ValueError(f"rotation (w4a8/w4a4): {name} is not a decoder with an embedding, layers and a final norm")
    for i, layer in enumerate(layers):
        if type(layer) is not DecoderLayer:
            raise ValueError(f"rotation (w4a8/w4a4): {name}'s layer {i} is a {type(layer).__name__}, not a dense "
                             "Llama-family decoder layer (a pipeline stage's absent layer, Gemma's norms, or the "
                             "like); run it with --quantization int4 or w8a8, or on one pipeline stage")
        parts = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(norm) is not RMSNorm for norm in parts) or type(layer.self_attn) is not RopeAttention \
                or type(layer.mlp) is not GatedMLP:
            raise ValueError(f"rotation (w4a8/w4a4): {name}'s layer {i} has other norms, attention or MLP than "
                             "Llama's (RMSNorm, RoPE attention, gated MLP); run it with --quantization int4 or w8a8")
    if type(decoder.norm) is not RMSNorm or not hasattr(getattr(model, "lm_head", None), "compute_logits"):
        raise ValueError(f"rotation (w4a8/w4a4): {name} holds no plain final RMSNorm and LM head "
                         "(a pipeline stage?); run it on one pipeline stage")


def rotate_model(model: nn.Module, seed: int = 0) -> None:
    """In place, before any layer is rounded: the rotations of the module's doc (`seed` draws R's
    signs). The rotated float model's logits equal the original's up to float rounding."""
    check_rotatable(model)
    decoder = model.model
    embedding = decoder.embed_tokens
    if model.lm_head is embedding:
        model.lm_head = copy.deepcopy(embedding)  # untied: a float copy the head's rotation can differ in
    residual = _ResidualRotation(embedding.weight.shape[1], seed)
    with torch.no_grad():
        _assign(embedding.weight, residual.reading(embedding.weight))  # E·R: rows are stream vectors
        _assign(model.lm_head.weight, residual.reading(model.lm_head.weight, decoder.norm.weight))
        decoder.norm.weight.fill_(1)
        head_dim = decoder.layers[0].self_attn.attn.spec.head_dim
        per_head = HadamardTransform(head_dim, seed)
        for layer in decoder.layers:
            _rotate_attention(layer, residual, per_head)
            _rotate_mlp(layer, residual, seed)


def _rotate_attention(layer: nn.Module, residual: _ResidualRotation, per_head: HadamardTransform) -> None:
    attn = layer.self_attn
    qkv, o_proj, d = attn.qkv_proj, attn.o_proj, per_head.size
    weight = residual.reading(qkv.weight, layer.input_layernorm.weight)
    q, k, v = attn.sizes
    if v:  # v ↦ v·H_d per head: rows H_dᵀ·W_v, computed as (W_vᵀ·H_d)ᵀ head by head
        w_v = weight[q + k:].reshape(v // d, d, -1)
        weight[q + k:] = per_head(w_v.transpose(1, 2)).transpose(1, 2).reshape(v, -1)
        if qkv.bias is not None:
            _assign(qkv.bias[q + k:], per_head(qkv.bias[q + k:].float().reshape(-1, d)).reshape(-1))
    _assign(qkv.weight, weight)
    layer.input_layernorm.weight.fill_(1)
    w_o = residual.writing(o_proj.weight)
    _assign(o_proj.weight, per_head(w_o.reshape(w_o.shape[0], -1, d)).reshape(w_o.shape))
    if o_proj.bias is not None:
        _assign(o_proj.bias, residual.writing(o_proj.bias))


def _rotate_mlp(layer: nn.Module, residual: _ResidualRotation, seed: int) -> None:
    mlp = layer.mlp
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    _assign(gate_up.weight, residual.reading(gate_up.weight, layer.post_attention_layernorm.weight))
    layer.post_attention_layernorm.weight.fill_(1)
    online = HadamardTransform(down.weight.shape[1], seed)  # this rank's share of the intermediate channels
    _assign(down.weight, residual.writing(online(down.weight.float())))
    if down.bias is not None:
        _assign(down.bias, residual.writing(down.bias))
    down.quant_method = OnlineHadamardMethod(down.quant_method, online)
