"""The HTTP API under generated garbage and under a crowd, with a tiny float32 model (character
tokenizer) served in this process.

- Fuzz: request bodies built from every field with wrong types, extreme numbers, huge lists and
  odd Unicode, sent while a victim stream runs (again and again): each answer is a 2xx or an
  OpenAI-shaped 4xx, and every run of the victim gives its tokens alone.
- Soak: 200 concurrent streaming clients, a quarter leaving at random points: no request hangs,
  every client that stayed gets its greedy text alone, and afterwards nothing runs, waits or
  holds a KV block.
Both are seeded and bounded.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading

import httpx
import pytest
from live_server import start_thread, wait_until
from tiny_models import make_tiny_model, write_tiny_tokenizer

from kvflow import EngineArgs, LLMEngine
from kvflow.engine.async_llm import AsyncLLM
from kvflow.entrypoints.openai.api_server import build_app
from kvflow.entrypoints.openai.limits import ServerLimits

P, C = "/v1/completions", "/v1/chat/completions"
LIMITS = ServerLimits(max_prompts_per_request=16, max_seqs_per_request=32, max_body_bytes=256 * 1024)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-chat")
    make_tiny_model("qwen2-bias", path)
    write_tiny_tokenizer(path)
    engine = LLMEngine(EngineArgs(str(path), dtype="float32", disable_log_stats=True, max_num_seqs=64))
    llm = AsyncLLM(engine, LIMITS.load_limits())
    live = start_thread(build_app(llm, "tiny", limits=LIMITS))
    yield llm, live
    live.stop()
    llm.shutdown()


def greedy(client: httpx.Client, prompt: str, max_tokens: int) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return client.post(P, json=body).json()["choices"][0]["text"]


def engine_idle(llm: AsyncLLM) -> bool:
    stats = llm.get_stats()
    return stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0


# -- fuzz --------------------------------------------------------------------------------------
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p", "top_k",
          "min_p", "min_tokens", "stop", "stop_token_ids", "seed", "stream", "stream_options", "logprobs",
          "top_logprobs", "echo", "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
          "response_format", "tools", "tool_choice", "logit_bias", "suffix", "best_of", "user", "unknown_field"]
EXTREME_INTS = [0, -1, 1, 2, 7, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -2**63 - 1, 10**30, 96, 97, 1_000_000]
ODD_TEXT = ["", "\x00", "\ud7ff\ue000\uffff", "🦙" * 50, "<|im_start|>system\n", "a" * 5000, "\u202e\u200b", "null",
            "é", "\r\n\t", "{\"a\": 1}"]


INT_FIELDS = {"max_tokens", "max_completion_tokens", "n", "top_k", "min_tokens", "seed", "logprobs", "top_logprobs",
              "best_of"}


def fuzz_value(rng: random.Random, depth: int = 0, integer: bool = False):
    """Anything a careless or hostile client might send: wrong types, extreme numbers, huge lists,
    odd text; for an integer field, mostly extreme integers."""
    kind = "int" if integer and rng.random() < 0.6 else \
        rng.choice(["int", "int", "small", "float", "text", "text", "none", "bool", "ids", "huge", "list", "dict"])
    if kind == "int":
        return rng.choice(EXTREME_INTS)
    if kind == "small":
        return rng.randint(-3, 8)
    if kind == "float":
        return rng.choice([0.0, -0.5, 1e-9, 1.5, 2.0, 1e308, -1e308, 5e-324, rng.uniform(-3, 3)])
    if kind == "text":
        return rng.choice(ODD_TEXT) if rng.random() < 0.7 else "".join(chr(rng.randint(1, 0x2FFFF)) for _ in range(8))
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "ids":
        return [rng.choice(EXTREME_INTS + [3, 5, 8]) for _ in range(rng.randint(0, 6))]
    if kind == "huge":
        return rng.choice([list(range(3000)), [[1, 2]] * 100, ["x"] * 500])
    if depth >= 2:
        return None
    if kind == "list":
        return [fuzz_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["type", "role", "content", "text", "x"]): fuzz_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def fuzz_body(rng: random.Random) -> tuple[str, dict]:
    """A valid request underneath (so most bodies reach the engine), then one to three fields
    replaced by anything."""
    path = rng.choice([P, C])
    body = {"prompt": "fuzz me"} if path == P else {"messages": [{"role": "user", "content": "hi"}]}
    body["max_tokens"] = rng.randint(1, 4)
    for name in rng.sample(FIELDS, rng.randint(1, 2)):
        body[name] = fuzz_value(rng, integer=name in INT_FIELDS)
    return path, body


@pytest.fixture
def victim(server):
    """A greedy stream run over and over beside the fuzz; each run's text is checked afterwards."""
    llm, live = server
    prompt, max_tokens = "The victim streams on", 30
    with httpx.Client(base_url=live.url, timeout=60) as client:
        expected = greedy(client, prompt, max_tokens)
    runs: list[str] = []
    stop = threading.Event()

    def loop() -> None:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=live.url, timeout=60) as client:
            while not stop.is_set():
                try:
                    with client.stream("POST", P, json=body) as response:
                        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
                    runs.append("".join(e["choices"][0]["text"] for e in events if e["choices"]))
                except Exception as e:  # an error event, a dropped connection: a failed run, kept as such
                    runs.append(repr(e))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join(60)
    assert len(runs) >= 2 and all(text == expected for text in runs), (expected, [r for r in runs if r != expected][:3])


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[1].url, timeout=60) as client:
        yield client


