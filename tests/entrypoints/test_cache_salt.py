"""`cache_salt` (vLLM's field) keeps one client's prompts out of another's prefix-cache hits
(issue 39): requests share cached KV blocks only with the same salt, on one engine and behind the
data-parallel front, on both generating endpoints; a salt that is not a short non-empty string is
a 400 naming it."""

from __future__ import annotations

import httpx
import pytest
from live_server import start_thread, wait_until
from tiny_models import tiny_chat_model

from kvflow import EngineArgs, LLMEngine
from kvflow.engine.async_llm import AsyncLLM
from kvflow.engine.dp_async_llm import DPAsyncLLM
from kvflow.entrypoints.openai.api_server import build_app

# One character a token: several full blocks of 16, the part a cache hit covers.
SHARED = "You are the assistant of a small bakery; answer in one short sentence. " * 2
ENGINE = dict(dtype="float32", block_size=16, disable_log_stats=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def served(llm) -> tuple[httpx.Client, object]:
    live = start_thread(build_app(llm, "tiny"))
    return httpx.Client(base_url=live.url, timeout=120), live


@pytest.fixture(scope="module")
def one_engine(model_dir):
    llm = AsyncLLM(LLMEngine(EngineArgs(model_dir, **ENGINE)))
    http, live = served(llm)
    yield llm, http
    live.stop()
    llm.shutdown()


def cache_hits_after(llm, http: httpx.Client, path: str, body: dict) -> int:
    """Prefix-cache hits (tokens) once the request is done and the engine idle again. 16 tokens:
    behind the data-parallel front, a request that ends within a step or two of its admission
    can have its last output reach the server before its acceptance, and then never be answered
    (a race between dp_replica and dp_client, not of the salt)."""
    response = http.post(path, json={**body, "max_tokens": 16, "ignore_eos": True, "temperature": 0})
    assert response.status_code == 200, response.text
    assert wait_until(lambda: llm.get_stats().num_running == 0 and llm.get_stats().kv_cache_usage == 0, 30)
    return llm.get_stats().prefix_cache_hits_total


def assert_only_the_same_salt_hits(llm, http: httpx.Client) -> None:
    for path, body in (("/v1/completions", {"prompt": SHARED}),
                       ("/v1/chat/completions", {"messages": [{"role": "system", "content": SHARED},
                                                              {"role": "user", "content": "Bread?"}]})):
        start = cache_hits_after(llm, http, path, {**body, "cache_salt": "tenant-a"})
        assert cache_hits_after(llm, http, path, {**body, "cache_salt": "tenant-b"}) == start, path
        assert cache_hits_after(llm, http, path, body) == start, path  # no salt is a salt of its own
        assert cache_hits_after(llm, http, path, {**body, "cache_salt": "tenant-a"}) > start, path


def test_only_requests_with_the_same_salt_share_cached_blocks(one_engine):
    assert_only_the_same_salt_hits(*one_engine)


def test_the_salt_reaches_data_parallel_replicas(model_dir):
    # A shared prefix is routed to the replica that has it: without the salt in its hashes the
    # second tenant's request would land beside the first tenant's blocks, and hit them.
    llm = DPAsyncLLM(EngineArgs(model_dir, data_parallel_size=2, **ENGINE))
    http, live = served(llm)
    try:
        assert_only_the_same_salt_hits(llm, http)
    finally:
        live.stop()
        llm.shutdown(timeout=10)


@pytest.mark.parametrize("salt,words", [("", "at least 1 character"), (7, "valid string"), (["a"], "valid string"),
                                        ("s" * 257, "at most 256 characters")])
def test_a_bad_salt_is_a_400_naming_it(one_engine, salt, words):
    _, http = one_engine
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        response = http.post(path, json={**body, "cache_salt": salt})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "cache_salt" and error["message"].startswith("cache_salt: ") and words in error["message"]
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "cache_salt": None}).status_code == 200
