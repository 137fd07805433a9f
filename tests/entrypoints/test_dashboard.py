"""The live engine page (GET /dashboard, issue 41): its files are open, its state is behind the API
key and shows counts and ids, never text; it is off with --disable-dashboard and refused clearly
on a data-parallel front. In a real headless browser (Debian's chromium; the browser tests skip,
saying so, where none is installed), the page shows the blocks that concurrent requests with a
shared prefix share, and its numbers are /metrics' numbers, with an API key and without.

The browser test's screenshot goes to the test's directory; with KVFLOW_UPDATE_DOCS=1 also to
docs/dashboard.png (committed), so that an ordinary run leaves the tree as it was.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from headless_browser import INSTALL_HINT, Browser, find_browser
from live_server import parse_metrics, start_thread, wait_until
from prometheus_client import CollectorRegistry
from tiny_models import tiny_chat_model

from kvflow import EngineArgs, LLMEngine
from kvflow.engine.async_llm import AsyncLLM
from kvflow.engine.dp_async_llm import DPAsyncLLM
from kvflow.engine.snapshot import derive_grid
from kvflow.engine.stats import EngineStats
from kvflow.entrypoints.openai.api_server import build_app
from kvflow.entrypoints.openai.dashboard import MAX_RUNS_SHOWN, TableSummary, add_dashboard_routes, table_summaries
from kvflow.entrypoints.openai.errors import install_error_handlers
from kvflow.entrypoints.openai.metrics import ServerMetrics
from kvflow.spec_decode.metrics import SpecDecodingStats

ROOT = Path(__file__).resolve().parents[2]
DOCS, EXAMPLES = ROOT / "docs", ROOT / "examples"
KEY = "sekrit"
SYSTEM = "You are a terse assistant. Answer in one line, and never apologise. "
# The page's numbers (element id m-NAME) and the /metrics sample each must equal.
SAME_AS_METRICS = {name: f"kvflow:{name}" for name in (
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
    "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total", "generation_tokens_total")}
SAME_AS_METRICS["requests-finished"] = "kvflow:time_to_first_token_seconds_count"
SHARED_GOLD = (0xF2, 0xC1, 0x4E)  # --shared in dashboard.css


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def slow():
    """Set: each engine step waits 40 ms first, so that requests stay running while a browser
    watches (steps of the tiny model take a few ms). Nothing is timed against it."""
    return threading.Event()


@pytest.fixture(scope="module")
def llm(model_dir, slow):
    engine = LLMEngine(EngineArgs(model_dir, dtype="float32", block_size=4, num_kv_blocks=400, disable_log_stats=True))
    step = engine.step

    def slowed_step():
        if slow.is_set():
            time.sleep(0.04)
        return step()

    engine.step = slowed_step
    llm = AsyncLLM(engine)
    yield llm
    llm.shutdown()


@pytest.fixture
def serve(llm):
    """serve(**build_app arguments) → the URL of a server of this test alone."""
    started = []

    def start(**kwargs) -> str:
        started.append(start_thread(build_app(llm, "tiny", **kwargs)))
        return started[-1].url

    yield start
    for live in started:
        live.stop()


@pytest.fixture(scope="module")
def browser():
    binary = find_browser()
    if binary is None:
        pytest.skip(INSTALL_HINT)
    browser = Browser(binary, width=1280, height=900)
    yield browser
    browser.close()


def _auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _state(url: str, key: str | None = None) -> dict:
    """The state once the engine has published a snapshot (the first ask only asks for one)."""
    assert wait_until(lambda: httpx.get(f"{url}/dashboard/state", headers=_auth(key), timeout=30).json()["engine"],
                      timeout=30)
    return httpx.get(f"{url}/dashboard/state", headers=_auth(key), timeout=30).json()


def _completion(url: str, prompt: str, key: str | None = None, n: int = 2, max_tokens: int = 150) -> int:
    body = {"model": "tiny", "prompt": prompt, "n": n, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0}
    return httpx.post(f"{url}/v1/completions", json=body, headers=_auth(key), timeout=120).status_code


def test_the_page_is_open_and_its_state_needs_the_key(serve):
    url = serve(api_key=KEY)
    page = httpx.get(f"{url}/dashboard", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert "http://" not in page.text and "https://" not in page.text  # nothing fetched from elsewhere
    for asset, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        response = httpx.get(f"{url}/dashboard/{asset}", timeout=30)
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
        assert "http://" not in response.text and "https://" not in response.text
    for headers in ({}, _auth("wrong"), {"Authorization": KEY}):
        response = httpx.get(f"{url}/dashboard/state", headers=headers, timeout=30)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    missing = httpx.get(f"{url}/nothing", timeout=30).json()["error"]["message"]
    assert "/dashboard/state" in missing and "dashboard.js" not in missing  # a 404 names the page, not its assets
    state = _state(url, KEY)
    assert state["model"] == "tiny" and state["alive"] is True
    assert state["engine"]["num_blocks"] == 400 and state["engine"]["block_size"] == 4


def test_the_state_shows_counts_and_ids_never_text(serve, slow):
    url = serve()
    secret = "The passphrase is swordfish, keep it. "
    slow.set()
    try:
        with ThreadPoolExecutor(2) as pool:
            done = [pool.submit(_completion, url, secret * 3, None, 1, 60), pool.submit(_completion, url, "other", None, 1, 60)]
            assert wait_until(lambda: len(_state(url)["engine"]["running"]) == 2, timeout=60)
            body = httpx.get(f"{url}/dashboard/state", timeout=30).text
            slow.clear()
            assert [f.result() for f in done] == [200, 200]
    finally:
        slow.clear()
    assert "swordfish" not in body and "passphrase" not in body
    engine = httpx.Response(200, content=body).json()["engine"]
    assert {key for r in engine["running"] for key in r} == {
        "id", "status", "priority", "age_s", "prompt_tokens", "cached_tokens", "computed_tokens", "output_tokens",
        "max_tokens", "adapter", "blocks", "shared_blocks", "tables"}
    assert sorted(r["prompt_tokens"] for r in engine["running"]) == [5, len(secret) * 3]
    states = [b & 3 for b in base64.b64decode(engine["grid"]["state"])]  # 4 added: hashed
    assert len(states) == 400
    counts = [states.count(s) for s in range(4)]
    blocks = engine["blocks"]
    assert counts == [blocks["free"], blocks["cached_free"], blocks["held"], blocks["shared"]]
    assert sum(r["blocks"] for r in engine["running"]) == blocks["held"] + sum(
        shared["ref"] for shared in engine["grid"]["shared"].values())


def test_block_tables_are_sent_as_runs_of_consecutive_blocks(llm):
    assert wait_until(llm.latest_snapshot, timeout=30)
    ref_counts = [0] * 400
    alternating = tuple(range(100, 300, 2))
    holders = (("a", ((-1, -1, 3, 4, 5, 9, 2),)), ("b", ((), (7, 8, 3))), ("c", (alternating,)))
    for _, groups in holders:
        for block in (b for table in groups for b in table if b >= 0):
            ref_counts[block] += 1
    snapshot = dataclasses.replace(llm.latest_snapshot(), holders=holders, ref_counts=ref_counts, cached_blocks=[])
    tables = table_summaries(snapshot, derive_grid(snapshot))
    assert tables["a"] == TableSummary(5, 1, [{"runs": [[-1, 2], [3, 3], [9, 1], [2, 1]], "more": 0}])
    assert tables["b"] == TableSummary(3, 1, [{"runs": [], "more": 0}, {"runs": [[7, 2], [3, 1]], "more": 0}])
    assert tables["c"].tables == [{"runs": [[b, 1] for b in alternating[:MAX_RUNS_SHOWN]], "more": 100 - MAX_RUNS_SHOWN}]


def test_the_page_is_off_with_its_flag(serve):
    url = serve(api_key=KEY, enable_dashboard=False)
    for path in ("/dashboard", "/dashboard/state", "/dashboard/dashboard.js"):
        response = httpx.get(f"{url}{path}", headers=_auth(KEY), timeout=30)
        assert response.status_code == 404 and response.json()["error"]["code"] == "dashboard_disabled", path
        assert "--disable-dashboard" in response.json()["error"]["message"]


def test_a_data_parallel_front_is_refused_clearly():
    app = FastAPI()
    install_error_handlers(app)
    front = SimpleNamespace(replicas=[0, 1], is_alive=lambda: True)
    front.latest_snapshot = lambda: DPAsyncLLM.latest_snapshot(front)
    add_dashboard_routes(app, front, CollectorRegistry(), "tiny", [])
    response = TestClient(app).get("/dashboard/state")
    assert response.status_code == 501 and response.json()["error"]["code"] == "dashboard_unavailable"
    assert "2 data-parallel replicas" in response.json()["error"]["message"]


# -- in a real browser -------------------------------------------------------------------
def _page_numbers(page) -> dict[str, float | None]:
    values = page.evaluate("Object.fromEntries([...document.querySelectorAll('[id^=\"m-\"]')]"
                           ".map(e => [e.id.slice(2), e.dataset.value ?? null]))")
    return {name: None if values.get(name) is None else float(values[name]) for name in SAME_AS_METRICS}


def _metrics_numbers(url: str, key: str | None) -> dict[str, float]:
    metrics = parse_metrics(httpx.get(f"{url}/metrics", headers=_auth(key), timeout=30).text)
    return {name: metrics[sample] for name, sample in SAME_AS_METRICS.items()}


def _shared_pixels(page) -> int:
    """Pixels of the grid's canvas painted in the shared blocks' colour: what a viewer sees."""
    r, g, b = SHARED_GOLD
    return page.evaluate(f"""(() => {{
        const canvas = document.getElementById('grid');
        const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
        let n = 0;
        for (let i = 0; i < data.length; i += 4) n += data[i] === {r} && data[i + 1] === {g} && data[i + 2] === {b};
        return n;
    }})()""")


def _hover_a_shared_block(page) -> str | None:
    """Move the mouse onto the first block painted as shared; the tooltip's text."""
    r, g, b = SHARED_GOLD
    return page.evaluate(f"""(() => {{
        const canvas = document.getElementById('grid');
        const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
        for (let i = 0; i < data.length; i += 4) {{
            if (data[i] !== {r} || data[i + 1] !== {g} || data[i + 2] !== {b}) continue;
            const rect = canvas.getBoundingClientRect(), scale = rect.width / canvas.width;
            const x = (i / 4) % canvas.width + 2, y = Math.floor(i / 4 / canvas.width) + 2;  // inside its cell
            canvas.dispatchEvent(new MouseEvent('mousemove', {{clientX: rect.left + x * scale, clientY: rect.top + y * scale}}));
            return document.getElementById('tip').hidden ? null : document.getElementById('tip').textContent;
        }}
        return null;
    }})()""")


