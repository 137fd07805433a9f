"""AWQ's calibration: one float pass over calibration text records each linear layer's input
activations, a grid search picks each layer's exponent α, the scales are folded into the ops that
feed the layers, and only then is every layer rounded to int4.

The model is walked by the llama family's module names (decoder layers with `input_layernorm`,
`self_attn.qkv_proj`, `mlp.gate_up_proj`, ...), as AutoAWQ walks each architecture it knows."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvflow.quant.awq import ALPHAS, CALIBRATION_ROWS, AWQMethod
from kvflow.quant.formats import int4_per_group


class _InputRecorder:
    """Mean |x| per input channel over every calibration row, and a sample of rows."""

    def __init__(self, generator: torch.Generator) -> None:
        self.abs_sum, self.count, self.rows, self.gen = None, 0, [], generator

    def __call__(self, module, args) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        self.abs_sum = x.abs().sum(0) if self.abs_sum is None else self.abs_sum + x.abs().sum(0)
        self.count += x.shape[0]
        keep = torch.randperm(x.shape[0], generator=self.gen)[:CALIBRATION_ROWS]
        self.rows.append(x[keep])

    def sample(self) -> torch.Tensor:
        rows = torch.cat(self.rows)
        return rows[torch.randperm(rows.shape[0], generator=self.gen)[:CALIBRATION_ROWS]]


def calibrate_and_quantize(model: nn.Module, run_prompts: Callable[[list[list[int]]], None],
                           windows: list[list[int]], seed: int = 0) -> dict[str, float]:
    """Run `windows` through the float model, search and fold the scales, quantize every AWQ layer.
    Returns the chosen α per layer (for reports)."""
    gen = torch.Generator().manual_seed(seed)
    layers = {name: m for name, m in model.named_modules() if isinstance(getattr(m, "quant_method", None), AWQMethod)}
    recorders = {name: _InputRecorder(gen) for name in layers}
    hooks = [m.register_forward_pre_hook(recorders[name]) for name, m in layers.items()]
    try:
        run_prompts(windows)
    finally:
        for h in hooks:
            h.remove()
    chosen = {}
    with torch.no_grad():
        for name, prev, linear in _scaling_pairs(model):
            rec = recorders[name]
            scale, chosen[name] = search_scale(linear.weight.data.float(), rec.abs_sum / rec.count, rec.sample(),
                                               linear.quant_method.config.group_size, name)
            linear.weight.data.mul_(scale.to(linear.weight.dtype))
            prev(1 / scale)
        for layer in layers.values():
            layer.awq_ready = True
            layer.quant_method.process_weights_after_loading(layer)
    return chosen


def search_scale(weight: torch.Tensor, x_mean: torch.Tensor, x: torch.Tensor, group: int,
                 name: str) -> tuple[torch.Tensor, float]:
    """The per-input-channel scale s = x_mean^α (normalised), α from `ALPHAS`, that minimises
    ‖x·Wᵀ − x·(Q(W·s)/s)ᵀ‖ for round-to-nearest int4 Q with `group` channels per scale."""
    reference = x @ weight.t()
    best = (float("inf"), None, 0.0)
    for alpha in ALPHAS:
        s = x_mean.clamp(min=1e-4).pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        u, scale, minimum = int4_per_group(weight * s, group, name)
        n, k = weight.shape
        dq = (u.view(n, k // group, group).float() * scale[..., None] + minimum[..., None]).view(n, k) / s
        err = (x @ dq.t() - reference).pow(2).mean().item()
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


def _scaling_pairs(model: nn.Module):
    """(name of the linear, a function that divides its input by s at the source, the linear)."""
    for prefix, block in model.named_modules():
        if not (hasattr(block, "input_layernorm") and hasattr(block, "self_attn") and hasattr(block, "mlp")):
            continue
        attn, mlp = block.self_attn, block.mlp
        yield f"{prefix}.self_attn.qkv_proj", _scale_param(block.input_layernorm.weight), attn.qkv_proj
        yield f"{prefix}.mlp.gate_up_proj", _scale_param(block.post_attention_layernorm.weight), mlp.gate_up_proj
        inter = mlp.gate_up_proj.output_sizes[0]
        yield f"{prefix}.mlp.down_proj", _scale_rows(mlp.gate_up_proj.weight, inter, inter), mlp.down_proj
        q, kv, _ = attn.qkv_proj.output_sizes
        if q == kv:  # one value head per query head: o_proj's inputs are v's outputs
            yield f"{prefix}.self_attn.o_proj", _scale_rows(attn.qkv_proj.weight, q + kv, kv), attn.o_proj


def _scale_param(param: torch.Tensor):
    return lambda factor: param.data.mul_(factor.to(param.dtype))


def _scale_rows(weight: torch.Tensor, start: int, length: int):
    return lambda factor: weight.data[start:start + length].mul_(factor.to(weight.dtype)[:, None])
