"""LFM2, a hybrid of gated short convolutions and attention, served by the engine: attention layers in
KV blocks, the convolutions' states (their last L-1 inputs) in state slots apart from the block pool
(kv_cache_spec), against transformers' Lfm2ForCausalLM in float32; and the layer, the layout and
the config reading underneath."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import assert_matches_oracle
from tiny_hybrid_models import (
    _LFM2,
    GREEDY,
    LFM2_CONFIGS,
    LFM2_HYBRIDS,
    assert_nothing_held,
    check_a_preempted_request_recomputes_its_states,
    check_chunked_and_batched_match_transformers,
    check_n_completions_hold_their_own_states,
    check_swap_is_refused,
    make_tiny_lfm2,
    token_prompts,
)

from kvflow import LLM, SamplingParams
from kvflow.kv_cache_spec import STATE_BYTES, FullAttentionSpec, ShortConvStateSpec
from kvflow.model.arch_config import ArchConfig
from kvflow.model.layers.short_conv import ShortConv
from kvflow.worker.kv_cache import allocate_kv_caches

# float32 matmuls over different row counts round differently; outputs are ~10 in size.
CLOSE = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=LFM2_HYBRIDS)
def tiny_lfm2(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return str(directory), make_tiny_lfm2(request.param, directory)


def _config(name: str = "lfm2-conv-first", **changes) -> dict:
    return {**_LFM2, **LFM2_CONFIGS[name], "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", **changes}


# -- served against transformers ---------------------------------------------------------------

@pytest.mark.parametrize("step_tokens", [16, 512])
def test_prompts_chunked_and_batched_match_transformers(tiny_lfm2, step_tokens):
    check_chunked_and_batched_match_transformers(*tiny_lfm2, step_tokens)


@pytest.mark.parametrize("name", ["lfm2-conv-only", "lfm2-attn-only"])
def test_a_model_of_one_kind_of_layer_matches_transformers(name, tmp_path):
    """Convolutions only (their states are the pool's blocks, one per request) and attention only
    (HF's default when no layer says otherwise): prompts split over steps, decoded together,
    within 1e-4 of transformers, every block back after."""
    hf = make_tiny_lfm2(name, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=16, num_kv_blocks=16)
    assert llm.llm_engine.arch.kv_layout.holds_state == (name == "lfm2-conv-only")
    prompts = token_prompts((21, 5, 40))
    for prompt, out in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=12, prompt_logprobs=0, **GREEDY))):
        assert_matches_oracle(hf, prompt, out, 12)
    kv = llm.llm_engine.scheduler.kv_cache
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_a_chunked_prefill_equals_one_shot(tiny_lfm2):
    """A 45-token prompt in steps of at most 7 tokens (cuts at every offset of the kernel's window)
    gives the one-shot prefill's prompt logprobs and generation."""
    directory, _ = tiny_lfm2
    prompt = token_prompts((45,), seed=5)[0]
    params = SamplingParams(max_tokens=8, prompt_logprobs=0, **GREEDY)
    runs = [LLM(directory, dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=step, num_kv_blocks=16,
                max_num_seqs=4).generate([prompt], params)[0] for step in (7, 512)]
    chunked, whole = ([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompt[1:])] for out in runs)
    torch.testing.assert_close(torch.tensor(chunked), torch.tensor(whole), atol=1e-4, rtol=0)
    assert runs[0].outputs[0].token_ids == runs[1].outputs[0].token_ids


def test_n_completions_each_hold_their_own_state(tiny_lfm2):
    check_n_completions_hold_their_own_states(*tiny_lfm2)


def test_a_preempted_request_recomputes_its_state(tiny_lfm2):
    check_a_preempted_request_recomputes_its_states(*tiny_lfm2)


def test_swap_is_refused_naming_the_setting(tiny_lfm2):
    check_swap_is_refused(tiny_lfm2[0])


# -- the layer ---------------------------------------------------------------------------------

def _random_short_conv(bias: bool) -> ShortConv:
    torch.manual_seed(0)
    layer = ShortConv(16, 3, bias)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_the_layer_split_anywhere_equals_one_call(bias):
    """Ten tokens of one request in one call, in chunks of 1, 2 and 7 (a chunk shorter than the
    state too), and token by token as decode steps of two requests stacked: the same outputs, and
    the state after them is the last two inputs to the convolution."""
    layer = _random_short_conv(bias)
    hidden = torch.randn(10, 16)
    whole_state = torch.zeros(1, 16, 2)
    whole = layer(hidden, whole_state, [10])
    state, pieces = torch.zeros(1, 16, 2), []
    for start, end in ((0, 1), (1, 3), (3, 10)):
        pieces.append(layer(hidden[start:end], state, [end - start]))
    torch.testing.assert_close(torch.cat(pieces), whole, **CLOSE)
    torch.testing.assert_close(state, whole_state, **CLOSE)
    gate_in, _, x = layer.in_proj(hidden).chunk(3, dim=-1)
    torch.testing.assert_close(whole_state[0], (gate_in * x)[-2:].t(), **CLOSE)
    twin = torch.cat([hidden[:, None], -hidden[:, None]], dim=1)  # request 1 reads -hidden
    states, stepped = torch.zeros(2, 16, 2), []
    for t in range(10):
        stepped.append(layer(twin[t], states, [1, 1]))
    torch.testing.assert_close(torch.stack(stepped)[:, 0], whole, **CLOSE)
    torch.testing.assert_close(torch.stack(stepped)[:, 1], layer(-hidden, torch.zeros(1, 16, 2), [10]), **CLOSE)


def test_a_batch_of_chunks_keeps_each_requests_state_its_own():
    """Two requests' chunks in one call (4 and 3 rows) equal each alone, each state its own."""
    layer = _random_short_conv(bias=True)
    hidden, start = torch.randn(7, 16), torch.randn(2, 16, 2)
    states = start.clone()
    together = layer(hidden, states, [4, 3])
    for r, rows in enumerate((slice(0, 4), slice(4, 7))):
        alone = start[r:r + 1].clone()
        torch.testing.assert_close(together[rows], layer(hidden[rows], alone, [rows.stop - rows.start]), **CLOSE)
        torch.testing.assert_close(states[r], alone[0], **CLOSE)


# -- layout, config ----------------------------------------------------------------------------

def test_layout_keeps_the_convolutions_states_apart_from_the_block_pool():
    """The two attention layers share one group of blocks; the two convolutions form one state
    group of 64 channels x 2 inputs each, in slot tensors of their own."""
    layout = ArchConfig.from_hf(_config()).kv_layout
    assert [(type(g.spec), g.layers) for g in layout.groups] == [(FullAttentionSpec, (1, 3)),
                                                                  (ShortConvStateSpec, (0, 2))]
    assert layout.hybrid and layout.state_layers == (0, 2)
    assert layout.groups[1].spec.state_elements == 64 * 2
    assert layout.state_bytes() == 2 * 64 * 2 * STATE_BYTES
    assert layout.block_bytes(16, 4) == 2 * 16 * (2 * 2 * 16) * 4  # the attention layers' KV only
    caches = allocate_kv_caches(layout, 5, 16, torch.float32, "cpu", populate=False, num_state_slots=3)
    assert caches[0].shape == caches[2].shape == (1, 3, 128) and caches[0].data_ptr() != caches[2].data_ptr()
    assert caches[1].shape[1] == caches[3].shape[1] == 5


def test_the_config_is_read_as_transformers_reads_it():
    """The MLP's width as Lfm2MLP derives it; attention layers from full_attn_idxs when layer_types
    is absent (every layer when both are); the older tie_embedding and block_ff_dim names."""
    import transformers

    for name in LFM2_HYBRIDS:
        hf_config = transformers.Lfm2Config(**{**_LFM2, **LFM2_CONFIGS[name]})
        width = transformers.models.lfm2.modeling_lfm2.Lfm2MLP(hf_config).w1.out_features
        assert ArchConfig.from_hf(_config(name)).intermediate_size == width
    plain = {k: v for k, v in _config().items() if k != "layer_types"}
    assert ArchConfig.from_hf({**plain, "full_attn_idxs": [2]}).attention_layers == (2,)
    assert not ArchConfig.from_hf(plain).kv_layout.holds_state
    old = ArchConfig.from_hf({**_config("lfm2-attn-first-bias"), "tie_embedding": True, "block_ff_dim": 48})
    assert old.tie_word_embeddings and old.intermediate_size == 48


@pytest.mark.parametrize(("field", "value", "message"), [
    ("layer_types", ["conv", "full_attention"], "layer_types names 2 layers; num_hidden_layers is 4"),
    ("layer_types", ["conv", "sliding_attention", "conv", "full_attention"],
     "layer_types may hold 'conv' and 'full_attention' only; got \\['sliding_attention'\\]"),
    ("conv_L_cache", 1, "conv_L_cache must be at least 2"),
    ("block_multiple_of", 0, "block_multiple_of must be at least 1; got 0"),
])
def test_a_bad_config_is_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        ArchConfig.from_hf(_config(**{field: value}))


def test_tensor_and_pipeline_parallel_are_refused_naming_the_flag():
    from kvflow.attention.backend import get_attention_backend
    from kvflow.distributed.parallel_state import TensorParallel, tensor_parallel_scope
    from kvflow.distributed.pipeline import PipelineStage, pipeline_scope
    from kvflow.model.models.lfm2 import Lfm2ForCausalLM

    arch, backend = ArchConfig.from_hf(_config()), get_attention_backend("torch_sdpa")
    with tensor_parallel_scope(TensorParallel(0, 2)), pytest.raises(ValueError, match="Lfm2ForCausalLM.*tensor_parallel_size=2"):
        Lfm2ForCausalLM(arch, backend)
    with pipeline_scope(PipelineStage(0, 2, range(2))), pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        Lfm2ForCausalLM(arch, backend)


def test_int8_quantizes_every_projection_convolutions_included(tiny_lfm2):
    """quantization="int8": every linear layer (the convolutions' in_proj and out_proj too) runs
    int8 weights, and the model serves with them, every block and slot given back after."""
    from kvflow.model.layers.linear import LinearBase

    directory, _ = tiny_lfm2
    llm = LLM(directory, dtype="float32", skip_tokenizer_init=True, quantization="int8", num_kv_blocks=16)
    model = llm.llm_engine.model_executor.driver_worker.model
    linears = {name: type(module.quant_method).__name__ for name, module in model.named_modules()
               if isinstance(module, LinearBase)}
    assert {"model.layers.2.conv.in_proj", "model.layers.2.conv.out_proj"} <= set(linears)
    assert set(linears.values()) == {"Int8Method"}
    out = llm.generate(token_prompts((24, 9), seed=6), SamplingParams(max_tokens=6, **GREEDY))
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]
    assert_nothing_held(llm.llm_engine)
