"""`kvflow router` in front of a prefill server and a decode server (real `kvflow serve`
processes sharing a KV store): answers equal one engine's, streamed or not, and every transferred
block is deleted once its request ends."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from disagg_stores import Store
from live_server import parse_metrics, start_process, start_thread
from redis_server import needs_redis
from tiny_models import tiny_chat_model

from kvflow import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from kvflow.entrypoints.router import build_router_app

PROMPTS = ["hello world " * 9, "the quick brown fox", "a"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module", params=["directory", pytest.param("redis", marks=needs_redis)])
def routed(request, model_dir, tmp_path_factory):
    """A router, a prefill and a decode server (processes) and the store they share: a directory,
    or a Redis server (here on this host; to the engines, another)."""
    store = Store(request.param, tmp_path_factory.mktemp("kv-store"))
    common = ["--model", model_dir, "--dtype", "float32", "--block-size", "8", "--attention-backend", "torch_reference"]
    servers = [start_process([*common, "--kv-transfer-config", json.dumps(store.config(role))])
               for role in ("kv_producer", "kv_consumer")]
    router = start_thread(build_router_app([servers[0].url], [servers[1].url]))
    yield router.url, store, [s.url for s in servers]
    router.stop()
    for server in servers:
        server.stop()
    if store.server is not None:
        store.server.stop()


def _reference(model_dir) -> list[str]:
    engine = LLMEngine(EngineArgs(model=model_dir, dtype="float32", block_size=8, attention_backend="torch_reference",
                                  disable_log_stats=True, enable_prefix_caching=False))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.outputs[0].text) for o in engine.step() if o.finished)
    return [done[str(i)] for i in range(len(PROMPTS))]


def test_routed_completions_equal_one_engine_and_leave_the_store_empty(routed, model_dir):
    url, store, (prefill, decode) = routed
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    texts = []
    for prompt in PROMPTS:
        body = {"model": model_dir, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        texts.append(answer.json()["choices"][0]["text"])
    assert texts == _reference(model_dir)
    streamed = httpx.post(url + "/v1/completions", json={"model": model_dir, "prompt": PROMPTS[0], "max_tokens": 8,
                                                         "temperature": 0, "ignore_eos": True, "stream": True},
                          timeout=120)
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == texts[0]
    assert store.contents() == []
    # The decode server loaded every block the prefill server saved (no prefix was found locally
    # but the repeated prompt's, and the store is one-use: the second time, its own cache served it).
    moved = [parse_metrics(httpx.get(u + "/metrics", timeout=10).text)["kvflow:kv_transfer_bytes_total"]
             for u in (prefill, decode)]
    assert moved[1] > 0 and moved[0] >= moved[1]


def test_a_bad_request_is_answered_by_the_prefill_server_and_reaches_no_decode(routed):
    url, store, _ = routed
    answer = httpx.post(url + "/v1/completions", json={"prompt": "x", "temperature": -1}, timeout=60)
    assert answer.status_code == 400 and "temperature" in answer.text
    assert httpx.post(url + "/v1/completions", content=b"not json", timeout=60).status_code == 400
    assert store.contents() == []


def test_the_router_says_where_it_listens_and_what_it_routes_to():
    down = ["http://127.0.0.1:9", "http://127.0.0.1:10"]  # nothing listens there
    router = start_process(["--prefill", down[0], "--decode", down[1]], timeout=60, command="router")
    try:
        assert re.search(rf"kvflow: router on {router.url} \(prefill: {down[0]}; decode: {down[1]}\), ready \d+\.\d s",
                         router.output)
        assert httpx.get(router.url + "/health", timeout=30).status_code == 503  # it answers, naming the down ones
    finally:
        router.stop()
