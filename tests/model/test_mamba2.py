"""Mamba-2 against transformers' `Mamba2ForCausalLM` in float32, on tiny random checkpoints
(tests/tiny_ssm_models.py: one group and two, biased projections, a step-size ceiling; prompts of 21
tokens over chunks of 8, so the last chunk is partial).

The model's contract is its explicit state: a prompt in one call or in uneven chunks, a decode
token by token, a request alone or batched with others must all give the same numbers, and those
of transformers (its logits, its cache's states, its greedy generation). The chunked SSD scan is
held to the token-by-token recurrence on its own too.
"""

from __future__ import annotations

import pytest
import torch
from tiny_ssm_models import MAMBA2_CONFIGS, make_tiny_mamba2

from kvflow.distributed.parallel_state import TensorParallel, tensor_parallel_scope
from kvflow.distributed.pipeline import PipelineStage, pipeline_scope
from kvflow.model.layers.mamba2_mixer import (
    MambaState,
    MixerConfig,
    recurrent_step,
    ssd_chunked,
    ssd_sequential,
)
from kvflow.model.loader.hf import load_hf_dir
from kvflow.model.loader.weights import process_weights_after_loading
from kvflow.model.models.mamba2 import Mamba2Config, Mamba2ForCausalLM

PROMPT_LEN = 21  # 2 chunks of 8 and a partial one
# The dt-limit checkpoint is held to transformers' uncached forward only: its cached decode step
# skips the clamp its prefill applies (kvflow clamps both, so a state never depends on chunking).
UNCLAMPED = [name for name, extra in MAMBA2_CONFIGS.items() if "time_step_limit" not in extra]


@pytest.fixture(scope="module", params=sorted(MAMBA2_CONFIGS))
def pair(request, tmp_path_factory):
    """(transformers' model, ours with the same weights, the config name)."""
    directory = tmp_path_factory.mktemp(request.param)
    return (*_pair(request.param, directory), request.param)


def _pair(name, directory):
    hf = make_tiny_mamba2(name, directory)
    checkpoint = load_hf_dir(directory, load_tokenizer=False)
    ours = Mamba2ForCausalLM(Mamba2Config.from_hf(checkpoint.hf_config)).eval()
    ours.load_weights(checkpoint.weights)
    process_weights_after_loading(ours)
    return hf, ours


