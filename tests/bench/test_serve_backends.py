"""`kvflow bench serve --backend`: the same load through /v1/completions, /v1/chat/completions and
/v1/responses of a real (in-process, tiny-model) kvflow server; every request's tokens and times
are read from that route's own stream format."""

from __future__ import annotations

import asyncio

import live_server
import pytest
from tiny_models import make_tiny_model, write_tiny_tokenizer

from kvflow import AsyncLLM, EngineArgs
from kvflow.bench.datasets import SampleRequest
from kvflow.bench.serve import Load, benchmark
from kvflow.entrypoints.openai.api_server import build_app


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bench-backends")
    make_tiny_model("llama-gqa-llama3-rope", directory)
    write_tiny_tokenizer(directory)
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(directory), disable_log_stats=True))
    server = live_server.start_thread(build_app(engine, "tiny"))
    yield server
    server.stop()
    engine.shutdown()


@pytest.mark.parametrize("backend", ["openai", "openai-chat", "openai-responses"])
def test_every_backend_streams_exactly_the_tokens_asked_for(server, backend):
    requests = [SampleRequest([10 + i, 20, 30 + i, 40], 5 + i, 4) for i in range(4)]  # token ids, as the random set
    _, records, _ = asyncio.run(benchmark(server.url, None, requests, Load(concurrency=2), backend=backend))
    assert all(r.ok for r in records), [r.error for r in records]
    assert [r.output_tokens for r in records] == [5, 6, 7, 8]  # ignore_eos held on every route
    # A token whose text is empty (a special token) sends no text: at most one gap per token after the first.
    assert all(r.prompt_tokens >= 4 and r.ttft > 0 and 0 < len(r.itls) < r.output_tokens for r in records)
