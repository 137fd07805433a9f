"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions, through the official
`openai` client on an in-process server with a tiny model: the choices are the beams
`LLM.beam_search` finds on the same weights, best first, streamed or not; what beam search cannot
honour is refused by name, and nothing is left holding KV blocks."""

from __future__ import annotations

import time

import httpx
import live_server
import openai
import pytest
from tiny_models import tiny_chat_model

from kvflow import LLM, BeamSearchParams, EngineArgs

MODEL = "tiny"
PROMPT = "Once upon a time"
BEAM = {"use_beam_search": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("beam-server"))


@pytest.fixture(scope="module")
def server(model_dir):
    with live_server.served_engine(EngineArgs(model=model_dir, dtype="float32", disable_log_stats=True), MODEL) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0].url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), dtype="float32")


def _beams(llm: LLM, prompt, width: int, max_tokens: int, length_penalty: float = 1.0) -> list[str]:
    return [s.text for s in _sequences(llm, prompt, width, max_tokens, length_penalty)]


def _sequences(llm: LLM, prompt, width: int, max_tokens: int, length_penalty: float = 1.0):
    [out] = llm.beam_search([prompt], BeamSearchParams(width, max_tokens, length_penalty=length_penalty))
    return out.sequences


@pytest.mark.parametrize("stream", [False, True])
def test_completions_return_the_beams_best_first(client, offline, stream):
    body = dict(model=MODEL, prompt=PROMPT, n=3, max_tokens=6, extra_body={**BEAM, "length_penalty": 0.5})
    if stream:
        texts = [""] * 3
        for chunk in client.completions.create(**body, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
    else:
        got = client.completions.create(**body)
        texts = [c.text for c in got.choices]
        # An ending EOS token counts as generated, as in any completion.
        assert got.usage.completion_tokens == sum(len(s.output_token_ids) for s in _sequences(offline, PROMPT, 3, 6, 0.5))
        assert [c.finish_reason for c in got.choices] == [s.finish_reason for s in _sequences(offline, PROMPT, 3, 6, 0.5)]
    assert texts == _beams(offline, PROMPT, 3, 6, length_penalty=0.5)
    assert len(set(texts)) == 3


def test_chat_returns_the_beams_of_the_templated_prompt(client, offline):
    messages = [{"role": "user", "content": "Hi"}]
    got = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=5, extra_body=BEAM)
    prompt = offline.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert [c.message.content for c in got.choices] == _beams(offline, prompt, 2, 5)


@pytest.mark.parametrize(("extra", "named"), [
    ({"temperature": 0.7}, "temperature"), ({"stop": ["x"]}, "stop"), ({"logprobs": 2}, "logprobs"),
    ({"n": 11}, "max_logprobs"), ({"top_p": 0.5}, "top_p"),
])
def test_what_beam_search_cannot_honour_is_refused_by_name(client, server, extra, named):
    n = extra.pop("n", 2)
    with pytest.raises(openai.BadRequestError, match=named):
        client.completions.create(model=MODEL, prompt=PROMPT, n=n, max_tokens=4, extra_body={**BEAM, **extra})
    assert live_server.wait_until(lambda: server[1].get_stats().kv_cache_usage == 0.0, timeout=10)


def test_a_client_that_leaves_mid_search_leaves_nothing_running(server):
    """The search stops with its client: the step in flight is aborted and no further step starts
    (it would otherwise run to the end: ~0.5 s and every step's prompt tokens)."""
    live, engine = server
    body = {"model": MODEL, "prompt": PROMPT, "n": 4, "max_tokens": 400, "ignore_eos": True, "use_beam_search": True}
    prompt_tokens = lambda: engine.get_stats().prompt_tokens_total  # noqa: E731
    before = prompt_tokens()
    assert httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).status_code == 200
    whole_search = prompt_tokens() - before
    before = prompt_tokens()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.1))
    assert live_server.wait_until(lambda: _settled(prompt_tokens), timeout=10)
    stats = engine.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert prompt_tokens() - before < whole_search / 2


def _settled(count) -> bool:
    """`count()` stays the same for 0.3 s."""
    then = count()
    time.sleep(0.3)
    return count() == then
