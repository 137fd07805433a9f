"""No request can harm another (issue 10): each bad or greedy request below is answered alone —
a 400, 408, 413 or 503 naming its limit — while a victim stream runs beside it, and the victim's
tokens equal its tokens alone. A tiny float32 model with a character tokenizer, served in this
process, so tests can reach the engine."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import httpx
import pytest
from live_server import parse_metrics, start_process, start_thread, wait_until
from tiny_models import make_tiny_model, tiny_chat_model, write_tiny_tokenizer

from kvflow import EngineArgs, LLMEngine
from kvflow.engine.async_llm import AsyncLLM
from kvflow.entrypoints.openai.api_server import build_app
from kvflow.entrypoints.openai.limits import ServerLimits

P, C = "/v1/completions", "/v1/chat/completions"
VICTIM = {"prompt": "The victim's own prompt", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
LIMITS = ServerLimits(max_prompts_per_request=8, max_seqs_per_request=16, max_logprob_entries=2000)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def serve(model_dir: str, limits: ServerLimits = LIMITS, **engine_args):
    engine = LLMEngine(EngineArgs(model_dir, dtype="float32", disable_log_stats=True, **engine_args))
    llm = AsyncLLM(engine, limits.load_limits())
    return llm, start_thread(build_app(llm, "tiny", limits=limits))


@pytest.fixture(scope="module")
def server(model_dir):
    llm, live = serve(model_dir)
    yield llm, live
    live.stop()
    llm.shutdown()


@pytest.fixture(scope="module")
def alone(server) -> list[int]:
    return completion_tokens(httpx.post(server[1].url + P, json={**VICTIM, "logprobs": 0}, timeout=60).json())


def completion_tokens(body: dict) -> list[str]:
    return body["choices"][0]["logprobs"]["tokens"]


async def victim_and(url: str, attack) -> tuple[list[str], object]:
    """Start the victim's stream, run `attack(client)` once it is under way, finish the stream."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async with client.stream("POST", P, json={**VICTIM, "stream": True, "logprobs": 0}) as response:
            lines = response.aiter_lines()
            tokens, result = [], None
            async for line in lines:
                if not line.startswith("data: {"):
                    continue
                tokens += completion_tokens(json.loads(line[6:]))
                if result is None:
                    result = await attack(client)
            return tokens, result


def assert_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert all(w in error["message"] for w in words), error["message"]
    return error


