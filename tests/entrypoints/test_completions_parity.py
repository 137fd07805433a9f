"""Completions and chat fields vLLM's clients send, through the official `openai` client on an
in-process server with the default model: logit_bias (its effect, and no effect on the request
beside it), logprobs up to the engine's max_logprobs, stream_options.continuous_usage_stats, and
more stop strings than OpenAI's four (--max-stop-sequences)."""

from __future__ import annotations

import json

import httpx
import live_server
import openai
import pytest

from kvflow import EngineArgs

pytestmark = pytest.mark.slow
MODEL = "smol"
STORY = "Once upon a time, in a small village,"


@pytest.fixture(scope="module")
def server():
    args = EngineArgs(max_model_len=1024, kv_cache_memory_gb=0.1, disable_log_stats=True, enable_prefix_caching=False)
    with live_server.served_engine(args, MODEL) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0].url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_logit_bias_forces_a_token_and_bans_another(client, server):
    tokenizer = server[1].tokenizer
    plain = client.completions.create(model=MODEL, prompt=STORY, max_tokens=6, temperature=0)
    first = tokenizer.encode(plain.choices[0].text, add_special_tokens=False)[0]
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    banned = client.completions.create(model=MODEL, prompt=STORY, max_tokens=6, temperature=0,
                                       logit_bias={str(first): -100})
    assert tokenizer.encode(banned.choices[0].text, add_special_tokens=False)[0] != first
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == tokenizer.decode([forced] * 4)


def test_logprobs_go_to_max_logprobs_not_openais_five(client):
    got = client.completions.create(model=MODEL, prompt=STORY, max_tokens=3, temperature=0, logprobs=12)
    assert all(len(top) >= 12 for top in got.choices[0].logprobs.top_logprobs)
    with pytest.raises(openai.BadRequestError, match="max_logprobs"):
        client.completions.create(model=MODEL, prompt=STORY, max_tokens=3, logprobs=21)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server, route):
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if route == "chat":
        path, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "Hi"}]}
    else:
        path, body = "/v1/completions", {**body, "prompt": STORY}
    with httpx.stream("POST", server[0].url + path, json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    with_choices = [c for c in chunks if c["choices"] and (c["choices"][0].get("text") or
                                                           c["choices"][0].get("delta", {}).get("content"))]
    assert with_choices and all(c["usage"] is not None for c in with_choices)
    counts = [c["usage"]["completion_tokens"] for c in with_choices]
    # The usage so far, growing with the text: not the final usage repeated in every chunk.
    assert counts == sorted(counts) and counts[0] < counts[-1] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_more_stop_strings_than_openais_four(client):
    plain = client.completions.create(model=MODEL, prompt="In a small", max_tokens=8, temperature=0)
    word = plain.choices[0].text.split()[1]  # a word the text reaches: the sixth stop string, the one that stops it
    stops = [f"zz{i}" for i in range(5)] + [word]
    got = client.completions.create(model=MODEL, prompt="In a small", max_tokens=8, temperature=0, stop=stops)
    assert got.choices[0].finish_reason == "stop" and word not in got.choices[0].text
    with pytest.raises(openai.BadRequestError, match="--max-stop-sequences"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, stop=[f"s{i}" for i in range(17)])


def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(client):
    scored = client.completions.create(model=MODEL, prompt=STORY, max_tokens=0, echo=True, logprobs=1)
    one = client.completions.create(model=MODEL, prompt=STORY, max_tokens=1, echo=True, logprobs=1, temperature=0)
    choice, prompt_len = scored.choices[0], scored.usage.prompt_tokens
    assert choice.text == STORY and scored.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == prompt_len
    assert choice.logprobs.token_logprobs == one.choices[0].logprobs.token_logprobs[:prompt_len]
    streamed = client.completions.create(model=MODEL, prompt=STORY, max_tokens=0, echo=True, logprobs=1, stream=True)
    pieces = list(streamed)
    assert "".join(p.choices[0].text for p in pieces if p.choices) == STORY
    with pytest.raises(openai.BadRequestError, match="scores the prompt"):
        client.completions.create(model=MODEL, prompt=STORY, max_tokens=0)


def test_prompt_logprobs_as_vllm_returns_them(client):
    """vLLM's extra on completions (per choice) and chat (the response): each prompt position's
    token with the top N, the first position None; the same numbers as echo's logprobs."""
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=STORY, max_tokens=1, echo=True, logprobs=2,
                                                      temperature=0, extra_body={"prompt_logprobs": 2}).parse()
    choice = raw.choices[0].model_dump()
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == raw.usage.prompt_tokens
    echoed = choice["logprobs"]["token_logprobs"][:len(entries)]
    for entry, logprob in zip(entries[1:], echoed[1:]):
        assert 2 <= len(entry) <= 3  # the prompt's own token, and the top 2
        assert logprob in [e["logprob"] for e in entry.values()]
        assert {e["rank"] for e in entry.values()} >= {1, 2}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0}).model_dump()
    assert chat["prompt_logprobs"][0] is None and all(len(e) >= 1 for e in chat["prompt_logprobs"][1:])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs is not supported with stream"):
        client.completions.create(model=MODEL, prompt=STORY, max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1})
