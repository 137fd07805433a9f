"""The live engine page: `GET /dashboard` and the JSON it polls, `GET /dashboard/state`.

The page is three static files packaged with kvflow (static/dashboard.*: HTML, vanilla JS drawing
on canvases, CSS; no CDN, no build step). The state is the engine's latest published snapshot
(engine/snapshot.py): asking for it raises a flag that the engine thread answers between steps,
so this handler never touches the scheduler, and a step pays nothing while nobody watches. What
is per block (owners, sharing, states) is derived here, on the server's thread pool, at most once
per snapshot however many viewers ask, and sent as base64 typed arrays (a big pool's grid costs
the server microseconds to encode, not a JSON list per block).

Who may see it: the page's files hold no data and are open, since a browser's navigation cannot
send the API key; the state is behind the same API key as /v1 and /metrics (the page asks for the
key and sends it). It shows request ids, token counts and block ids, never a prompt's or an
output's text or token ids. A data-parallel server answers the state with 501, which the page
shows: each replica has its own pool and scheduler (docs/architecture.md).
"""

from __future__ import annotations

import base64
import json
import threading
import time
from dataclasses import dataclass
from importlib import resources

import numpy as np
from fastapi import FastAPI, Response
from prometheus_client import CollectorRegistry

from kvflow.engine.snapshot import (
    CACHED_FREE,
    FREE,
    HELD,
    SHARED,
    EngineSnapshot,
    KVGrid,
    RequestView,
    SnapshotUnavailableError,
    derive_grid,
)
from kvflow.entrypoints.openai.errors import APIError
from kvflow.entrypoints.openai.metrics import stat_values

MAX_RUNS_SHOWN = 48  # per block table: consecutive blocks are one run, then "and N more"
LATENCY_HISTOGRAMS = {"ttft": "kvflow:time_to_first_token_seconds", "itl": "kvflow:inter_token_latency_seconds"}
# The page runs its own script and style only, talks to this server only, and is never framed.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
STATIC_FILES = {"": ("dashboard.html", "text/html; charset=utf-8"),
                "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
                "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8")}


def add_dashboard_routes(app: FastAPI, async_llm, registry: CollectorRegistry, model_name: str,
                         key_check: list) -> None:
    """`registry`: the server's metrics, whose latency histograms the page charts."""
    static = resources.files("kvflow.entrypoints.openai") / "static"
    for suffix, (name, media_type) in STATIC_FILES.items():
        _add_static(app, f"/dashboard{suffix}", (static / name).read_bytes(), media_type)
    encoder = SnapshotEncoder(registry)

    @app.get("/dashboard/state", dependencies=key_check)
    def dashboard_state() -> Response:  # a plain def: FastAPI runs it on its thread pool, off the event loop
        try:
            snapshot = async_llm.latest_snapshot()
        except SnapshotUnavailableError as e:
            raise APIError(501, str(e), code="dashboard_unavailable") from None
        body = {"model": model_name, "alive": async_llm.is_alive(), "now": time.monotonic()}
        return Response(json.dumps(body)[:-1].encode() + b", " + encoder.encode(snapshot) + b"}",
                        media_type="application/json", headers={"Cache-Control": "no-store"})


def refuse_dashboard(app: FastAPI) -> None:
    """With the page off, its paths say so rather than "no such route"."""

    @app.get("/dashboard{rest:path}", include_in_schema=False)
    async def dashboard_off(rest: str) -> Response:
        raise APIError(404, "the live engine page is off on this server (--disable-dashboard)", code="dashboard_disabled")


def _add_static(app: FastAPI, path: str, content: bytes, media_type: str) -> None:
    @app.get(path, include_in_schema=path == "/dashboard")  # the page is listed in 404s, its assets are not
    async def static_file() -> Response:
        return Response(content, media_type=media_type, headers=PAGE_HEADERS)


