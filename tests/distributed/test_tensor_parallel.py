"""Tensor parallelism on CPU with gloo: shards concatenate bitwise to the full weights, two ranks
give the logprobs one gives (float32, within 1e-4), a model whose heads do not split is refused
with what would work, and a rank that dies ends the step with an error instead of a hang."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from tiny_models import make_tiny_model
from tp_runs import run_with_logprobs

from kvflow import LLM, SamplingParams
from kvflow.attention.backend import get_attention_backend
from kvflow.device_faults import WorkerDiedError, is_device_fault
from kvflow.distributed.parallel_state import TensorParallel, tensor_parallel_scope
from kvflow.model.arch_config import ArchConfig
from kvflow.model.loader.hf import load_hf_dir
from kvflow.model.loader.weights import process_weights_after_loading
from kvflow.model.registry import build_model
from kvflow.quant.registry import get_quantization_config

# 4 query heads: 2 KV heads split one per rank; 1 KV head is replicated on both ranks.
ARCHS = ["llama-gqa-llama3-rope", "llama-mqa"]


def _model(path, tp: TensorParallel, quantization=None):
    checkpoint = load_hf_dir(path, load_tokenizer=False)
    with tensor_parallel_scope(tp):
        model = build_model(ArchConfig.from_hf(checkpoint.hf_config), get_attention_backend("torch_reference"),
                            quant_config=get_quantization_config(quantization, None, None))
    model.load_weights(checkpoint.weights)
    process_weights_after_loading(model)
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_shards_concatenate_to_the_full_weights(tmp_path, arch):
    make_tiny_model(arch, tmp_path)
    full = _model(tmp_path, TensorParallel())
    ranks = [_model(tmp_path, TensorParallel(r, 2)) for r in range(2)]
    cfg, d = full.config, full.config.head_dim
    for name, param in full.named_parameters():
        parts = [dict(m.named_parameters())[name] for m in ranks]
        if "qkv_proj" in name:
            q, k, v = (torch.cat(ps) for ps in zip(*(p.split(m.get_submodule(name.rsplit(".", 1)[0]).output_sizes)
                                                    for p, m in zip(parts, ranks))))
            kv = cfg.num_kv_heads * d
            assert torch.equal(q, param[:cfg.num_heads * d])
            if cfg.num_kv_heads >= 2:
                assert torch.equal(k, param[cfg.num_heads * d:][:kv]) and torch.equal(v, param[-kv:])
            else:  # replicated: every rank holds the one KV head
                assert all(torch.equal(part[cfg.num_heads * d // 2:], param[cfg.num_heads * d:]) for part in parts)
        elif "gate_up" in name:
            gate, up = (torch.cat(ps) for ps in zip(*(p.chunk(2) for p in parts)))
            assert torch.equal(torch.cat([gate, up]), param)
        elif "o_proj" in name or "down_proj" in name:
            assert torch.equal(torch.cat(parts, dim=1), param)
        elif "embed" in name or "lm_head" in name:
            assert torch.equal(torch.cat(parts)[:cfg.vocab_size], param)  # the tail is padding
            assert not torch.cat(parts)[cfg.vocab_size:].any()
        else:  # norms: every rank holds them whole
            assert all(torch.equal(p, param) for p in parts)


def test_int8_shards_of_column_parallel_layers_are_the_full_layers_rows(tmp_path):
    make_tiny_model("llama-gqa-llama3-rope", tmp_path)
    full = _model(tmp_path, TensorParallel(), "int8")
    ranks = [_model(tmp_path, TensorParallel(r, 2), "int8") for r in range(2)]
    name = "model.layers.0.mlp.gate_up_proj"
    layers = [m.get_submodule(name) for m in ranks]
    for tensor in ("weight", "weight_scale"):
        gate, up = (torch.cat(ps) for ps in zip(*(getattr(layer, tensor).chunk(2) for layer in layers)))
        assert torch.equal(torch.cat([gate, up]), getattr(full.get_submodule(name), tensor))
    # Row-parallel: each rank's int8 scales cover its slice of the inputs; the product still matches.
    x = torch.randn(3, full.config.intermediate_size)
    down = [m.get_submodule("model.layers.0.mlp.down_proj") for m in ranks]
    summed = sum(layer.quant_method.apply(layer, part) for layer, part in zip(down, x.chunk(2, dim=1)))
    torch.testing.assert_close(summed, full.get_submodule("model.layers.0.mlp.down_proj")(x), atol=0.05, rtol=0.05)


def test_heads_that_do_not_split_are_refused_with_what_would_work(tmp_path):
    make_tiny_model("llama-gqa-llama3-rope", tmp_path)  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .* 4 attention heads and 2 KV heads.* would work: 1, 2, 4"):
        LLM(str(tmp_path), skip_tokenizer_init=True, tensor_parallel_size=3)



def _logprobs(out):
    values = [(t, lp.logprob) for d in out.outputs[0].logprobs for t, lp in d.items()]
    return values + [(t, lp.logprob) for d in out.prompt_logprobs[1:] for t, lp in d.items()]


@pytest.mark.timeout(300, method="thread")  # a dead rank must end a step, not hang it
@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_give_one_ranks_logprobs(tmp_path, arch):
    make_tiny_model(arch, tmp_path)
    _, single = run_with_logprobs(tmp_path, 1)
    llm, split = run_with_logprobs(tmp_path, 2)
    try:
        for one, two in zip(single, split):
            assert one.outputs[0].token_ids == two.outputs[0].token_ids
            a, b = _logprobs(one), _logprobs(two)
            assert [t for t, _ in a] == [t for t, _ in b]
            assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) < 1e-4
        if arch == "llama-mqa":
            _a_dead_rank_ends_the_step_with_an_error(llm)
    finally:
        llm.llm_engine.shutdown()


def _a_dead_rank_ends_the_step_with_an_error(llm):
    engine = llm.llm_engine
    [rank1] = engine.model_executor._processes
    engine.add_request("doomed", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    os.kill(rank1.pid, signal.SIGKILL)
    rank1.join(timeout=10)
    with pytest.raises(WorkerDiedError, match=r"rank 1 \(kvflow-rank-1, pid \d+\) was killed by signal SIGKILL") as error:
        engine.step()  # before the step: no collective is attempted with the dead rank
    assert is_device_fault(error.value)  # a server declares its engine dead: /health turns 503
    assert engine.abort_failed_step() == ["doomed"]
    with pytest.raises(WorkerDiedError):  # and every later step, at once
        engine.model_executor.check_health()