def _prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 97, (length,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _run(model, ids, state=None):
    """(logits, state after) of one request's tokens in one call."""
    hidden, (state,) = model(ids, [state or model.initial_state()], [len(ids)])
    return model.compute_logits(hidden), state


def _assert_states_close(a, b, atol: float) -> None:
    """Within `atol`, or float32's relative noise on the larger state entries (they reach ~20)."""
    rtol = 1e-5 if atol else 0.0
    for layer_a, layer_b in zip(a, b, strict=True):
        torch.testing.assert_close(layer_a.conv, layer_b.conv, atol=atol, rtol=rtol)
        torch.testing.assert_close(layer_a.ssm, layer_b.ssm, atol=atol, rtol=rtol)


def test_prompt_logits_match_transformers(pair):
    hf, ours, _ = pair
    ids = _prompt(PROMPT_LEN)
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    logits, _ = _run(ours, ids)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_state_after_a_prompt_is_transformers_cache(pair):
    """Same layout as HF's cache: conv [conv_dim, conv_kernel] (the last K inputs), ssm [H, P, N]."""
    hf, ours, _ = pair
    ids = _prompt(PROMPT_LEN)
    with torch.no_grad():
        cache = hf(ids[None], use_cache=True).cache
    _, state = _run(ours, ids)
    for i, layer_state in enumerate(state):
        torch.testing.assert_close(layer_state.conv, cache.layers[i].conv_states[0][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(layer_state.ssm, cache.layers[i].recurrent_states[0][0], atol=1e-5, rtol=0)


def test_a_prompt_in_three_uneven_chunks_equals_one_call(pair):
    """9 tokens (past a chunk boundary), 1 (the decode path), 11 (ends in a partial chunk), each
    from the state the last returned; the states handed in are left as they were."""
    _, ours, _ = pair
    ids = _prompt(PROMPT_LEN)
    whole, whole_state = _run(ours, ids)
    state, parts = ours.initial_state(), []
    for piece in ids.split([9, 1, 11]):
        before = [MambaState(s.conv.clone(), s.ssm.clone()) for s in state]
        logits, next_state = _run(ours, piece, state)
        _assert_states_close(state, before, atol=0)
        parts.append(logits)
        state = next_state
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=0)
    _assert_states_close(state, whole_state, atol=1e-5)


@pytest.mark.parametrize("name", UNCLAMPED)
def test_decode_matches_transformers_cached_generation(name, tmp_path):
    """16 greedy tokens one at a time after a 21-token prefix: transformers' tokens and logits."""
    hf, ours = _pair(name, tmp_path)
    ids = _prompt(PROMPT_LEN)
    hf.generation_config.eos_token_id = None  # 16 tokens whatever they are, none of them masked
    with torch.no_grad():
        out = hf.generate(ids[None], max_new_tokens=16, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0)
    expected_tokens = out.sequences[0, PROMPT_LEN:].tolist()
    assert len(expected_tokens) == 16
    tokens, logits = _greedy(ours, ids, 16)
    assert tokens == expected_tokens
    torch.testing.assert_close(torch.stack(logits), torch.cat(out.logits), atol=1e-4, rtol=0)


def test_decode_matches_transformers_full_sequence_logits(pair):
    """The same decode against one uncached forward over prompt + output: with a step-size ceiling
    too, since kvflow's decode clamps dt as its prefill does."""
    hf, ours, _ = pair
    ids = _prompt(PROMPT_LEN)
    tokens, logits = _greedy(ours, ids, 16)
    with torch.no_grad():
        expected = hf(torch.cat([ids, torch.tensor(tokens)])[None]).logits[0, PROMPT_LEN - 1:-1]
    torch.testing.assert_close(torch.stack(logits), expected, atol=1e-4, rtol=0)


def _greedy(model, ids, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill `ids`, then `steps` one-token calls; (tokens, the logits each was taken from)."""
    logits, state = _run(model, ids)
    last, tokens, all_logits = logits[-1], [], []
    for _ in range(steps):
        all_logits.append(last)
        tokens.append(int(last.argmax()))
        step_logits, state = _run(model, torch.tensor(tokens[-1:]), state)
        last = step_logits[0]
    return tokens, all_logits


def test_a_batch_of_decodes_equals_each_alone(pair):
    """Three requests at different points (prompts of 5, 12 and 21 tokens) decode four steps
    together; each step's logits and states are each request's alone, to 1e-5."""
    _, ours, _ = pair
    prompts = [_prompt(n, seed=n) for n in (5, 12, PROMPT_LEN)]
    states, tokens = [], []
    for prompt in prompts:
        logits, state = _run(ours, prompt)
        states.append(state)
        tokens.append(int(logits[-1].argmax()))
    for _ in range(4):
        with torch.no_grad():
            hidden, batched_states = ours(torch.tensor(tokens), states, [1, 1, 1])
        batched = ours.compute_logits(hidden)
        for r in range(3):
            alone, alone_state = _run(ours, torch.tensor(tokens[r:r + 1]), states[r])
            torch.testing.assert_close(batched[r], alone[0], atol=1e-5, rtol=0)
            _assert_states_close(batched_states[r], alone_state, atol=1e-5)
        states, tokens = batched_states, batched.argmax(-1).tolist()


def test_a_mixed_batch_equals_each_request_alone(pair):
    """Prefill chunks and decode tokens in one flat batch: a first chunk (7 tokens), a decode, a
    later chunk (3 tokens), each as it is alone."""
    _, ours, _ = pair
    _, mid_state = _run(ours, _prompt(10, seed=2))
    _, other_state = _run(ours, _prompt(6, seed=3))
    requests = [(_prompt(7, seed=4), ours.initial_state()), (_prompt(1, seed=5), mid_state),
                (_prompt(3, seed=6), other_state)]
    with torch.no_grad():
        hidden, states = ours(torch.cat([ids for ids, _ in requests]), [s for _, s in requests], [7, 1, 3])
    batched = ours.compute_logits(hidden).split([7, 1, 3])
    for (ids, state), logits, batched_state in zip(requests, batched, states):
        alone, alone_state = _run(ours, ids, state)
        torch.testing.assert_close(logits, alone, atol=1e-5, rtol=0)
        _assert_states_close(batched_state, alone_state, atol=1e-5)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("chunk_size", [1, 3, 8, 21, 64])
def test_chunked_ssd_equals_the_sequential_scan(groups, chunk_size):
    """21 tokens from a nonzero state, chunks that divide it, do not, and exceed it; steps whose
    decay ranges from barely any to nearly all of the state per token."""
    gen = torch.Generator().manual_seed(groups * 100 + chunk_size)
    length, heads, head_dim, state_size = 21, 4, 8, 6
    x = torch.randn(length, heads, head_dim, generator=gen)
    dt = torch.rand(length, heads, generator=gen) * 2
    A = -torch.rand(heads, generator=gen) * 4
    B, C = (torch.randn(length, groups, state_size, generator=gen) for _ in range(2))
    state = torch.randn(heads, head_dim, state_size, generator=gen)
    expected_y, expected_state = ssd_sequential(x, dt, A, B, C, state)
    y, final = ssd_chunked(x, dt, A, B, C, state, chunk_size)
    torch.testing.assert_close(y, expected_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, expected_state, atol=1e-5, rtol=1e-5)


def test_chunked_ssd_stays_exact_deep_into_a_strongly_decaying_chunk():
    """A 256-token chunk whose log-decay sums to about -800: late tokens' short segments must not
    lose their low bits to the long sum before them (a float32 difference of running sums is off
    by ~3e-5 here)."""
    gen = torch.Generator().manual_seed(0)
    length, heads, head_dim, state_size = 256, 4, 8, 6
    x = torch.randn(length, heads, head_dim, generator=gen)
    dt = 0.5 + torch.rand(length, heads, generator=gen) * 0.5
    A = torch.full((heads,), -4.0)
    B, C = (torch.randn(length, 1, state_size, generator=gen) for _ in range(2))
    state = torch.zeros(heads, head_dim, state_size)
    expected_y, _ = ssd_sequential(x, dt, A, B, C, state)
    y, _ = ssd_chunked(x, dt, A, B, C, state, length)
    torch.testing.assert_close(y, expected_y, atol=1e-5, rtol=0)


def test_the_recurrent_step_is_per_request():
    """A batch of steps is each request's step: states of other requests never mix in."""
    gen = torch.Generator().manual_seed(0)
    state = torch.randn(3, 2, 4, 5, generator=gen)
    x, dt = torch.randn(3, 2, 4, generator=gen), torch.rand(3, 2, generator=gen)
    A, B, C = -torch.rand(2, generator=gen), torch.randn(3, 2, 5, generator=gen), torch.randn(3, 2, 5, generator=gen)
    y, new = recurrent_step(state, x, dt, A, B, C)
    for r in range(3):
        y_r, new_r = recurrent_step(state[r], x[r], dt[r], A, B[r], C[r])
        torch.testing.assert_close(y[r], y_r, atol=1e-6, rtol=0)
        torch.testing.assert_close(new[r], new_r, atol=1e-6, rtol=0)


def test_the_mixer_prefill_with_either_scan_agrees(pair):
    """A layer's prefill on the chunked SSD and on the reference recurrence: same outputs and state."""
    _, ours, _ = pair
    mixer = ours.backbone.layers[0].mixer
    hidden = torch.randn(PROMPT_LEN, mixer.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    start = ours.initial_state()[0]
    with torch.no_grad():
        chunked, chunked_state = mixer.prefill(hidden, start)
        sequential, sequential_state = mixer.prefill(hidden, start, scan=ssd_sequential)
    torch.testing.assert_close(chunked, sequential, atol=1e-5, rtol=0)
    _assert_states_close([chunked_state], [sequential_state], atol=1e-5)


def test_the_mixer_decode_of_three_requests_is_each_ones_prefill(pair):
    """A layer's batched one-token step (conv window, recurrence) against its prefill path (conv1d,
    chunked SSD) of that one token, each request from its own state."""
    _, ours, _ = pair
    mixer = ours.backbone.layers[1].mixer
    gen = torch.Generator().manual_seed(0)
    states = []
    for n in (3, 9, 17):
        _, state = mixer.prefill(torch.randn(n, mixer.cfg.hidden_size, generator=gen), ours.initial_state()[1])
        states.append(state)
    hidden = torch.randn(3, mixer.cfg.hidden_size, generator=gen)
    with torch.no_grad():
        stepped, stepped_states = mixer.decode(hidden, states)
        for r in range(3):
            alone, alone_state = mixer.prefill(hidden[r:r + 1], states[r])
            torch.testing.assert_close(stepped[r:r + 1], alone, atol=1e-5, rtol=0)
            _assert_states_close([stepped_states[r]], [alone_state], atol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _pair("mamba2-g2-bias", tmp_path_factory.mktemp("tiny"))[1]


@pytest.mark.parametrize("ids, states, counts, named", [
    (torch.arange(5), 1, [2, 2], "token_counts"),  # 4 counted, 5 given
    (torch.arange(4), 1, [2, 2], "states"),  # one state for two requests
    (torch.arange(4), 2, [4, 0], "token_counts"),
    (torch.arange(4)[None], 1, [4], "input_ids"),
])
def test_a_bad_batch_is_refused_naming_the_argument(tiny, ids, states, counts, named):
    with pytest.raises(ValueError, match=named):
        tiny(ids, [tiny.initial_state()] * states, counts)


def test_a_state_of_the_wrong_shape_or_length_is_refused_naming_it(tiny):
    state = list(tiny.initial_state())
    with pytest.raises(ValueError, match=r"states\[0\] has 1 layer states; the model has 2"):
        tiny(torch.arange(3), [tuple(state[:1])], [3])
    state[1] = MambaState(state[1].conv[:, :-1], state[1].ssm)
    with pytest.raises(ValueError, match=r"states\[0\]\[1\]\.conv has shape \(192, 3\)"):
        tiny(torch.arange(3), [tuple(state)], [3])


def test_tensor_and_pipeline_parallel_are_refused_naming_the_flag(tiny):
    cfg = tiny.config
    with tensor_parallel_scope(TensorParallel(0, 2)), pytest.raises(ValueError, match="tensor_parallel_size=2"):
        Mamba2ForCausalLM(cfg)
    with pipeline_scope(PipelineStage(0, 2, range(1))), pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        Mamba2ForCausalLM(cfg)


_CONFIG = dict(vocab_size=97, hidden_size=64, num_heads=8, head_dim=16, num_hidden_layers=2)


@pytest.mark.parametrize("change, named", [
    (dict(head_dim=8), "num_heads x head_dim"),
    (dict(n_groups=3), "n_groups"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(time_step_limit=[0.1, 0.01]), "time_step_limit"),
    (dict(time_step_limit=["a", 1]), "time_step_limit"),
    (dict(chunk_size=0), "chunk_size"),
])
def test_a_bad_config_is_refused_naming_the_field(change, named):
    with pytest.raises(ValueError, match=named):
        Mamba2Config.from_hf({**_CONFIG, "n_groups": 1, **change})


def test_transformers_infinity_and_older_embedding_name_load(tmp_path):
    """config.json's {"__float__": "Infinity"} reads as no ceiling; `backbone.embedding` (older
    checkpoints) loads as `backbone.embeddings`."""
    cfg = MixerConfig.from_hf({**_CONFIG, "n_groups": 1, "time_step_limit": [0.0, {"__float__": "Infinity"}]})
    assert (cfg.dt_min, cfg.dt_max) == (0.0, float("inf"))
    hf, ours = _pair("mamba2-g1", tmp_path)
    renamed = Mamba2ForCausalLM(ours.config).eval()
    renamed.load_weights((n.replace("embeddings", "embedding"), p) for n, p in hf.state_dict().items())
    process_weights_after_loading(renamed)
    ids = _prompt(PROMPT_LEN)
    torch.testing.assert_close(_run(renamed, ids)[0], _run(ours, ids)[0], atol=0, rtol=0)
