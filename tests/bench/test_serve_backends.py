"""`kvflow bench serve --backend`: the same load through /v1/completions, /v1/chat/completions and
/v1/responses of a real (in-process, tiny-model) kvflow server; every request's tokens and times
are read from that route's own stream format."""

from __future__ import annotations

import asyncio

import live_server
import pytest
from tiny_models import tiny_chat_model

from kvflow import EngineArgs
from kvflow.bench.datasets import SampleRequest
from kvflow.bench.serve import Load, benchmark


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = EngineArgs(model=tiny_chat_model(tmp_path_factory.mktemp("bench-backends")), disable_log_stats=True)
    with live_server.served_engine(args, "tiny") as (server, _):
        yield server


@pytest.mark.parametrize("backend", ["openai", "openai-chat", "openai-responses"])
def test_every_backend_streams_exactly_the_tokens_asked_for(server, backend):
    requests = [SampleRequest([10 + i, 20, 30 + i, 40], 5 + i, 4) for i in range(4)]  # token ids, as the random set
    _, records, _ = asyncio.run(benchmark(server.url, None, requests, Load(concurrency=2), backend=backend))
    assert all(r.ok for r in records), [r.error for r in records]
    assert sorted(r.output_tokens for r in records) == [5, 6, 7, 8]  # ignore_eos held on every route (in finishing order)
    # A token whose text is empty (a special token) sends no text: at most one gap per token after the first.
    assert all(r.prompt_tokens >= 4 and r.ttft > 0 and 0 < len(r.itls) < r.output_tokens for r in records)