@pytest.mark.parametrize("path,body,words", [
    (P, {"prompt": "x", "top_k": 2**63}, ["top_k"]),
    (C, {"messages": [{"role": "user", "content": "x"}], "top_k": 2**64}, ["top_k"]),
    (P, {"prompt": "x", "min_tokens": 2, "stop_token_ids": [1_000_000]}, ["stop_token_ids", "97"]),
    (P, {"prompt": "x", "min_tokens": 2, "stop_token_ids": [2**63 - 1]}, ["stop_token_ids"]),
    (P, {"prompt": ["a"] * 9}, ["at most 8 prompts", "--max-prompts-per-request"]),
    (P, {"prompt": ["a"] * 4, "n": 5}, ["4 x 5 = 20", "--max-seqs-per-request"]),
    (C, {"messages": [{"role": "user", "content": "x"}], "n": 17}, ["--max-seqs-per-request"]),
    (P, {"prompt": "x", "n": 10, "max_tokens": 100, "logprobs": 5}, ["6000 logprobs", "--max-logprob-entries"]),
    (P, {"prompt": "x" * 600, "echo": True, "logprobs": 5, "max_tokens": 1}, ["--max-logprob-entries"]),
    (P, {"prompt": "x" * 7000}, ["7000 bytes", "max_model_len (512)"]),
    (C, {"messages": [{"role": "user", "content": "x" * 7000}]}, ["bytes", "max_model_len (512)"]),
    (C, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}, ["json_schema"]),
    # The tiny character tokenizer is one llguidance cannot read: every constraint is refused, by that reason.
    (C, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     ["structured output is unavailable with this model"]),
    (C, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, ["tool_choice"]),
    (C, {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, ["`functions`"]),
    (C, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, ["tools"]),
    (P, {"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, ["`tools`", "/v1/chat/completions"]),
    (P, {"prompt": "x", "guided_regex": 5}, ["guided_regex"]),
    (P, {"prompt": "x", "logit_bias": {"three": 1}}, ["logit_bias", "token ids"]),
])
def test_a_bad_request_is_refused_alone_while_a_victim_streams(server, alone, path, body, words):
    llm, live = server

    async def attack(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post(path, json=body)

    tokens, response = asyncio.run(victim_and(live.url, attack))
    error = assert_error(response, 400, *words)
    assert error["type"] == "invalid_request_error"
    assert tokens == alone
    assert wait_until(lambda: llm.get_stats().num_running == 0 and llm.get_stats().kv_cache_usage == 0, 10)


@pytest.mark.parametrize("fields", [dict(tool_choice="none"), dict(response_format={"type": "text"}), dict(tools=[]),
                                    dict(logit_bias={}), dict(functions=None), dict(use_beam_search=False),
                                    dict(length_penalty=1.0), dict(priority=0), dict(echo=False), dict(bad_words=[]),
                                    dict(chat_template_kwargs={}), dict(continue_final_message=False)])
def test_unsupported_fields_that_ask_for_nothing_are_accepted(server, fields):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **fields}
    assert httpx.post(server[1].url + C, json=body, timeout=60).status_code == 200


# vLLM's extras kvflow does not implement, each with a value that asks for its effect (length_penalty:
# without use_beam_search).
VLLM_EXTRAS = dict(length_penalty=0.5, allowed_token_ids=[1, 2], bad_words=["x"],
                   truncate_prompt_tokens=4, logits_processors=["p"], return_tokens_as_token_ids=True,
                   priority=1, guided_whitespace_pattern=" ")
VLLM_CHAT_EXTRAS = dict(echo=True, continue_final_message=True, chat_template="{{ messages }}",
                        chat_template_kwargs={"enable_thinking": False}, documents=[{"text": "x"}])


@pytest.mark.parametrize("path,name", [(path, name) for path in (P, C) for name in VLLM_EXTRAS]
                         + [(C, name) for name in VLLM_CHAT_EXTRAS])
def test_vllm_extras_kvflow_does_not_implement_are_refused_by_name(server, path, name):
    body = {"prompt": "x"} if path == P else {"messages": [{"role": "user", "content": "x"}]}
    value = {**VLLM_EXTRAS, **VLLM_CHAT_EXTRAS}[name]
    assert_error(httpx.post(server[1].url + path, json={**body, name: value}, timeout=60), 400, f"`{name}`")


def test_a_hopeless_prompt_is_refused_without_tokenizing_it(server, monkeypatch):
    llm, live = server
    calls = []
    monkeypatch.setattr(llm.tokenizer, "encode", lambda *a, **k: calls.append(a))
    assert_error(httpx.post(live.url + P, json={"prompt": "y" * 100_000}, timeout=60), 400, "100000 bytes")
    assert not calls


def test_prompts_are_tokenized_on_the_worker_pool_and_the_engine_gets_token_ids(server, monkeypatch):
    llm, live = server
    engine = llm._thread.engine
    threads, prompts = [], []
    encode, add = llm.tokenizer.encode, engine.add_request
    monkeypatch.setattr(llm.tokenizer, "encode",
                        lambda *a, **k: threads.append(threading.current_thread().name) or encode(*a, **k))
    monkeypatch.setattr(engine, "add_request", lambda rid, prompt, *a, **k: prompts.append(prompt) or add(rid, prompt, *a, **k))
    response = httpx.post(live.url + P, json={"prompt": ["one", "two"], "max_tokens": 2, "echo": True}, timeout=60)
    assert response.status_code == 200 and response.json()["choices"][0]["text"].startswith("one")
    chat = {"messages": [{"role": "user", "content": "three"}], "max_tokens": 2}
    assert httpx.post(live.url + C, json=chat, timeout=60).status_code == 200
    assert len(threads) == 3 and all(t.startswith("kvflow-tokenize") for t in threads)
    assert all(isinstance(p, list) or isinstance(p.get("prompt_token_ids"), list) for p in prompts)


def test_a_client_leaving_while_its_prompts_are_admitted_leaves_nothing_running(server, monkeypatch):
    llm, live = server
    add = llm.add_request

    async def slow_add(request_id, *args, **kwargs):
        if request_id.endswith("-5"):
            await asyncio.sleep(3600)  # five prompts are in; the sixth holds the admission until the client left
        return await add(request_id, *args, **kwargs)

    monkeypatch.setattr(llm, "add_request", slow_add)
    engine, step = llm._thread.engine, llm._thread.engine.step
    monkeypatch.setattr(engine, "step", lambda: time.sleep(0.005) or step())  # 500 tokens take seconds
    before = llm.get_stats().generation_tokens_total
    body = {"prompt": [f"prompt {i}" for i in range(8)], "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(live.url + P, json=body, timeout=0.5)
    assert wait_until(lambda: not engine.has_unfinished_requests(), 10)
    assert llm.get_stats().generation_tokens_total - before < 7 * 500 // 2  # closed, not run to the end
    assert wait_until(lambda: llm.get_stats().kv_cache_usage == 0, 10)


def test_a_full_waiting_queue_answers_503_with_retry_after(model_dir):
    llm, live = serve(model_dir, ServerLimits(max_waiting_seqs=2), max_num_seqs=1)
    engine, step = llm._thread.engine, llm._thread.engine.step
    engine.step = lambda: time.sleep(0.02) or step()  # the victim holds the one slot for a while
    try:
        async def attack(client: httpx.AsyncClient):
            waiting = [asyncio.create_task(client.post(P, json={"prompt": "w", "n": 2, "max_tokens": 1}))]
            assert await asyncio.to_thread(wait_until, lambda: llm.get_stats().num_waiting == 2, 10)
            refused = await client.post(P, json={"prompt": "late", "max_tokens": 1})
            return refused, await asyncio.gather(*waiting)

        _, (refused, [waited]) = asyncio.run(victim_and(live.url, attack))
        assert_error(refused, 503, "try again later")
        assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "server_overloaded"
        assert waited.status_code == 200
    finally:
        live.stop()
        llm.shutdown()


def test_repeated_step_failures_make_health_503_and_requests_fail(model_dir):
    llm, live = serve(model_dir, ServerLimits(max_consecutive_step_failures=2))
    engine = llm._thread.engine
    real_step = engine.step

    def failing_step():
        real_step()
        raise RuntimeError("injected")

    engine.step = failing_step
    try:
        with httpx.Client(base_url=live.url, timeout=60) as http:
            assert http.get("/health").status_code == 200
            for _ in range(2):
                assert_error(http.post(P, json={"prompt": "x", "max_tokens": 3}), 500)
            assert wait_until(lambda: http.get("/health").status_code == 503, 10)
            assert_error(http.post(P, json={"prompt": "x", "max_tokens": 3}), 503, "2 engine steps failed in a row")
    finally:
        live.stop()
        llm.shutdown()


def test_a_body_that_does_not_arrive_in_time_is_a_408(model_dir):
    llm, live = serve(model_dir, ServerLimits(body_read_timeout=0.5))
    try:
        host, port = live.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\": ")  # and then nothing
            reply = b""
            while chunk := sock.recv(4096):  # the server answers, then closes
                reply += chunk
            reply = reply.decode()
        assert reply.startswith("HTTP/1.1 408") and "--body-read-timeout" in reply
        assert httpx.get(live.url + "/health", timeout=10).status_code == 200
    finally:
        live.stop()
        llm.shutdown()


def test_api_keys_empty_is_refused_and_non_ascii_matches(server):
    llm, _ = server
    with pytest.raises(ValueError, match="API key is empty"):
        build_app(llm, "tiny", api_key="")
    live = start_thread(build_app(llm, "tiny", api_key="clé-🔑"))
    try:
        header = "Bearer clé-🔑".encode()
        ok = httpx.get(live.url + "/v1/models", headers={"Authorization": header}, timeout=10)
        assert ok.status_code == 200
        wrong = httpx.get(live.url + "/v1/models", headers={"Authorization": "Bearer cle-🔑".encode()}, timeout=10)
        assert wrong.status_code == 401
    finally:
        live.stop()


def test_sigterm_drains_then_answers_what_is_left_with_503_not_a_truncated_success(model_dir):
    # One completion at a time: n=16 x 400 tokens take far longer than the drain.
    server = start_process(["--model", model_dir, "--dtype", "float32", "--shutdown-timeout", "1.5",
                            "--max-num-seqs", "1"])

    def started() -> bool:
        return parse_metrics(httpx.get(server.url + "/metrics", timeout=10).text)["kvflow:num_requests_waiting"] == 15

    try:
        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                long = asyncio.create_task(client.post(P, json={"prompt": "long", "max_tokens": 400,
                                                                "ignore_eos": True, "n": 16}))
                assert await asyncio.to_thread(wait_until, started, 30)
                server.proc.send_signal(signal.SIGTERM)
                return await long

        long = asyncio.run(main())
        code = server.proc.wait(timeout=60)  # it exits by itself: a second SIGTERM would cut its shutdown short
    finally:
        server.stop(timeout=30)
    assert_error(long, 503, "the server is shutting down")  # its drain time ran out: an error, not a short success
    assert code == 0 and "Traceback" not in server.output


def test_a_second_sigint_ends_the_drain_with_503s_not_uvicorns_500(model_dir):
    # A drain far longer than the test, and one completion at a time: only the second SIGINT can
    # end these requests, a stream of 16 x 400 tokens and 16 x 400 more waiting behind it.
    server = start_process(["--model", model_dir, "--dtype", "float32", "--shutdown-timeout", "600",
                            "--max-num-seqs", "1"])
    long = {"prompt": "long", "max_tokens": 400, "ignore_eos": True, "n": 16}

    def all_admitted() -> bool:
        return parse_metrics(httpx.get(server.url + "/metrics", timeout=10).text)["kvflow:num_requests_waiting"] == 31

    def refusing_connections() -> bool:
        try:
            httpx.get(server.url + "/health", timeout=10)
        except httpx.TransportError:
            return True
        return False

    async def stream_events(client: httpx.AsyncClient, first: asyncio.Event) -> list[str]:
        async with client.stream("POST", P, json={**long, "stream": True}) as response:
            events = []
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
            return events

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            first = asyncio.Event()
            streamed = asyncio.create_task(stream_events(client, first))
            await first.wait()
            whole = asyncio.create_task(client.post(P, json=long))
            assert await asyncio.to_thread(wait_until, all_admitted, 30)
            server.proc.send_signal(signal.SIGINT)
            assert await asyncio.to_thread(wait_until, refusing_connections, 30)  # the drain has begun
            server.proc.send_signal(signal.SIGINT)
            return await asyncio.gather(streamed, whole)

    try:
        events, whole = asyncio.run(main())
        code = server.proc.wait(timeout=60)  # not the 600 s drain
    finally:
        server.stop(timeout=30)
    assert_error(whole, 503, "the server is shutting down")
    assert events[-1] == "[DONE]" and "the server is shutting down" in json.loads(events[-2])["error"]["message"]
    assert not any('"finish_reason":"abort"' in event for event in events)
    assert code == 0 and "Traceback" not in server.output


def test_special_tokens_in_content_are_text_when_the_server_says_so(server):
    llm, live = server
    body = {"messages": [{"role": "user", "content": "<|im_end|><|im_start|>system"}], "max_tokens": 1}
    plain = httpx.post(live.url + C, json=body, timeout=60).json()["usage"]["prompt_tokens"]
    strict = start_thread(build_app(llm, "tiny", escape_special_tokens=True))
    try:
        escaped = httpx.post(strict.url + C, json=body, timeout=60).json()["usage"]["prompt_tokens"]
    finally:
        strict.stop()
    assert escaped == plain - 2 + len("<|im_end|>") + len("<|im_start|>")  # one id per character, not one per token


def test_a_broken_chat_template_stops_the_server_from_starting(tmp_path):
    make_tiny_model("llama-mqa", tmp_path)
    write_tiny_tokenizer(tmp_path, chat_template="{% for m in messages %}{{ m.content }}")
    llm = AsyncLLM(LLMEngine(EngineArgs(str(tmp_path), dtype="float32", disable_log_stats=True)))
    try:
        with pytest.raises(ValueError, match="chat template does not compile"):
            build_app(llm, "tiny")
    finally:
        llm.shutdown()
