"""An adapter over a quantized base equals the same adapter over the dequantized base (PEFT on
float weights equal to the dequantized ones), within float32 rounding: LoRA wraps the layer,
whatever its quant method.

No quantization method had landed in main when this was written, so the base is quantized by a
small int8 method built here on the seam's `QuantMethod` interface (per-output-channel scales,
applied after the integer matmul as int8 kernels do). The dequantized base is read back from
the engine's own layers, so the same check holds for any weight-only method."""

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
        y = F.linear(x, layer.qweight.to(x.dtype)) * layer.scale  # scales after the integer matmul
        return y if bias is None else y + bias


class Int8Config(QuantizationConfig):
    name = "int8-test"

    def get_quant_method(self, kind, prefix):
        return Int8Method() if kind == "linear" else None


def dequantized_copy(hf, engine):
    """`hf` with every weight kvflow may have quantized replaced by the matrix kvflow's layer
    really applies (its output for the identity; the embedding's rows), whatever the method."""
    model, ours = copy.deepcopy(hf), engine.runner.model
    with torch.no_grad():
        for module, target in engine.lora.targets.items():
            lora = engine.lora.layers[target.layer]
            base = lora.base_layer
            applied = base.quant_method.apply(base, torch.eye(base.input_size)).t()  # [out, in], no bias
            first, width = lora.out_slices[target.slice]
            model.get_submodule(module).weight.copy_(applied[first:first + width])
        embed = ours.get_submodule("model.embed_tokens")
        model.get_input_embeddings().weight.copy_(embed.quant_method.embedding(embed, torch.arange(hf.config.vocab_size)))
        if not hf.config.tie_word_embeddings:
            head = ours.get_submodule("lm_head")
            model.get_output_embeddings().weight.copy_(head.quant_method.apply(head, torch.eye(head.input_size)).t())
    return model


def test_quantized_base_with_adapter_equals_dequantized_base_with_it(tmp_path, monkeypatch):
    from peft import PeftModel

    hf = make_tiny_model("qwen2-bias", tmp_path / "base")
    peft_float = make_adapter(hf, tmp_path / "adapter", seed=5, r=4, lora_alpha=8)
    monkeypatch.setattr(llm_engine, "build_model", lambda arch, backend, dtype, device, *_, **__:
                        build_model(arch, backend, dtype, device, quant_config=Int8Config()))
    llm = LLM(str(tmp_path / "base"), dtype="float32", skip_tokenizer_init=True, enable_lora=True,
              max_lora_rank=4, disable_log_stats=True)
    qkv = llm.llm_engine.runner.model.model.layers[0].self_attn.qkv_proj.base_layer
    assert qkv.qweight.dtype == torch.int8  # the adapter really runs over the quantized layer
    dequantized = dequantized_copy(hf, llm.llm_engine)
    oracle = PeftModel.from_pretrained(copy.deepcopy(dequantized), str(tmp_path / "adapter")).eval()

    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    prompts = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (30, 11)]
    outs = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=[lora, None])
    check_logprobs(outs[0], oracle)
    check_logprobs(outs[1], dequantized)
    # Not vacuous: quantization moved the logprobs well beyond the tolerance.
    sequence = outs[0].prompt_token_ids + outs[0].outputs[0].token_ids
    assert (logprobs(peft_float, sequence) - logprobs(oracle, sequence)).abs().max() > 1e-3
