"""Load on a live `kvflow serve` (loopback only): 64 concurrent streaming clients all complete with
the same greedy text as isolated runs; clients that vanish mid-stream leave no KV blocks behind;
the server stays healthy; and a server stopped by SIGINT with a stream in flight exits 0.

float32, because greedy text must not depend on the batch a request lands in: in bf16 the
rounding of a batched matmul differs from a lone one and can flip an argmax.
"""

from __future__ import annotations

import asyncio
import signal

import httpx
import live_server
import openai
import pytest
from live_server import parse_metrics, start_process, wait_until

pytestmark = pytest.mark.slow
own_server = live_server.own_server  # a fixture: pytest finds it by its name here

MODEL = "smol"
NUM_CLIENTS = 64
MAX_TOKENS = 12
TOPICS = ["the sea", "mountains", "bread", "the moon"]  # clients share prompts: the prefix cache gets hits


def question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Tell me one fact about {TOPICS[i % len(TOPICS)]}."}]


SERVE = ["--dtype", "float32", "--served-model-name", MODEL]


@pytest.fixture(scope="module")
def server():
    proc = start_process(SERVE)
    yield proc
    proc.stop()


def metrics(server) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{server.url}/metrics", timeout=10).text)


def engine_idle(server) -> bool:
    m = metrics(server)
    return m["kvflow:kv_cache_usage_perc"] == 0 and m["kvflow:num_requests_running"] == 0 \
        and m["kvflow:num_requests_waiting"] == 0


async def stream_chat(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
    stream = await client.chat.completions.create(model=MODEL, messages=question(i), temperature=0,
                                                  max_tokens=MAX_TOKENS, stream=True)
    text, finish = [], None
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def test_64_concurrent_streams_all_complete_with_isolated_greedy_text(server):
    sync = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    isolated = [sync.chat.completions.create(model=MODEL, messages=question(i), temperature=0, max_tokens=MAX_TOKENS)
                .choices[0].message.content for i in range(len(TOPICS))]

    async def crowd():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=240)
        try:
            return await asyncio.wait_for(asyncio.gather(*(stream_chat(client, i) for i in range(NUM_CLIENTS))), 300)
        finally:
            await client.close()

    results = asyncio.run(crowd())
    assert all(finish in ("stop", "length") for _, finish in results)
    mismatched = [i for i, (text, _) in enumerate(results) if text != isolated[i % len(TOPICS)]]
    assert not mismatched, f"{len(mismatched)} of {NUM_CLIENTS} differ from their isolated run"
    assert metrics(server)["kvflow:prefix_cache_hits_total"] > 0
    assert wait_until(lambda: engine_idle(server), 10)


def test_clients_leaving_mid_stream_free_their_blocks(server):
    before = metrics(server)["kvflow:generation_tokens_total"]
    body = {"messages": question(0), "max_tokens": 1000, "ignore_eos": True, "stream": True}

    async def leave_after_two_chunks(client: httpx.AsyncClient) -> int:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data:")
                if seen == 2:
                    return seen  # leaving the block drops the connection mid-stream
        return seen

    async def crowd():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.wait_for(asyncio.gather(*(leave_after_two_chunks(client) for _ in range(16))), 120)

    assert asyncio.run(crowd()) == [2] * 16
    assert wait_until(lambda: engine_idle(server), 30), metrics(server)
    assert metrics(server)["kvflow:generation_tokens_total"] - before < 16 * 100  # aborted, not run to 1000
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    again = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": question(1), "max_tokens": 3}, timeout=60)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] <= 3


def test_sigint_shuts_down_cleanly(own_server):
    server = own_server([*SERVE, "--shutdown-timeout", "1"])
    body = {"messages": question(0), "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        server.proc.send_signal(signal.SIGINT)
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    assert server.stop(timeout=30) == 0
    assert "Traceback" not in server.output
