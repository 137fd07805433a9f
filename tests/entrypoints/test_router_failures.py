"""`kvflow router` when its servers fail (real `kvflow serve` processes, frozen with SIGSTOP and
killed with SIGKILL): requests in flight end within seconds, with an error naming the server or
served by another server of the role; the failed server is skipped and named by /health until its
/health is back; a stream that loses its decode server ends with an error event, not a cut; the
servers that survive hold no KV blocks afterwards; nothing hangs."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from live_server import parse_metrics, start_process, start_thread, wait_until
from tiny_models import make_tiny_model, write_tiny_tokenizer

from kvflow.entrypoints.router import build_router_app

SLACK = 10.0  # seconds: "within seconds" on a loaded 2-core machine (in practice well under one)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two prefill servers and two decode servers sharing one KV store: P1, P2, D1, D2."""
    model = tmp_path_factory.mktemp("tiny-chat")
    make_tiny_model("llama-gqa-llama3-rope", model)
    write_tiny_tokenizer(model)
    store = tmp_path_factory.mktemp("kv-store")
    common = ["--model", str(model), "--dtype", "float32", "--block-size", "8", "--attention-backend", "torch_reference"]
    roles = ("kv_producer", "kv_producer", "kv_consumer", "kv_consumer")
    args = [[*common, "--kv-transfer-config", json.dumps({"kv_role": role, "kv_connector_extra_config":
                                                         {"shared_storage_path": str(store)}})] for role in roles]
    # They load in parallel. The pool's threads must outlive the servers: each server dies with the
    # thread that started it (PR_SET_PDEATHSIG is per thread), so the pool is shut down last.
    pool = ThreadPoolExecutor(len(args))
    started = list(pool.map(start_process, args))
    yield started
    for server in started:
        if server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGCONT)  # a frozen server would not hear SIGTERM
        server.stop()
    pool.shutdown()


def body(prompt: str = "hello world " * 5, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}


def post(url: str, payload: dict) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    answer = httpx.post(url + "/v1/completions", json=payload, timeout=120)
    return answer, time.monotonic() - start


def holds_no_blocks(*servers) -> bool:
    return all(parse_metrics(httpx.get(s.url + "/metrics", timeout=30).text)["kvflow:kv_cache_usage_perc"] == 0
               for s in servers)


def test_a_prefill_server_that_times_out_is_skipped_until_its_health_is_back(servers):
    p1, _, d1, _ = servers
    router = start_thread(build_router_app([p1.url], [d1.url], prefill_timeout_s=2, down_cooldown_s=0.5))
    try:
        expected, _ = post(router.url, body())
        assert expected.status_code == 200, expected.text
        os.kill(p1.proc.pid, signal.SIGSTOP)
        answer, took = post(router.url, body())
        assert answer.status_code == 504 and took < 2 + SLACK, (answer.text, took)
        error = answer.json()["error"]
        assert f"prefill server {p1.url} did not answer within 2 s" in error["message"]
        assert error["code"] == "upstream_timeout" and error["type"] == "server_error"
        answer, took = post(router.url, body())  # skipped (or asked its /health, which times out too)
        assert answer.status_code == 503 and "no prefill server is up" in answer.text and p1.url in answer.text
        health = httpx.get(router.url + "/health", timeout=60)
        assert health.status_code == 503 and health.json()["unhealthy"] == [p1.url]
        os.kill(p1.proc.pid, signal.SIGCONT)
        time.sleep(0.6)  # the cooldown: the next request asks its /health, which now answers
        again, _ = post(router.url, body())
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected.json()["choices"][0]["text"]
        assert httpx.get(router.url + "/health", timeout=60).status_code == 200
    finally:
        os.kill(p1.proc.pid, signal.SIGCONT)
        router.stop()


