"""An adapter over a quantized base equals the same adapter over the dequantized base (PEFT on
float weights equal to the dequantized ones): LoRA wraps the seam's layer, whatever its quant
method. Checked with int8 and int4 applied at load on a tiny model, and with the default model's
GGUF run natively (its Q4_1 blocks as int4 planes). The dequantized base is read back from the
engine's own layers, so the same check holds for any weight-only method."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_oracle import default_gguf_path, default_model_hf_dir
from peft_adapters import check_logprobs, logprobs, make_adapter
from tiny_models import make_tiny_model

from kvflow import LLM, LoRARequest, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=10, logprobs=0, prompt_logprobs=0, ignore_eos=True)


def dequantized_copy(hf, engine):
    """`hf` with every weight kvflow may have quantized replaced by the matrix kvflow's layer
    really applies (its output for the identity; the embedding's rows), whatever the method."""
    model, ours = copy.deepcopy(hf), engine.runner.model
    with torch.no_grad():
        applied_by_layer = {}
        for module, target in engine.runner.lora.targets.items():
            lora = engine.runner.lora.layers[target.layer]
            base = lora.base_layer
            if target.layer not in applied_by_layer:  # [out, in], no bias
                applied_by_layer[target.layer] = base.quant_method.apply(base, torch.eye(base.input_size)).t()
            applied = applied_by_layer[target.layer]
            first, width = lora.out_slices[target.slice]
            model.get_submodule(module).weight.copy_(applied[first:first + width])
        embed = ours.get_submodule("model.embed_tokens")
        model.get_input_embeddings().weight.copy_(embed.quant_method.embedding(embed, torch.arange(hf.config.vocab_size)))
        if not hf.config.tie_word_embeddings:
            head = ours.get_submodule("lm_head")
            model.get_output_embeddings().weight.copy_(head.quant_method.apply(head, torch.eye(head.input_size)).t())
    return model


@pytest.mark.parametrize("method, group", [("int8", None), ("int4", 32)])
def test_quantized_base_with_adapter_equals_dequantized_base_with_it(tmp_path, method, group):
    from peft import PeftModel

    hf = make_tiny_model("qwen2-bias", tmp_path / "base")
    peft_float = make_adapter(hf, tmp_path / "adapter", seed=5, r=4, lora_alpha=8)
    llm = LLM(str(tmp_path / "base"), dtype="float32", skip_tokenizer_init=True, enable_lora=True,
              max_lora_rank=4, quantization=method, group_size=group, disable_log_stats=True)
    qkv = llm.llm_engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert type(qkv.quant_method).__module__ == f"kvflow.quant.{method}"  # really over the quantized layer
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


def test_gguf_native_base_with_adapter(tmp_path):
    """The default model's GGUF as stored (Q4_1 blocks as int4 planes), an adapter on all seven
    projections. The oracle is transformers' own float model of that GGUF: its weights are the
    blocks decoded as gguf-py decodes them, which is what the native layers multiply by
    (tests/quant/test_gguf_native.py). The int4 kernel rounds differently from a dense matmul,
    over 30 layers: 1e-3."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model_hf_dir(), dtype=torch.float32).eval()
    oracle = make_adapter(hf, tmp_path / "adapter", seed=3, r=4, lora_alpha=8)
    llm = LLM(str(default_gguf_path()), dtype="float32", skip_tokenizer_init=True, enable_lora=True, max_lora_rank=4,
              max_model_len=64, num_kv_blocks=64, disable_log_stats=True)
    qkv = llm.llm_engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert type(qkv.quant_method).__module__ == "kvflow.quant.gguf"
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    prompts = [[1, 504, 3458, 282, 4649, 314, 2, 88, 1003, 19, 77, 4002], [1, 9906, 30, 12]]
    adapter = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=[adapter, None])
    check_logprobs(outs[0], oracle, atol=1e-3)
    check_logprobs(outs[1], hf, atol=1e-3)
