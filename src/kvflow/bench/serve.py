"""`kvflow bench serve`: a load generator for any OpenAI-compatible server (kvflow, vLLM,
llama.cpp's server).

    kvflow bench serve --url http://127.0.0.1:8000 --num-prompts 64 --concurrency 8
    kvflow bench serve --num-prompts 200 --request-rate 4 --goodput ttft:500 tpot:100
    kvflow bench serve --num-prompts 32 --sweep-concurrency 1,4,16 --plot sweep.png

Each request streams `/v1/completions` (`stream_options.include_usage` for exact token
counts). Load is closed-loop (C requests always in flight) or open-loop (Poisson arrivals at R
per second). A run ends when every prompt was sent or `--duration` passed; only loopback URLs
are accepted unless `--allow-remote` says otherwise: a load test is not something to point at
someone else's server by accident.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvflow.bench.datasets import DEFAULT_VOCAB_SIZE, DatasetConfig, SampleRequest, build_dataset, parse_length_dist
from kvflow.bench.report import SLO, RequestRecord, format_report, plot_sweep, summarize
from kvflow.bench.stream_client import BACKENDS, completions_url, fetch_model_name, prompt_text, send_request

Send = Callable[[SampleRequest], Awaitable[RequestRecord]]


@dataclass(frozen=True)
class Load:
    """Closed loop when `concurrency` is set; else Poisson arrivals at `request_rate` per second
    (inf = all at once), optionally capped at `max_concurrency` in flight."""

    concurrency: int | None = None
    request_rate: float | None = None
    max_concurrency: int | None = None
    duration_s: float | None = None  # no request starts after this
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("give exactly one of concurrency and request_rate")
        if any(n is not None and n < 1 for n in (self.concurrency, self.max_concurrency)):
            raise ValueError("concurrency and max_concurrency must be >= 1")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"request rate must be > 0 (inf: all at once); got {self.request_rate}")


def check_loopback(url: str, allow_remote: bool) -> None:
    host = urlsplit(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a DNS name: not resolved here, so not known to be local
        loopback = False
    if not loopback and not allow_remote:
        raise ValueError(f"{url} is not a loopback address; pass --allow-remote to load-test another host")


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Start times (s from the first) of a Poisson process at `rate`: exponential gaps."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


async def _closed_loop(
    send: Send, requests: Sequence[SampleRequest], load: Load, deadline: float
) -> list[RequestRecord]:
    pending = iter(requests)  # shared by the workers: each takes the next request when free
    records: list[RequestRecord] = []

    async def worker() -> None:
        for request in pending:
            if time.perf_counter() >= deadline:
                return
            records.append(await send(request))

    await asyncio.gather(*(worker() for _ in range(load.concurrency)))
    return records


async def _open_loop(
    send: Send, requests: Sequence[SampleRequest], load: Load, deadline: float
) -> list[RequestRecord]:
    limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None

    async def limited(request: SampleRequest) -> RequestRecord:
        if limit is None:
            return await send(request)
        async with limit:
            return await send(request)

    start, tasks = time.perf_counter(), []
    for request, offset in zip(requests, arrival_offsets(len(requests), load.request_rate, load.seed)):
        if start + offset >= deadline:
            break
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        tasks.append(asyncio.create_task(limited(request)))
    return list(await asyncio.gather(*tasks))


async def run_load(send: Send, requests: Sequence[SampleRequest], load: Load) -> tuple[list[RequestRecord], float]:
    """(records, seconds from the first request's start to the last one's end)."""
    start = time.perf_counter()
    deadline = start + load.duration_s if load.duration_s else float("inf")
    run = _closed_loop if load.concurrency else _open_loop
    records = await run(send, requests, load, deadline)
    return records, time.perf_counter() - start


async def benchmark(url: str, model: str | None, requests: Sequence[SampleRequest], load: Load,
                    timeout_s: float = 600.0, ignore_eos: bool = True,
                    backend: str = "openai") -> tuple[str, list[RequestRecord], float]:
    """Run one load against `url`; (model name, records, duration)."""
    connections = load.concurrency or load.max_concurrency or len(requests)
    # trust_env=False: a proxy from the environment must not sit between the client and a
    # local server and add its own latency to every number.
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False,
                                 limits=httpx.Limits(max_connections=connections)) as client:
        name = model or await fetch_model_name(client, url)
        endpoint = completions_url(url, backend)
        if backend != "openai":  # chat and Responses take text: converted before the clock starts
            requests = [replace(r, prompt=await prompt_text(client, url, name, r.prompt)) for r in requests]

        async def send(request: SampleRequest) -> RequestRecord:
            return await send_request(client, endpoint, name, request, ignore_eos, backend)

        records, duration = await run_load(send, requests, load)
    return name, records, duration


# ---- CLI ----------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,4,16; got {text!r}")
    return values


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default: loopback :8000)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first /v1/models)")
    p.add_argument("--allow-remote", action="store_true", help="allow a URL that is not loopback")
    p.add_argument("--backend", default="openai", choices=sorted(BACKENDS),
                   help="the route, as vLLM's bench names it: openai (/v1/completions), openai-chat, openai-responses")
    p.add_argument("--num-prompts", type=int, default=100)
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--concurrency", type=int, help="closed loop: requests kept in flight")
    load.add_argument("--request-rate", type=float, help="open loop: Poisson arrivals per second (inf: all at once)")
    load.add_argument("--sweep-concurrency", type=_int_list, help="e.g. 1,4,16: one closed-loop run each, and a plot")
    p.add_argument("--max-concurrency", type=int, default=None, help="with --request-rate: cap in flight")
    p.add_argument("--duration", type=float, default=None, help="seconds after which no request starts")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--dataset", default="random", help="random, shared-prefix, or a text file (a prompt per line)")
    p.add_argument("--input-len", type=int, default=256, help="mean prompt tokens (random, shared-prefix suffix)")
    p.add_argument("--output-len", type=int, default=128, help="mean max_tokens of each request")
    p.add_argument("--input-dist", default="uniform:0.5", help="fixed | uniform[:S] | normal[:S] | exponential")
    p.add_argument("--output-dist", default="fixed", help="as --input-dist")
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens of each shared prefix")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="random token ids are drawn below this")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly max_tokens (vLLM's and llama.cpp's extension)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS", help="SLOs, e.g. ttft:500 tpot:50")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--output-json", default=None, metavar="FILE", help="also write the JSON report here")
    p.add_argument("--plot", default="serve-sweep.png", metavar="PNG", help="where a sweep writes its plot")


def add_serve_bench_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Register `serve` under `kvflow bench`."""
    parser = bench_subparsers.add_parser("serve", help="load-test an OpenAI-compatible server")
    _add_arguments(parser)
    parser.set_defaults(func=run_serve)
    return parser


