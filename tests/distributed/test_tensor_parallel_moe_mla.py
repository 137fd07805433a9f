"""Mixtures of experts and latent attention under tensor parallelism, on CPU with gloo.

Experts split like dense MLPs (gate/up by output channels, down by input channels), the router is
every rank's, and a mixture reduces its experts' partial sums once per layer. MLA splits its query
heads (q / q_b, kv_b's per-head up-projections, o) and keeps the latent path whole on every rank.
Two ranks must give the tokens and logprobs one rank gives (float32, within 1e-4), for families
with and without shared experts; one rank is itself held to transformers by
tests/model/test_architectures.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import ARCH_CONFIGS, COMMON, make_tiny_model
from tp_runs import run_with_logprobs

from kvflow import LLM
from kvflow.attention.backend import get_attention_backend
from kvflow.distributed.parallel_state import TensorParallel, tensor_parallel_scope
from kvflow.model.arch_config import ArchConfig
from kvflow.model.layers.linear import RowParallelLinear
from kvflow.model.layers.moe import SparseMoE
from kvflow.model.loader.hf import load_hf_dir
from kvflow.model.loader.weights import process_weights_after_loading
from kvflow.model.models.blocks import RopeAttention
from kvflow.model.models.gemma3 import GemmaRMSNorm
from kvflow.model.registry import build_model
from kvflow.worker.rank_model import rank_arch

MOE_ARCHS = ["mixtral", "qwen3-moe", "olmoe"]  # no shared experts; OLMoE normalises q and k over all heads
MLA_ARCHS = ["deepseek-v2", "deepseek-v2-q-lora", "deepseek-v3"]  # shared experts; V3 routes by noaux_tc
# Norms over a whole projection of all heads (OLMoE's q and k norms) split with the heads.
HEAD_SPLIT_NORMS = {"olmoe": ("q_norm", "k_norm")}


def _model(path, tp: TensorParallel):
    checkpoint = load_hf_dir(path, load_tokenizer=False)
    with tensor_parallel_scope(tp):
        model = build_model(ArchConfig.from_hf(checkpoint.hf_config), get_attention_backend("torch_reference"))
    model.load_weights(checkpoint.weights)
    process_weights_after_loading(model)
    return model


def _expected_split(arch: str, name: str) -> str:
    """How rank r's copy of parameter `name` relates to the full one: "vocab", "qkv", "gate_up",
    "rows" (output channels), "columns" (input channels) or "whole"."""
    module = name.rsplit(".", 2)[-2]
    if "embed_tokens" in name or "lm_head" in name:
        return "vocab"
    if module in ("qkv_proj", "gate_up_proj"):
        return module.removesuffix("_proj")
    if module in ("q_proj", "q_b_proj", "kv_b_proj") or module in HEAD_SPLIT_NORMS.get(arch, ()):
        return "rows"
    if module in ("o_proj", "down_proj"):
        return "columns"
    return "whole"  # the router and its bias, the latent projections (q_a, kv_a), every other norm


def _assert_split(split: str, full: torch.Tensor, parts: list[torch.Tensor], ranks, name: str, vocab: int) -> None:
    if split == "vocab":
        assert torch.equal(torch.cat(parts)[:vocab], full) and not torch.cat(parts)[vocab:].any()
    elif split == "qkv":
        sizes = [m.get_submodule(name.rsplit(".", 1)[0]).output_sizes for m in ranks]
        q, k, v = (torch.cat(ps) for ps in zip(*(p.split(s) for p, s in zip(parts, sizes))))
        assert torch.equal(torch.cat([q, k, v]), full)
    elif split == "gate_up":
        gate, up = (torch.cat(ps) for ps in zip(*(p.chunk(2) for p in parts)))
        assert torch.equal(torch.cat([gate, up]), full)
    elif split == "rows":
        assert torch.equal(torch.cat(parts), full)
    elif split == "columns":
        assert torch.equal(torch.cat(parts, dim=1), full)
    else:
        assert all(torch.equal(p, full) for p in parts)


@pytest.mark.parametrize("arch", MOE_ARCHS + MLA_ARCHS)
def test_shards_concatenate_to_the_full_weights(tmp_path, arch):
    make_tiny_model(arch, tmp_path)
    full = _model(tmp_path, TensorParallel())
    ranks = [_model(tmp_path, TensorParallel(r, 2)) for r in range(2)]
    splits = set()
    for name, param in full.named_parameters():
        parts = [dict(m.named_parameters())[name] for m in ranks]
        split = _expected_split(arch, name)
        _assert_split(split, param, parts, ranks, name, full.config.vocab_size)
        splits.add(split)
        if ".experts." in name and split != "whole":  # a routed expert's slice is half of it
            assert parts[0].numel() * 2 == param.numel(), name
    assert {"gate_up", "columns", "whole"} <= splits


@pytest.mark.parametrize("arch", MLA_ARCHS)
def test_each_rank_absorbs_only_its_heads_up_projections(tmp_path, arch):
    make_tiny_model(arch, tmp_path)
    full = _model(tmp_path, TensorParallel()).model.layers[0].self_attn
    ranks = [_model(tmp_path, TensorParallel(r, 2)).model.layers[0].self_attn for r in range(2)]
    assert [attn.num_heads for attn in ranks] == [full.num_heads // 2] * 2
    for whole, parts in zip(full.absorbed(), zip(*(attn.absorbed() for attn in ranks))):  # W_UK, W_UV: [H, ., rank]
        torch.testing.assert_close(torch.cat(parts), whole, atol=0, rtol=0)


def test_a_partial_sum_layer_refuses_a_bias_it_would_add_on_every_rank():
    with pytest.raises(ValueError, match=r"down: a bias must be added once, after the reduce"):
        RowParallelLinear(8, 4, bias=True, prefix="down", reduce_results=False, tp_rank=0, tp_size=2)


def test_a_whole_projection_norm_splits_only_as_an_rms_norm():
    arch = _arch("olmoe")
    with tensor_parallel_scope(TensorParallel(0, 2)):
        with pytest.raises(ValueError, match=r"OlmoeForCausalLM: a whole-projection q/k norm splits .* not a GemmaRMSNorm"):
            RopeAttention(arch, 0, get_attention_backend("torch_reference"), None, "attn", qk_norm="whole",
                          norm=GemmaRMSNorm)


class CountingGroup:
    """Rank 0's side of a two-rank group that counts the all-reduces asked of it (and adds nothing)."""

    def __init__(self) -> None:
        self.all_reduces = 0

    def allreduce(self, tensors):
        self.all_reduces += 1
        return self

    def wait(self) -> None:
        pass


