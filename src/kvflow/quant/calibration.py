"""Calibration, shared by AWQ, w8a8 (SmoothQuant) and fp8 (GPTQ): one float pass over
calibration text records each linear layer's input activations. AWQ's and w8a8's methods then
search a per-input-channel scale s, which is folded into the ops that feed the layers (W·x =
(W·diag(s)) · (x / s): the model's function is unchanged); only then is every layer rounded, fp8's
with the second moment of its inputs (quant/gptq.py).

The model is walked by the llama family's module names (decoder layers with `input_layernorm`,
`self_attn.qkv_proj`, `mlp.gate_up_proj`, ...), as AutoAWQ walks each architecture it knows.
Folds: input_layernorm → qkv_proj, post_attention_layernorm (Gemma: pre_feedforward_layernorm)
→ gate_up_proj, the up rows of gate_up_proj → down_proj, and the v rows of qkv_proj → o_proj when
every query head has its own value head (with grouped heads one v channel feeds several o_proj
inputs, which could not take different scales). fp8's second moments take ~400 MB on SmolLM2-135M
(float32, every layer's at once)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kvflow.phases import progress
from kvflow.quant.online import CalibratedMethod

ALPHAS = [i / 10 for i in range(11)]
CALIBRATION_ROWS = 512  # activation rows kept per layer for the search


@dataclass
class InputStats:
    """What calibration saw at one layer's input, per input channel."""

    abs_mean: torch.Tensor  # [K] mean |x| over every row
    sample: torch.Tensor  # [≤ CALIBRATION_ROWS, K] rows to measure a choice's output error on
    gram: torch.Tensor | None = None  # [K, K] mean x xᵀ over every row, where the method asks for it


class _InputRecorder:
    def __init__(self, generator: torch.Generator, gram: bool) -> None:
        self.abs_sum, self.count, self.rows, self.gen = None, 0, [], generator
        self.wants_gram, self.gram = gram, None

    def __call__(self, module, args) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        self.abs_sum = x.abs().sum(0) if self.abs_sum is None else self.abs_sum + x.abs().sum(0)
        self.count += x.shape[0]
        keep = torch.randperm(x.shape[0], generator=self.gen)[:CALIBRATION_ROWS]
        self.rows.append(x[keep])
        if self.wants_gram:
            self.gram = x.t() @ x if self.gram is None else self.gram.addmm_(x.t(), x)

    def stats(self) -> InputStats:
        rows = torch.cat(self.rows)
        sample = rows[torch.randperm(rows.shape[0], generator=self.gen)[:CALIBRATION_ROWS]]
        return InputStats(self.abs_sum / self.count, sample, None if self.gram is None else self.gram / self.count)


def calibrate_and_quantize(model: nn.Module, run_prompts: Callable[[list[list[int]]], None],
                           windows: list[list[int]], seed: int = 0) -> dict[str, float]:
    """Run `windows` through the float model, search and fold the scales, quantize every layer
    whose method calibrates. Returns each searched layer's choice (an exponent α, for reports)."""
    gen = torch.Generator().manual_seed(seed)
    layers = {name: m for name, m in model.named_modules()
              if isinstance(getattr(m, "quant_method", None), CalibratedMethod)}
    recorders = {name: _InputRecorder(gen, m.quant_method.wants_gram) for name, m in layers.items()}
    hooks = [m.register_forward_pre_hook(recorders[name]) for name, m in layers.items()]
    try:
        run_prompts(windows)
    finally:
        for h in hooks:
            h.remove()
    stats = {name: recorder.stats() for name, recorder in recorders.items()}
    chosen = {}
    with torch.no_grad():
        pairs = [p for p in _scaling_pairs(model) if p[0] in layers and p[2].quant_method.folds_scale]
        # Backwards: o_proj's and down_proj's folds rescale rows of qkv_proj and gate_up_proj, which
        # come before them in a block; searched after those folds, each layer's search scores the
        # weight it will store.
        pairs.reverse()
        for done, (name, prev, linear) in enumerate(pairs, 1):
            scale, chosen[name] = linear.quant_method.search_scale(linear.weight.data, stats[name], name)
            linear.weight.data.mul_(scale.to(linear.weight.dtype))
            prev(1 / scale)
            progress(done, len(pairs), "layers' scales searched")
        for done, (name, layer) in enumerate(layers.items(), 1):
            layer.quant_method.finish_calibration(layer, stats[name])
            progress(done, len(layers), "layers quantized")
    return chosen


def _scaling_pairs(model: nn.Module):
    """(name of the linear, a function that divides its input by s at the source, the linear).
    Layers of other shapes (latent attention, expert MLPs) are rounded unscaled."""
    for prefix, block in model.named_modules():
        if not (hasattr(block, "input_layernorm") and hasattr(block, "self_attn") and hasattr(block, "mlp")):
            continue
        attn, mlp = block.self_attn, block.mlp
        # Gemma norms the attention's output (post_attention_layernorm) and then the MLP's input
        mlp_norm = block.pre_feedforward_layernorm if hasattr(block, "pre_feedforward_layernorm") \
            else block.post_attention_layernorm
        if hasattr(attn, "qkv_proj"):
            yield f"{prefix}.self_attn.qkv_proj", _scale_param(block.input_layernorm.weight), attn.qkv_proj
            q, kv, _ = attn.qkv_proj.output_sizes
            if q == kv:  # one value head per query head: o_proj's inputs are v's outputs
                yield f"{prefix}.self_attn.o_proj", _scale_rows(attn.qkv_proj.weight, q + kv, kv), attn.o_proj
        if hasattr(mlp, "gate_up_proj"):
            yield f"{prefix}.mlp.gate_up_proj", _scale_param(mlp_norm.weight), mlp.gate_up_proj
            inter = mlp.gate_up_proj.output_sizes[0]
            yield f"{prefix}.mlp.down_proj", _scale_rows(mlp.gate_up_proj.weight, inter, inter), mlp.down_proj


def _scale_param(param: torch.Tensor):
    return lambda factor: param.data.mul_(factor.to(param.dtype))


def _scale_rows(weight: torch.Tensor, start: int, length: int):
    return lambda factor: weight.data[start:start + length].mul_(factor.to(weight.dtype)[:, None])