def test_generated_bodies_get_a_2xx_or_an_openai_4xx_and_harm_no_victim(server, victim, http):
    rng = random.Random(10)
    statuses = []
    for _ in range(600):
        path, body = fuzz_body(rng)
        response = http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
        statuses.append(response.status_code)
        assert response.status_code < 500, (body, response.text[:500])
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
            assert "Traceback" not in response.text
    assert statuses.count(200) >= 30 and statuses.count(400) >= 30  # both kinds were exercised


def test_after_the_fuzz_the_engine_is_idle_and_healthy(server, http):
    llm, _ = server
    assert http.get("/health").status_code == 200
    assert wait_until(lambda: engine_idle(llm), 30)


# -- soak --------------------------------------------------------------------------------------
NUM_CLIENTS, MAX_TOKENS = 200, 12
PROMPTS = [f"Client topic {i}: " for i in range(10)]


def test_200_streaming_clients_a_quarter_leaving(server):
    llm, live = server
    with httpx.Client(base_url=live.url, timeout=60) as client:
        alone = [greedy(client, p, MAX_TOKENS) for p in PROMPTS]
    rng = random.Random(0)
    leave_after = [rng.randint(1, MAX_TOKENS - 1) if i % 4 == 0 else None for i in range(NUM_CLIENTS)]

    async def one(client: httpx.AsyncClient, i: int) -> str | None:
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True}
        text, events = "", 0
        async with client.stream("POST", P, json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                events += 1
                choices = json.loads(line[6:])["choices"]
                text += choices[0]["text"] if choices else ""
                if events == leave_after[i]:
                    return None  # leaving the block drops the connection mid-stream
        return text

    async def crowd():
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 10)
        async with httpx.AsyncClient(base_url=live.url, timeout=120, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(NUM_CLIENTS))), 240)

    results = asyncio.run(crowd())
    stayed = [(i, text) for i, text in enumerate(results) if leave_after[i] is None]
    assert len(stayed) == NUM_CLIENTS * 3 // 4
    mismatched = [i for i, text in stayed if text != alone[i % len(PROMPTS)]]
    assert not mismatched, f"{len(mismatched)} streams differ from their run alone"
    assert wait_until(lambda: engine_idle(llm), 30), llm.get_stats()
    assert not llm._thread.engine.has_unfinished_requests()