def test_a_mixture_all_reduces_once_per_layer_whatever_the_active_experts():
    arch = _arch("deepseek-v2")
    group = CountingGroup()
    torch.manual_seed(0)
    with tensor_parallel_scope(TensorParallel(0, 2, group)):
        layer = SparseMoE(arch.hidden_size, arch.moe, None, "mlp")
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
        x = torch.randn(16, arch.hidden_size)
        out = layer(x)
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert len(set(layer.gate(x).argmax(-1).tolist())) > 1  # several experts ran, and the shared one
    assert group.all_reduces == 1


def _run(path, tp):
    llm, outputs = run_with_logprobs(path, tp)
    llm.llm_engine.shutdown()
    return outputs


def _assert_logprobs_close(one: list[dict], two: list[dict]) -> None:
    for a, b in zip(one, two, strict=True):
        assert a.keys() == b.keys()
        assert max(abs(a[t].logprob - b[t].logprob) for t in a) < 1e-4


@pytest.mark.timeout(300, method="thread")  # a rank that hangs in a collective must fail the test, not stall it
@pytest.mark.parametrize("arch", MOE_ARCHS + MLA_ARCHS)
def test_two_ranks_give_one_ranks_tokens_and_logprobs(tmp_path, arch):
    make_tiny_model(arch, tmp_path)
    single, split = _run(tmp_path, 1), _run(tmp_path, 2)
    for one, two in zip(single, split, strict=True):
        _assert_logprobs_close(one.prompt_logprobs[1:], two.prompt_logprobs[1:])  # teacher-forced: the prompt
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        _assert_logprobs_close(one.outputs[0].logprobs, two.outputs[0].logprobs)


def _arch(name: str, **changes) -> ArchConfig:
    """A tiny model's config.json as transformers writes it, with `changes`."""
    import transformers

    cls_name, extra = ARCH_CONFIGS[name]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra, **changes}).to_dict()
    return ArchConfig.from_hf({**config, "architectures": [cls_name.replace("Config", "ForCausalLM")]})


@pytest.mark.parametrize(("arch", "size", "error"), [
    (_arch("qwen3-moe", moe_intermediate_size=30), 4,
     r"tensor_parallel_size=4 does not split Qwen3MoeForCausalLM's experts' intermediate size \(moe_intermediate_size "
     r"30\) evenly over ranks; sizes that would work: 1, 2$"),
    (_arch("mixtral", intermediate_size=90), 4,
     r"does not split MixtralForCausalLM's experts' intermediate size \(intermediate_size 90\) .* would work: 1, 2$"),
    (_arch("qwen3-moe", intermediate_size=90), 4,  # its dense layer's MLP
     r"does not split Qwen3MoeForCausalLM's MLP intermediate size \(intermediate_size 90\) .* would work: 1, 2$"),
    (_arch("deepseek-v3", num_attention_heads=6, num_key_value_heads=6), 4,
     r"tensor_parallel_size=4 does not split DeepseekV3ForCausalLM's 6 attention heads .* would work: 1, 2$"),
], ids=["experts", "mixtral-experts", "dense-layer", "mla-heads"])
def test_what_does_not_split_is_refused_naming_it_and_what_would_work(arch, size, error):
    with pytest.raises(ValueError, match=error):
        rank_arch(arch, TensorParallel(0, size))


def test_the_refusal_comes_before_any_rank_starts(tmp_path):
    make_tiny_model("mixtral", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 90}))
    with pytest.raises(ValueError, match=r"experts' intermediate size \(intermediate_size 90\)"):
        LLM(str(tmp_path), skip_tokenizer_init=True, load_format="dummy", tensor_parallel_size=4)


@pytest.mark.parametrize("arch", ["deepseek-v3", "olmoe"])
def test_a_rank_keeps_the_whole_latent_cache_and_its_share_of_the_heads(tmp_path, arch):
    make_tiny_model(arch, tmp_path)
    cfg = ArchConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    local = rank_arch(cfg, TensorParallel(1, 2))
    assert local.num_heads == cfg.num_heads // 2
    if cfg.mla is not None:  # [c, k_pe] of every token, as at one rank: the pool is sized for the whole latent
        assert local.kv_cache_specs() == cfg.kv_cache_specs()
    else:
        assert local.kv_layout.block_bytes(8, 4) * 2 == cfg.kv_layout.block_bytes(8, 4)
