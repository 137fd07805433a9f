"""vLLM's routes beside the OpenAI API, on an in-process server with the default model:
/tokenize (a prompt, or a conversation through the chat template) and /detokenize in vLLM's shapes,
/version, /ping, the API-key rule, and 404s that name the route and what the server offers."""

from __future__ import annotations

import httpx
import live_server
import pytest

import kvflow
from kvflow import AsyncLLM, EngineArgs
from kvflow.entrypoints.openai.api_server import build_app

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine():
    engine = AsyncLLM.from_engine_args(EngineArgs(max_model_len=1024, kv_cache_memory_gb=0.1, disable_log_stats=True))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def url(engine):
    server = live_server.start_thread(build_app(engine, "smol"))
    yield server.url
    server.stop()


def test_tokenize_a_prompt_and_back(url, engine):
    tokenizer = engine.tokenizer
    got = httpx.post(f"{url}/tokenize", json={"model": "smol", "prompt": "Hello world", "return_token_strs": True}).json()
    assert got["tokens"] == tokenizer.encode("Hello world") and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == 1024
    assert "".join(got["token_strs"]).replace("Ġ", " ") == "Hello world"
    back = httpx.post(f"{url}/detokenize", json={"model": "smol", "tokens": got["tokens"]}).json()
    assert back == {"prompt": "Hello world"}


def test_tokenize_a_conversation_counts_what_chat_completions_sends(url, engine):
    got = httpx.post(f"{url}/tokenize", json={"model": "smol", "messages": CHAT}).json()
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": "smol", "messages": CHAT, "max_tokens": 1}).json()
    assert got["count"] == chat["usage"]["prompt_tokens"]
    assert got["tokens"] == engine.tokenizer.apply_chat_template(CHAT, True, tokenize=True)
    bare = httpx.post(f"{url}/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert bare["count"] < got["count"]


@pytest.mark.parametrize("body, message", [
    ({"prompt": "a", "messages": CHAT}, "either prompt or messages"),
    ({}, "either prompt or messages"),
])
def test_tokenize_refuses_what_is_not_one_input(url, body, message):
    r = httpx.post(f"{url}/tokenize", json=body)
    assert r.status_code == 400 and message in r.json()["error"]["message"]


def test_detokenize_names_an_id_the_model_lacks(url, engine):
    r = httpx.post(f"{url}/detokenize", json={"tokens": [1, 10**9]})
    assert r.status_code == 400 and "1000000000 is not a token id" in r.json()["error"]["message"]


def test_version_and_ping(url):
    assert httpx.get(f"{url}/version").json() == {"version": kvflow.__version__}
    assert httpx.get(f"{url}/ping").status_code == 200 and httpx.post(f"{url}/ping").status_code == 200


@pytest.mark.parametrize("path, says", [
    ("/v1/embeddings", "no embedding model"),
    ("/v1/rerank", "no reranking model"),
    ("/v1/nothing", "no such route"),
])
def test_a_missing_route_is_named_with_what_the_server_offers(url, path, says):
    r = httpx.post(f"{url}{path}", json={})
    error = r.json()["error"]
    assert r.status_code == 404 and says in error["message"] and f"POST {path}" in error["message"]
    assert "/v1/chat/completions" in error["message"] and "/tokenize" in error["message"]


def test_tokenize_needs_the_api_key_where_the_server_has_one(engine):
    server = live_server.start_thread(build_app(engine, "smol", api_key="k"))
    try:
        assert httpx.post(f"{server.url}/tokenize", json={"prompt": "a"}).status_code == 401
        ok = httpx.post(f"{server.url}/tokenize", json={"prompt": "a"}, headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200
        assert httpx.get(f"{server.url}/ping").status_code == 200  # open, like /health
    finally:
        server.stop()