def test_a_stream_that_loses_its_decode_server_ends_with_an_error_event_and_the_other_serves(servers):
    p1, _, d1, d2 = servers
    router = start_thread(build_router_app([p1.url], [d1.url, d2.url], down_cooldown_s=60))
    try:
        streamed = body(max_tokens=400, stream=True)  # the first request goes to D1; 400 tokens outlast the kill
        with httpx.stream("POST", router.url + "/v1/completions", json=streamed, timeout=120) as answer:
            assert answer.status_code == 200
            lines = answer.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            assert json.loads(first[6:])["choices"][0]["text"] is not None
            d1.proc.kill()
            killed_at = time.monotonic()
            rest = [line for line in lines if line.startswith("data: ")]
        took = time.monotonic() - killed_at
        assert rest[-1] == "data: [DONE]" and took < SLACK, (rest[-3:], took)
        error = json.loads(rest[-2][6:])["error"]
        assert f"decode server {d1.url} broke off its answer" in error["message"] and error["code"] == "upstream_failed"
        texts = []
        for _ in range(2):  # one in D2's turn, one in dead D1's turn: both served by D2
            answer, took = post(router.url, body())
            assert answer.status_code == 200 and took < SLACK, answer.text
            texts.append(answer.json()["choices"][0]["text"])
        assert texts[0] == texts[1]
        health = httpx.get(router.url + "/health", timeout=60)
        assert health.status_code == 503 and health.json()["unhealthy"] == [d1.url]
        assert f"decode server {d1.url} could not be reached" in health.json()["reasons"][d1.url]
        assert wait_until(lambda: holds_no_blocks(p1, d2), 10)
    finally:
        router.stop()


def test_a_prefill_server_killed_mid_run_hands_its_requests_to_the_other(servers):
    p1, p2, _, d2 = servers
    router = start_thread(build_router_app([p1.url, p2.url], [d2.url], down_cooldown_s=60))
    try:
        expected, _ = post(router.url, body())
        assert expected.status_code == 200, expected.text
        os.kill(p1.proc.pid, signal.SIGSTOP)  # requests reach it and wait; then it dies under them
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(post, router.url, body()) for _ in range(4)]
            time.sleep(1.0)
            p1.proc.kill()
            killed_at = time.monotonic()
            answers = [f.result()[0] for f in futures]
        assert time.monotonic() - killed_at < SLACK
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        assert {a.json()["choices"][0]["text"] for a in answers} == {expected.json()["choices"][0]["text"]}
        for _ in range(2):  # the next requests skip it
            answer, took = post(router.url, body())
            assert answer.status_code == 200 and took < SLACK
        health = httpx.get(router.url + "/health", timeout=60)
        assert health.status_code == 503 and health.json()["unhealthy"] == [p1.url]
        assert wait_until(lambda: holds_no_blocks(p2, d2), 10)
    finally:
        router.stop()


def test_the_only_prefill_server_killed_mid_run_ends_its_requests_with_errors(servers):
    _, p2, _, d2 = servers
    router = start_thread(build_router_app([p2.url], [d2.url], down_cooldown_s=60))
    try:
        os.kill(p2.proc.pid, signal.SIGSTOP)
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(post, router.url, body(stream=stream)) for stream in (False, True)]
            time.sleep(1.0)
            p2.proc.kill()
            killed_at = time.monotonic()
            answers = [f.result()[0] for f in futures]
        assert time.monotonic() - killed_at < SLACK
        for answer in answers:
            assert answer.status_code == 502, answer.text
            assert f"prefill server {p2.url} broke off its answer" in answer.json()["error"]["message"]
        answer, took = post(router.url, body())
        assert answer.status_code == 503 and took < SLACK
        assert f"no prefill server is up ({p2.url} broke off its answer" in answer.json()["error"]["message"]
        health = httpx.get(router.url + "/health", timeout=60)
        assert health.status_code == 503 and health.json()["unhealthy"] == [p2.url]
        assert wait_until(lambda: holds_no_blocks(d2), 10)
    finally:
        router.stop()


def test_bad_router_timeouts_are_refused_by_flag():
    with pytest.raises(ValueError, match="--prefill-timeout-s must be a number > 0"):
        build_router_app(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], prefill_timeout_s=0)
    with pytest.raises(ValueError, match="at least one --decode server"):
        build_router_app(["http://127.0.0.1:1"], [])
