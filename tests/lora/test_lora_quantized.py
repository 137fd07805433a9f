"""An adapter over a quantized base equals the same adapter over the dequantized base (PEFT on
float weights equal to the dequantized ones), within float32 rounding: LoRA wraps the layer,
whatever its quant method.

No quantization method had landed in main when this was written, so the base is quantized by a
small int8 method built here on the seam's `QuantMethod` interface (per-output-channel scales,
applied after the integer matmul as int8 kernels do)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kvflow.engine.llm_engine as llm_engine
from kvflow import LLM, LoRARequest, SamplingParams
from kvflow.model.registry import build_model
from kvflow.quant.base import QuantizationConfig, QuantMethod, set_weight_attrs
from peft_adapters import check_logprobs, logprobs, make_adapter
from tiny_models import make_tiny_model

PARAMS = SamplingParams(temperature=0, max_tokens=10, logprobs=0, prompt_logprobs=0, ignore_eos=True)


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale


class Int8Method(QuantMethod):
    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        w = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype), requires_grad=False)
        layer.register_parameter("weight", set_weight_attrs(w, output_dim=0, input_dim=1, weight_loader=layer.weight_loader))

    def process_weights_after_loading(self, layer):
        q, scale = int8_rows(layer.weight.data)
        del layer.weight
        layer.register_buffer("qweight", q)
        layer.register_buffer("scale", scale.t().contiguous())  # [1, out]

    def apply(self, layer, x, bias=None):
        y = F.linear(x, layer.qweight.to(x.dtype)) * layer.scale
        return y if bias is None else y + bias


class Int8Config(QuantizationConfig):
    name = "int8-test"

    def get_quant_method(self, kind, prefix):
        return Int8Method() if kind == "linear" else None


def test_quantized_base_with_adapter_equals_dequantized_base_with_it(tmp_path, monkeypatch):
    hf = make_tiny_model("qwen2-bias", tmp_path / "base")
    dequantized = copy.deepcopy(hf)
    with torch.no_grad():
        for name, module in dequantized.named_modules():
            if isinstance(module, nn.Linear) and name != "lm_head":
                q, scale = int8_rows(module.weight)
                module.weight.copy_(q.float() * scale)
    peft_dequantized = make_adapter(dequantized, tmp_path / "adapter", seed=5, r=4, lora_alpha=8)
    peft_float = make_adapter(hf, tmp_path / "same-adapter", seed=5, r=4, lora_alpha=8)

    monkeypatch.setattr(llm_engine, "build_model", lambda *a, **k: build_model(*a, **k, quant_config=Int8Config()))
    llm = LLM(str(tmp_path / "base"), dtype="float32", skip_tokenizer_init=True, enable_lora=True,
              max_lora_rank=4, disable_log_stats=True)
    qkv = llm.llm_engine.runner.model.model.layers[0].self_attn.qkv_proj.base_layer
    assert qkv.qweight.dtype == torch.int8  # the adapter really runs over the quantized layer

    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    prompts = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (30, 11)]
    outs = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=[lora, None])
    check_logprobs(outs[0], peft_dequantized)
    check_logprobs(outs[1], dequantized)
    # Not vacuous: quantization moved the logprobs well beyond the tolerance.
    sequence = outs[0].prompt_token_ids + outs[0].outputs[0].token_ids
    assert (logprobs(peft_float, sequence) - logprobs(peft_dequantized, sequence)).abs().max() > 1e-3
