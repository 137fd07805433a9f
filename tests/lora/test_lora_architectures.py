"""LoRA on every architecture whose projections go through the linear seam: Gemma 3 (sliding and
global KV groups), the mixtures of experts (attention, dense and shared-expert MLPs adapted; the
routed experts run without LoRA, as PEFT cannot target transformers' fused expert tensors) and
MLA (DeepSeek-V2/V3: the query and latent projections; kv_b_proj is absorbed into other matmuls,
so an adapter on it is refused by name). Each matches PEFT within 1e-4 in a batch mixing two
adapters and the base; on Gemma 3 the same prompt under two adapters shares no cached block in
any KV group."""

from __future__ import annotations

import pytest
import torch
from peft_adapters import check_logprobs, make_adapter
from tiny_models import make_tiny_model

from kvflow import LLM, LoRARequest, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=0, prompt_logprobs=0, ignore_eos=True)
# Every module name PEFT finds as an nn.Linear in these models, but the head and MLA's absorbed kv_b_proj.
ADAPTABLE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
             "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa"]


# PEFT maps these names on Qwen MoE and DeepSeek models onto their fused expert tensors
# (target_parameters, which kvflow refuses: see the last test), even where a dense layer or the
# shared experts have modules of that name.
MLP = {"gate_proj", "up_proj", "down_proj"}
PEFT_TO_EXPERTS = {"qwen3-moe": MLP, "deepseek-v2": MLP, "deepseek-v3": MLP}


def _targets(arch: str, hf) -> list[str]:
    present = {name.rsplit(".", 1)[-1] for name, m in hf.named_modules() if isinstance(m, torch.nn.Linear)}
    return sorted(present & set(ADAPTABLE) - PEFT_TO_EXPERTS.get(arch, set()))


def _prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=gen).tolist() for n in lens]


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """arch → (hf model, LLM with LoRA, PEFT oracles by adapter, LoRARequests), built once per module."""
    built = {}

    def get(arch: str):
        if arch not in built:
            base_dir = tmp_path_factory.mktemp(arch)
            hf = make_tiny_model(arch, base_dir)
            targets = _targets(arch, hf)
            oracles, loras = {None: hf}, {}
            configs = [dict(r=4, lora_alpha=8), dict(r=2, lora_alpha=6, target_modules=targets[::2])]
            for i, config in enumerate(configs, start=1):
                directory = tmp_path_factory.mktemp(f"{arch}-adapter{i}")
                oracles[i] = make_adapter(hf, directory, seed=i, **{"target_modules": targets, **config})
                loras[i] = LoRARequest(f"adapter{i}", i, str(directory))
            llm = LLM(str(base_dir), dtype="float32", skip_tokenizer_init=True, enable_lora=True, max_loras=2,
                      max_lora_rank=4, block_size=4, num_kv_blocks=512, disable_log_stats=True)
            built[arch] = hf, llm, oracles, loras
        return built[arch]
    return get


@pytest.mark.parametrize("arch", ["gemma3", "mixtral", "qwen3-moe", "olmoe", "deepseek-v2", "deepseek-v3"])
def test_mixed_batch_matches_peft(build, arch):
    _, llm, oracles, loras = build(arch)
    names = [1, None, 2, 1]
    outs = llm.generate(_prompts([21, 6, 14, 9]), PARAMS, use_tqdm=False, lora_request=[loras.get(n) for n in names])
    for name, out in zip(names, outs):
        check_logprobs(out, oracles[name])
    # Not vacuous: the adapter moves the output.
    plain = llm.generate([outs[0].prompt_token_ids], PARAMS, use_tqdm=False)[0]
    assert plain.outputs[0].logprobs[0] != outs[0].outputs[0].logprobs[0]


def test_adapters_share_no_cached_block_in_any_kv_group(build):
    _, llm, _, loras = build("gemma3")
    engine = llm.llm_engine
    assert len(engine.arch.kv_layout.groups) > 1
    prompt, params = _prompts([30], seed=4)[0], SamplingParams(temperature=0, max_tokens=2)  # no prompt logprobs:
    llm.reset_prefix_cache()                                                                    # they bypass the cache

    def cached(lora) -> int:
        return llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    assert cached(loras[1]) == 0
    assert cached(loras[2]) == 0 and cached(None) == 0
    assert cached(loras[1]) > 0 and cached(loras[2]) > 0  # while each finds its own blocks


@pytest.mark.parametrize("arch, module, named", [("deepseek-v2", "kv_b_proj", "kv_b_proj"),
                                                  ("qwen3-moe", "down_proj", "target_parameters")])
def test_absorbed_or_routed_projections_are_refused_by_name(build, tmp_path, arch, module, named):
    """MLA's absorbed kv_b_proj, and the routed experts PEFT adapts through `target_parameters`."""
    hf, llm, _, _ = build(arch)
    make_adapter(hf, tmp_path, seed=9, target_modules=[module])
    with pytest.raises(ValueError, match=rf"'unfit'.*{named}"):
        llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False, lora_request=LoRARequest("unfit", 7, str(tmp_path)))
    assert llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids  # the engine runs on