class SnapshotEncoder:
    """A snapshot's JSON members `"latency": ..., "engine": ...`, made once however many viewers
    ask for it (the latency histograms read with it: they change as often as the page does)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._lock = threading.Lock()
        self._last: tuple[EngineSnapshot | None, bytes] | None = None

    def encode(self, snapshot: EngineSnapshot | None) -> bytes:
        with self._lock:
            if self._last is None or self._last[0] is not snapshot or snapshot is None:
                engine = None if snapshot is None else engine_state(snapshot)
                members = {"latency": latency_buckets(self.registry), "engine": engine}
                self._last = snapshot, json.dumps(members, separators=(",", ":"))[1:-1].encode()
            return self._last[1]


def engine_state(snapshot: EngineSnapshot) -> dict:
    grid = derive_grid(snapshot)
    tables = table_summaries(snapshot, grid)
    return {
        "seq": snapshot.seq, "taken_at": snapshot.taken_at, "num_blocks": snapshot.num_blocks,
        "block_size": snapshot.block_size, "sliding_windows": list(snapshot.sliding_windows),
        "budget": snapshot.budget, "max_num_seqs": snapshot.max_num_seqs, "stats": stat_values(snapshot.stats),
        "blocks": {"free": grid.count(FREE), "cached_free": grid.count(CACHED_FREE), "held": grid.count(HELD),
                   "shared": grid.count(SHARED), "unaccounted": grid.unaccounted[:64]},
        "grid": grid_state(grid, len(snapshot.holders)),
        "holders": [rid for rid, _ in snapshot.holders],
        "running": [request_state(v, tables, snapshot.taken_at) for v in snapshot.running],
        "queued": [request_state(v, tables, snapshot.taken_at) for v in snapshot.queued],
        "num_queued": snapshot.num_queued,
        "adapters_in_use": snapshot.adapters_in_use,
        "steps": steps_state(snapshot),
    }


def grid_state(grid: KVGrid, num_holders: int) -> dict:
    """Per block, base64 of little-endian arrays (the page reads them as typed arrays): `state`, a
    byte (FREE, CACHED_FREE, HELD or SHARED, plus 4 when hashed), and `owner`, the index of its first
    holder (the largest value of its type for none). Shared blocks also list their reference count
    and every holder."""
    wide = num_holders >= 0xFFFF
    owner = grid.owner.astype("<i4") if wide else np.where(grid.owner < 0, 0xFFFF, grid.owner).astype("<u2")
    return {
        "state": _b64((grid.state | (grid.hashed.astype(np.uint8) << 2)).astype("u1")),
        "owner": _b64(owner), "owner_type": "i4" if wide else "u2",
        "shared": {str(b): {"ref": int(grid.ref_counts[b]), "holders": holders} for b, holders in grid.owners.items()},
    }


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(array.tobytes()).decode("ascii")


@dataclass(frozen=True)
class TableSummary:
    blocks: int  # entries holding a block, over its KV groups
    shared_blocks: int  # of those, blocks another table holds too
    tables: list[dict]  # per KV group: {"runs": [[first block, length], ...], "more": runs left out}


def table_summaries(snapshot: EngineSnapshot, grid: KVGrid) -> dict[str, TableSummary]:
    """Every holder's tables as runs of consecutive blocks (NULL_BLOCK runs too: blocks a window
    gave back), at most MAX_RUNS_SHOWN per table; numpy over all tables at once."""
    entries = grid.entries
    flat, table_of, num_tables = entries.blocks, entries.table, len(entries.holder)
    if flat.size == 0:
        return {}
    held = flat >= 0
    shared = held & (grid.ref_counts[np.where(held, flat, 0)] > 1)
    before, after = flat[:-1], flat[1:]
    continues = (((after == before + 1) & (before >= 0)) | ((after < 0) & (before < 0))) & (table_of[1:] == table_of[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    run_lengths = np.diff(np.append(starts, flat.size)).tolist()
    firsts, bounds = flat[starts].tolist(), np.searchsorted(table_of[starts], np.arange(num_tables + 1)).tolist()
    per_table = [{"runs": [[firsts[i], run_lengths[i]] for i in range(b0, min(b1, b0 + MAX_RUNS_SHOWN))],
                  "more": max(0, b1 - b0 - MAX_RUNS_SHOWN)} for b0, b1 in zip(bounds, bounds[1:])]
    held_per = np.bincount(table_of, weights=held, minlength=num_tables).astype(int).tolist()
    shared_per = np.bincount(table_of, weights=shared, minlength=num_tables).astype(int).tolist()
    summaries, k = {}, 0
    for rid, groups in snapshot.holders:
        g = len(groups)
        summaries[rid] = TableSummary(sum(held_per[k:k + g]), sum(shared_per[k:k + g]), per_table[k:k + g])
        k += g
    return summaries


def request_state(view: RequestView, tables: dict[str, TableSummary], now: float) -> dict:
    summary = tables.get(view.request_id, TableSummary(0, 0, []))
    return {
        "id": view.request_id, "status": view.status.value, "priority": view.priority,
        "age_s": round(now - view.arrival_time, 3), "prompt_tokens": view.num_prompt_tokens,
        "cached_tokens": view.num_cached_tokens, "computed_tokens": view.num_computed_tokens,
        "output_tokens": view.num_output_tokens, "max_tokens": view.max_tokens,
        "adapter": None if view.lora_request is None else view.lora_request.lora_name,
        "blocks": summary.blocks, "shared_blocks": summary.shared_blocks, "tables": summary.tables,
    }


def steps_state(snapshot: EngineSnapshot) -> dict:
    """The step log by column; `ago_s`: how long before the snapshot each step ended."""
    steps = snapshot.steps
    return {
        "ago_s": [round(snapshot.taken_at - s.ended_at, 4) for s in steps],
        "seconds": [round(s.seconds, 6) for s in steps],
        **{name: [getattr(s, name) for s in steps] for name in (
            "budget", "decode_tokens", "prefill_tokens", "spec_accepted", "spec_rejected", "num_preempted",
            "num_requests")},
    }


@dataclass(frozen=True)
class _Buckets:
    bounds: list[float]  # finite upper bounds; the last count is +Inf's
    counts: list[float]  # cumulative


def latency_buckets(registry: CollectorRegistry) -> dict:
    """The TTFT and inter-token histograms as /metrics has them (cumulative counts since start);
    the page takes percentiles of their increase over a window, as histogram_quantile does."""
    found = {key: _Buckets([], []) for key in LATENCY_HISTOGRAMS}
    names = {family: key for key, family in LATENCY_HISTOGRAMS.items()}
    for metric in registry.collect():
        key = names.get(metric.name)
        if key is None:
            continue
        for sample in metric.samples:
            if sample.name.endswith("_bucket"):
                if sample.labels["le"] != "+Inf":
                    found[key].bounds.append(float(sample.labels["le"]))
                found[key].counts.append(sample.value)
    return {key: {"le": b.bounds, "counts": b.counts} for key, b in found.items()}