def _dataset(args: argparse.Namespace) -> list[SampleRequest]:
    return build_dataset(DatasetConfig(
        args.dataset, args.num_prompts, parse_length_dist(args.input_dist, args.input_len),
        parse_length_dist(args.output_dist, args.output_len), args.prefix_len, args.num_prefixes,
        args.vocab_size, args.seed,
    ))


def _run_one(args: argparse.Namespace, requests: list[SampleRequest], load: Load) -> dict[str, Any]:
    name, records, duration = asyncio.run(
        benchmark(args.url, args.model, requests, load, args.timeout, args.ignore_eos, args.backend))
    report = summarize(records, duration, SLO.parse(args.goodput) if args.goodput else None)
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "url": args.url, "model": name,
            "backend": args.backend, "dataset": args.dataset, "num_prompts": len(requests), "concurrency": load.concurrency,
            "request_rate": load.request_rate, "max_concurrency": load.max_concurrency, **report}


def run_serve(args: argparse.Namespace) -> int:
    try:
        check_loopback(args.url, args.allow_remote)
        if args.goodput:
            SLO.parse(args.goodput)  # reject a bad objective before any load is sent
        requests = _dataset(args)
        if args.sweep_concurrency:
            reports = [_run_one(args, requests, Load(concurrency=c, duration_s=args.duration, seed=args.seed))
                       for c in args.sweep_concurrency]
            result: dict[str, Any] = {"sweep": reports, "plot": str(plot_sweep(reports, args.plot))}
        else:
            load = Load(args.concurrency, args.request_rate, args.max_concurrency, args.duration, args.seed)
            result = _run_one(args, requests, load)
    except (ValueError, RuntimeError, OSError, httpx.HTTPError) as err:
        print(f"kvflow bench serve: {err}", file=sys.stderr)
        return 2
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    print(json.dumps(result) if args.json else _format(result))
    return 0


def _format(result: dict[str, Any]) -> str:
    if "sweep" not in result:
        return format_report(result)
    parts = [f"concurrency {r['concurrency']}\n{format_report(r)}" for r in result["sweep"]]
    return "\n\n".join([*parts, f"plot: {result['plot']}"])


def main_serve(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvflow bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main_serve())
