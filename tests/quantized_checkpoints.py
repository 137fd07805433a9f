"""Tiny quantized checkpoints in other tools' formats (GPTQ, compressed-tensors), written at test time
from a tiny float model, and their comparison with transformers running the same dequantized weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model

from kvflow import LLM, SamplingParams
from kvflow.quant.int4pack import pack

PROMPT = [3, 17, 42, 8, 61, 5, 29, 77, 12, 40, 2, 33]
STEPS = 8
NEAR_TIE = 0.25  # nats: bfloat16 moves this tiny model's logprobs by up to ~0.17 unquantized (a wrong convention: 8+)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# a float weight [N, K] → (the layer's stored tensors by suffix, the weight they hold [N, K])
LayerWriter = Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def pack_int32(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Non-negative ints → int32, 32/bits consecutive values along `dim` per element, the first in the
    lowest bits (`order`: which of them each slot holds, for wrong-bit-order checkpoints)."""
    v = values.movedim(dim, -1)  # [R, C], packed along C
    if order is not None:
        v = v.reshape(v.shape[0], -1, 32 // bits)[..., order].flatten(1)
    return pack(v, bits).movedim(-1, dim).contiguous()

def write_quantized(tmp_path: Path, model: str, layer: LayerWriter, quant_config: dict):
    """The checkpoint directory (every projection written by `layer`, the rest as the float model has
    it) and the HF float32 model holding the dequantized weights."""
    hf = make_tiny_model(model, tmp_path / "float")
    out = tmp_path / "quantized"
    out.mkdir()
    tensors = {}
    for name, t in load_file(str(tmp_path / "float" / "model.safetensors")).items():
        if name.rsplit(".", 2)[-2] in PROJECTIONS and name.endswith(".weight"):
            stored, dequantized = layer(t.float())
            tensors |= {name.replace(".weight", f".{key}"): v for key, v in stored.items()}
            hf.get_parameter(name).data.copy_(dequantized)
        else:
            tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    config["quantization_config"] = quant_config
    (out / "config.json").write_text(json.dumps(config))
    return out, hf


def run(path, dtype: str, **kw):
    llm = LLM(str(path), dtype=dtype, skip_tokenizer_init=True, disable_log_stats=True, **kw)
    params = SamplingParams(temperature=0, max_tokens=STEPS, prompt_logprobs=0, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]


def _hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def logprob_error(path, hf) -> float:
    """Largest |kvflow − HF| over the prompt's logprobs, kvflow in float32."""
    out = run(path, "float32")
    ours = torch.tensor([out.prompt_logprobs[p][PROMPT[p]].logprob for p in range(1, len(PROMPT))])
    ref = _hf_logprobs(hf, PROMPT)[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    return (ours - ref).abs().max().item()


def greedy_shortfall(path, hf) -> float:
    """kvflow's greedy tokens in bfloat16 (int4's kernel, the production path), each scored by HF on
    kvflow's own sequence: the largest gap between HF's best logprob and the token's. 0 where every
    token is HF's argmax; bfloat16 may only swap near-ties (a tiny random model has a few)."""
    tokens = list(run(path, "bfloat16").outputs[0].token_ids)
    ref = _hf_logprobs(hf, PROMPT + tokens)[len(PROMPT) - 1:-1]
    return (ref.amax(-1) - ref[torch.arange(len(tokens)), torch.tensor(tokens)]).max().item()


def config_error(path: Path, **changes) -> str:
    """The ValueError loading `path` with its quantization_config changed by `changes`."""
    import pytest

    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] |= changes
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        LLM(str(path), dtype="float32", skip_tokenizer_init=True)
    return str(error.value)