def _refuses_without_the_key(page, url: str) -> None:
    page.goto(f"{url}/dashboard?without-key#hz=10")  # a query of its own: the next visit loads the page anew
    assert "API key" in page.wait_for("!document.getElementById('banner').hidden && "
                                      "document.getElementById('banner').textContent", timeout=60)
    assert page.evaluate("document.getElementById('m-num_requests_running').dataset.value") is None


@pytest.mark.parametrize("key", [None, KEY], ids=["no-key", "api-key"])
def test_the_page_shows_shared_blocks_and_the_numbers_of_metrics(serve, slow, browser, key, tmp_path):
    url = serve(api_key=key)
    page = browser.new_page()
    if key:
        _refuses_without_the_key(page, url)
    page.goto(f"{url}/dashboard#hz=10" + (f"&key={key}" if key else ""))
    assert KEY not in page.evaluate("location.href")  # the key left the address bar for the tab's storage
    prompts = [SYSTEM + f"Question {i}: what is {i} times {i + 2}?" for i in range(4)]
    slow.set()
    try:
        with ThreadPoolExecutor(5) as pool:
            done = [pool.submit(_completion, url, p, key) for p in prompts]
            done.append(pool.submit(_completion, url, "Tell me about the sea.", key, 1))
            page.wait_for("Number(document.getElementById('m-shared-blocks').dataset.value) > 0", timeout=90)
            # Some history for the charts (snapshots come at most 4 a second, MIN_INTERVAL_S).
            page.wait_for("Number(document.body.dataset.samples) >= 8", timeout=60)
            assert _shared_pixels(page) > 0
            tip = _hover_a_shared_block(page)
            assert tip is not None and ": shared" in tip and "hashed" in tip, tip
            assert int(re.search(r"ref count (\d+)", tip).group(1)) == len(re.findall(r"cmpl-", tip)) >= 2, tip
            shot = page.screenshot(tmp_path / "dashboard.png")
            slow.clear()
            assert [f.result() for f in done] == [200] * 5
    finally:
        slow.clear()
    assert shot.startswith(b"\x89PNG\r\n\x1a\n")
    if os.environ.get("KVFLOW_UPDATE_DOCS") == "1" and key is None:
        (DOCS / "dashboard.png").write_bytes(shot)
    # Idle now: once the page has polled a snapshot taken after the last request, its numbers are /metrics'.
    wait_until(lambda: _page_numbers(page) == _metrics_numbers(url, key), timeout=60)
    assert _page_numbers(page) == _metrics_numbers(url, key)
    assert _metrics_numbers(url, key)["prefix_cache_hits_total"] > 0


def test_the_grafana_dashboard_charts_only_metrics_the_server_serves():
    dashboard = json.loads((EXAMPLES / "grafana-kvflow.json").read_text())
    stats = EngineStats(1, 0, 0.5, 0, 10, 5, 10, 20, spec_decoding=SpecDecodingStats(num_spec_tokens=3))
    served = {line.split("{")[0].split(" ")[0] for line in ServerMetrics(lambda: stats, "m").render().decode().splitlines()
              if line.startswith("kvflow:")}
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    charted = {name for expr in exprs for name in re.findall(r"kvflow:[a-z0-9_]+", expr)}
    assert charted - served == set()
    assert {"kvflow:time_to_first_token_seconds_bucket", "kvflow:inter_token_latency_seconds_bucket",
            "kvflow:kv_cache_usage_perc", "kvflow:prefix_cache_hits_total",
            "kvflow:spec_decode_num_accepted_tokens_total"} <= charted
    assert all(panel["datasource"]["uid"] == "${datasource}" for panel in dashboard["panels"])  # chosen at import
