"""`kvflow bench serve` against a stub OpenAI-compatible server with injected timings.

The stub (a bare `asyncio.start_server` HTTP responder on a background thread) waits TTFT
before its first text chunk and ITL between chunks, so the latencies the load generator
measures have known lower bounds; the statistics themselves are checked exactly on
hand-written records.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass

import pytest

from kvflow.bench.datasets import DatasetConfig, LengthDist, SampleRequest, build_dataset, parse_length_dist
from kvflow.bench.report import SLO, RequestRecord, format_report, summarize
from kvflow.bench.serve import Load, arrival_offsets, benchmark, check_loopback, main_serve

TTFT_S, ITL_S = 0.04, 0.02
SLACK_S = 0.08  # a shared 2-core machine may add this much to any sleep; never subtracts
STAT_KEYS = {"mean", "p50", "p90", "p99"}


@dataclass
class StubServer:
    port: int
    in_flight: int = 0
    max_in_flight: int = 0
    requests: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def _handle(stub: StubServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    method, path, _ = head.split("\r\n")[0].split(" ")
    length = next((int(h.split(":")[1]) for h in head.split("\r\n") if h.lower().startswith("content-length")), 0)
    body = json.loads(await reader.readexactly(length)) if length else {}
    if method == "GET" and path == "/v1/models":
        payload = json.dumps({"object": "list", "data": [{"id": "stub-model"}]}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(payload), payload))
    elif body.get("prompt") == "FAIL":
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\nConnection: close\r\n\r\nboom")
    else:
        await _stream(stub, body, writer)
    await writer.drain()
    writer.close()


async def _stream(stub: StubServer, body: dict, writer: asyncio.StreamWriter) -> None:
    stub.requests += 1
    stub.in_flight += 1
    stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
    n = body["max_tokens"]
    for i in range(n):
        await asyncio.sleep(TTFT_S if i == 0 else ITL_S)
        writer.write(b"data: %s\n\n" % json.dumps({"choices": [{"index": 0, "text": f"t{i}"}]}).encode())
        await writer.drain()
    prompt_tokens = len(body["prompt"]) if isinstance(body["prompt"], list) else 3
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
    writer.write(b"data: %s\n\ndata: [DONE]\n\n" % json.dumps({"choices": [], "usage": usage}).encode())
    stub.in_flight -= 1


@pytest.fixture
def stub():
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict = {}

    async def start() -> None:
        server = await asyncio.start_server(lambda r, w: _handle(holder["stub"], r, w), "127.0.0.1", 0)
        holder["stub"] = StubServer(server.sockets[0].getsockname()[1])
        holder["server"] = server
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    ready.wait(10)
    yield holder["stub"]
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _requests(n: int, output_len: int) -> list[SampleRequest]:
    return [SampleRequest([1000 + i, 2000 + i], output_len, 2) for i in range(n)]


# ---- statistics on known timings ------------------------------------------------------------


def _record(ttft: float, e2e: float, n: int) -> RequestRecord:
    gap = (e2e - ttft) / (n - 1)
    return RequestRecord(ok=True, ttft=ttft, itls=(gap,) * (n - 1), e2e=e2e, prompt_tokens=10, output_tokens=n)


def test_summary_percentiles_and_goodput_on_known_timings():
    # TTFTs 0.1..0.4 s; each request decodes 5 tokens at 10, 20, 30, 40 ms per token.
    records = [_record(0.1 * k, 0.1 * k + 4 * 0.01 * k, 5) for k in (1, 2, 3, 4)]
    records.append(RequestRecord(ok=False, error="HTTP 500: boom"))
    report = summarize(records, duration_s=2.0, slo=SLO.parse(["ttft:250", "tpot:35"]))
    assert (report["completed"], report["errors"]) == (4, 1)
    assert report["error_samples"] == ["HTTP 500: boom"]
    # Linear interpolation over [100, 200, 300, 400] ms: p50 250, p90 370, p99 397.
    assert report["ttft_ms"] == pytest.approx({"mean": 250, "p50": 250, "p90": 370, "p99": 397})
    assert report["tpot_ms"] == pytest.approx({"mean": 25, "p50": 25, "p90": 37, "p99": 39.7})
    assert report["itl_ms"]["mean"] == pytest.approx(25) and report["itl_ms"]["p50"] == pytest.approx(25)
    assert report["e2e_ms"]["p50"] == pytest.approx((0.28 + 0.42) / 2 * 1e3)  # E2E = 1.4·TTFT
    assert report["request_throughput"] == pytest.approx(2.0)
    assert report["output_tok_s"] == pytest.approx(10.0) and report["total_tok_s"] == pytest.approx(30.0)
    # Only the first two meet TTFT <= 250 ms, and both have TPOT <= 35 ms: 2 good in 2 s.
    assert report["goodput"] == {"slo_ms": {"ttft_ms": 250, "tpot_ms": 35}, "requests": 2, "request_throughput": 1.0}
    text = format_report(report)
    assert "goodput 1.00 req/s (2 requests met TTFT <= 250 ms, TPOT <= 35 ms)" in text
    assert "TTFT   mean     250.0   p50     250.0   p90     370.0   p99     397.0 ms" in text


def test_slo_edge_cases():
    one_token = RequestRecord(ok=True, ttft=0.1, e2e=0.1, output_tokens=1)
    assert one_token.tpot is None and SLO(tpot_ms=1).met_by(one_token)  # no decode, no TPOT miss
    assert not SLO(e2e_ms=99).met_by(one_token) and SLO(e2e_ms=100).met_by(one_token)
    with pytest.raises(ValueError, match="ttft:MS"):
        SLO.parse(["latency:5"])
    assert summarize([RequestRecord(ok=False, error="x")], 1.0)["ttft_ms"] is None


# ---- against the stub server ----------------------------------------------------------------


def test_closed_loop_keeps_concurrency_and_measures_injected_timings(stub):
    name, records, duration = asyncio.run(benchmark(stub.url, None, _requests(8, 4), Load(concurrency=2)))
    assert name == "stub-model" and stub.max_in_flight == 2 and stub.requests == 8
    report = summarize(records, duration)
    assert (report["completed"], report["errors"], report["output_tokens"], report["prompt_tokens"]) == (8, 0, 32, 16)
    for key, injected in (("ttft_ms", TTFT_S), ("itl_ms", ITL_S), ("tpot_ms", ITL_S), ("e2e_ms", TTFT_S + 3 * ITL_S)):
        assert set(report[key]) == STAT_KEYS
        assert injected * 1e3 - 1 <= report[key]["p50"] <= (injected + SLACK_S) * 1e3, key
    assert duration >= 4 * (TTFT_S + 3 * ITL_S)  # 8 requests, 2 at a time, back to back


def test_open_loop_all_at_once_respects_max_concurrency(stub):
    load = Load(request_rate=float("inf"), max_concurrency=3)
    _, records, _ = asyncio.run(benchmark(stub.url, "m", _requests(7, 2), load))
    assert len(records) == 7 and all(r.ok for r in records) and stub.max_in_flight == 3


def test_arrival_offsets_are_seeded_poisson():
    offsets = arrival_offsets(4000, rate=8.0, seed=1)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0 and min(gaps) >= 0
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 8, rel=0.05)
    assert offsets == arrival_offsets(4000, rate=8.0, seed=1) != arrival_offsets(4000, rate=8.0, seed=2)
    assert arrival_offsets(3, float("inf"), 0) == [0.0, 0.0, 0.0]


def test_duration_bounds_the_run(stub):
    _, records, duration = asyncio.run(benchmark(stub.url, "m", _requests(50, 3), Load(concurrency=1, duration_s=0.15)))
    assert 1 <= len(records) < 50 and duration < 0.15 + 3 * (TTFT_S + 2 * ITL_S + SLACK_S)


def test_cli_json_schema_and_errors(stub, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\n\nFAIL\nsecond line\n")
    out = tmp_path / "report.json"
    argv = ["--url", stub.url, "--num-prompts", "6", "--concurrency", "3", "--dataset", str(prompts),
            "--output-len", "3", "--goodput", "ttft:10000", "--json", "--output-json", str(out)]
    assert main_serve(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(out.read_text())
    assert set(report) == {
        "date", "url", "model", "backend", "dataset", "num_prompts", "concurrency", "request_rate", "max_concurrency",
        "completed", "errors", "duration_s", "prompt_tokens", "output_tokens", "request_throughput",
        "output_tok_s", "total_tok_s", "ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "error_samples", "goodput",
    }
    assert all(set(report[k]) == STAT_KEYS for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"))
    # Lines cycle: hello, FAIL, second, hello, FAIL, second.
    assert (report["completed"], report["errors"], report["goodput"]["requests"]) == (4, 2, 4)
    assert report["error_samples"] == ["HTTP 500: boom"] and report["model"] == "stub-model"


def test_sweep_writes_plot_and_one_report_per_concurrency(stub, tmp_path, capsys):
    plot = tmp_path / "sweep.png"
    argv = ["--url", stub.url + "/v1", "--num-prompts", "4", "--sweep-concurrency", "1,2",
            "--input-len", "8", "--output-len", "2", "--plot", str(plot), "--json"]
    assert main_serve(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["concurrency"] for r in result["sweep"]] == [1, 2]
    assert all(r["completed"] == 4 for r in result["sweep"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_remote_urls_are_refused_unless_allowed(capsys):
    for url in ("http://127.0.0.2:8000", "http://[::1]:8000", "http://localhost:1"):
        check_loopback(url, allow_remote=False)
    with pytest.raises(ValueError, match="--allow-remote"):
        check_loopback("http://10.0.0.5:8000", allow_remote=False)
    check_loopback("http://example.com", allow_remote=True)
    assert main_serve(["--url", "http://example.com", "--num-prompts", "1", "--concurrency", "1"]) == 2
    assert "--allow-remote" in capsys.readouterr().err


# ---- datasets ------------------------------------------------------------------------------


def test_datasets_are_seeded_and_shaped():
    inp, out = LengthDist("uniform", 100, 0.5), LengthDist("fixed", 7)
    a = build_dataset(DatasetConfig("random", 50, inp, out, seed=3))
    assert a == build_dataset(DatasetConfig("random", 50, inp, out, seed=3))
    assert all(50 <= r.prompt_len == len(r.prompt) <= 150 and r.output_len == 7 for r in a)
    assert all(1000 <= t < 49152 for r in a for t in r.prompt)
    five = LengthDist("fixed", 5)
    shared = build_dataset(DatasetConfig("shared-prefix", 6, five, out, prefix_len=20, num_prefixes=2))
    assert [r.prompt[:20] == shared[i % 2].prompt[:20] for i, r in enumerate(shared)] == [True] * 6
    assert shared[0].prompt[:20] != shared[1].prompt[:20] and all(r.prompt_len == 25 for r in shared)
    assert parse_length_dist("normal:0.2", 64) == LengthDist("normal", 64, 0.2)
    with pytest.raises(ValueError, match="length distribution"):
        parse_length_dist("zipf", 64)
    with pytest.raises(ValueError, match="neither"):
        build_dataset(DatasetConfig("/no/such/file", 1, inp, out))


def test_bad_loads_are_refused_before_sending(capsys):
    for bad in (dict(concurrency=0), dict(request_rate=0.0), dict(), dict(concurrency=2, request_rate=1.0)):
        with pytest.raises(ValueError):
            Load(**bad)
    assert main_serve(["--num-prompts", "2", "--request-rate", "-1"]) == 2
    assert "request rate must be > 0" in capsys.readouterr().err


def test_add_serve_bench_parser_registers_subcommand():
    import argparse

    from kvflow.bench.serve import add_serve_bench_parser, run_serve

    parser = argparse.ArgumentParser(prog="kvflow")
    bench = parser.add_subparsers().add_parser("bench")
    add_serve_bench_parser(bench.add_subparsers())
    args = parser.parse_args(["bench", "serve", "--num-prompts", "3", "--request-rate", "inf", "--goodput", "e2e:9"])
    assert args.func is run_serve and args.request_rate == float("inf") and args.goodput == ["e2e:9"]
