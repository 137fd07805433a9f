"""Speculation with the real default model (float32) on a prompt whose answer copies its input:
prompt lookup is accepted for most tokens, output and text are the non-speculative ones, and a
stop string met inside an accepted run ends the text exactly where it would have."""

from __future__ import annotations

import pytest

from kvflow import LLM, RequestOutputKind, SamplingParams
from kvflow.bench.spec_prompts import conversations

pytestmark = pytest.mark.slow
MAX_TOKENS = 40
# Two engines side by side on a shared machine: a small KV pool each.
SMALL = dict(dtype="float32", disable_log_stats=True, max_model_len=1024, kv_cache_memory_gb=0.1)


@pytest.fixture(scope="module")
def prompt_and_plain():
    plain = LLM(**SMALL)
    prompt = plain.get_tokenizer().apply_chat_template(conversations("grounded")[1], add_generation_prompt=True,
                                                       tokenize=True)
    return prompt, plain.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0].outputs[0]


@pytest.fixture(scope="module")
def speculative():
    return LLM(**SMALL, speculative_config={"method": "ngram", "num_speculative_tokens": 5, "adaptive": False})


def _stop_inside(tokenizer, token_ids: list[int], text: str, skip: int) -> tuple[str, int]:
    """A 4-character stop string straddling a token boundary past `skip` tokens, first seen there."""
    bounds = [len(tokenizer.decode(token_ids[:i], skip_special_tokens=True)) for i in range(len(token_ids) + 1)]
    for k in range(skip, len(bounds) - 1):
        stop = text[bounds[k] - 2:bounds[k] + 2]
        if bounds[k] - bounds[k - 1] >= 2 and bounds[k + 1] - bounds[k] >= 2 and text.find(stop) == bounds[k] - 2:
            return stop, bounds[k] - 2
    raise AssertionError(f"no token boundary to test in {text!r}")


def test_copying_answers_accept_most_lookups_and_match_plain_decoding(prompt_and_plain, speculative):
    prompt, plain = prompt_and_plain
    out = speculative.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.text) == (plain.token_ids, plain.text)
    stats = speculative.llm_engine.get_stats().spec_decoding
    assert stats.acceptance_rate > 0.5 and stats.mean_acceptance_length > 2


def test_a_stop_string_inside_an_accepted_run_ends_the_text_exactly(prompt_and_plain, speculative):
    prompt, plain = prompt_and_plain
    tokenizer = speculative.get_tokenizer()
    stop, start = _stop_inside(tokenizer, plain.token_ids, plain.text, skip=15)
    engine = speculative.llm_engine
    generated_before = engine.get_stats().generation_tokens_total
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop],
                                                   output_kind=RequestOutputKind.DELTA))
    deltas, tokens, final = [], [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            deltas.append(o.outputs[0].text)
            tokens += o.outputs[0].token_ids
            final = o.outputs[0]
    assert "".join(deltas) == plain.text[:start]
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    # The output ends at the token that completed the stop string, as without speculation.
    end = next(i for i in range(len(plain.token_ids) + 1)
               if stop in tokenizer.decode(plain.token_ids[:i], skip_special_tokens=True))
    assert tokens == plain.token_ids[:end]
    # The step that met it had accepted tokens beyond it: those were dropped, not delivered.
    assert engine.get_stats().generation_tokens_total - generated_before > len(tokens)
    assert engine.kv_cache_usage == 0.0
