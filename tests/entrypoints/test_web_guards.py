"""Web pages cannot drive the server, and only the key's holders read /metrics (issue 39): the
Host check against DNS rebinding, JSON-only POST bodies against "simple" cross-site requests, no
CORS headers unless origins are allowed, the API key on /metrics, and the key's scheme in any case.
A tiny model served in this process; one real `kvflow serve` shows the defaults the command sets."""

from __future__ import annotations

import subprocess

import httpx
import openai
import pytest
from live_server import KVFLOW, start_process, start_thread
from tiny_models import tiny_chat_model

from kvflow import EngineArgs, LLMEngine
from kvflow.engine.async_llm import AsyncLLM
from kvflow.entrypoints.openai.api_server import build_app
from kvflow.entrypoints.openai.http_guards import HostAllowList, is_loopback_bind

P = "/v1/completions"
BODY = b'{"prompt": "hi", "max_tokens": 1}'
PAGE = "http://evil.example"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def llm(model_dir):
    llm = AsyncLLM(LLMEngine(EngineArgs(model_dir, dtype="float32", disable_log_stats=True)))
    yield llm
    llm.shutdown()


@pytest.fixture
def serve(llm):
    """serve(**build_app arguments) → an httpx client of a server of this test alone."""
    started = []

    def start(**kwargs) -> httpx.Client:
        live = start_thread(build_app(llm, "tiny", **kwargs))
        started.append(live)
        return httpx.Client(base_url=live.url, timeout=60)

    yield start
    for live in started:
        live.stop()


def assert_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert all(w in error["message"] for w in words), error["message"]
    return error


def test_a_loopback_bind_answers_only_loopback_host_names(serve):
    http = serve(allowed_hosts=HostAllowList.for_server("127.0.0.1", None))
    port = http.base_url.port
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io", "localhost.evil.example", "", "[::1"):
        for method, path in (("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("POST", P)):
            response = http.request(method, path, content=BODY if method == "POST" else None,
                                    headers={"Host": host, "Content-Type": "application/json"})
            assert assert_error(response, 403, "Host header", "--allowed-hosts")["code"] == "host_not_allowed"
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"127.8.9.10:{port}", f"[::1]:{port}", "[::1]"):
        response = http.post(P, content=BODY, headers={"Host": host, "Content-Type": "application/json"})
        assert response.status_code == 200, (host, response.text)


def test_allowed_hosts_add_names_or_turn_the_check_off():
    proxied = HostAllowList.for_server("127.0.0.1", ["proxy.example,10.0.0.7", "[fe80::1]"])
    assert proxied.admits("proxy.example:443") and proxied.admits("PROXY.EXAMPLE") and proxied.admits("10.0.0.7")
    assert proxied.admits("[fe80:0::1]:8000") and proxied.admits("localhost:8000")
    assert not proxied.admits("evil.example") and not proxied.admits("10.0.0.8")
    assert HostAllowList.for_server("127.0.0.1", ["*"]) is None
    assert HostAllowList.for_server("0.0.0.0", None) is None  # a deliberate exposure: no check unless asked
    assert HostAllowList.for_server("0.0.0.0", ["lab.example"]) == HostAllowList(frozenset({"lab.example"}))
    assert all(is_loopback_bind(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(is_loopback_bind(h) for h in ("0.0.0.0", "::", "", "10.1.2.3"))
    with pytest.raises(ValueError, match="--allowed-hosts: 'proxy.example:8080'"):
        HostAllowList.for_server("127.0.0.1", ["proxy.example:8080"])


@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain; charset=utf-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                          "application/jsonx"])
def test_a_post_body_that_is_not_declared_json_is_a_415(serve, content_type):
    http = serve()
    headers = {"Content-Type": content_type} if content_type else {}
    for path in (P, "/v1/chat/completions"):
        error = assert_error(http.post(path, content=BODY, headers=headers), 415, "Content-Type", "application/json")
        assert error["param"] == "Content-Type" and error["code"] == "unsupported_media_type"
    response = http.post(P, content=BODY, headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert response.status_code == 200, response.text


def test_no_cors_headers_unless_origins_are_allowed(serve):
    preflight = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type"}
    closed = serve()
    for response in (closed.options(P, headers=preflight),
                     closed.post(P, content=BODY, headers={"Origin": PAGE, "Content-Type": "application/json"})):
        assert not any(name.startswith("access-control-") for name in response.headers), response.headers
    ui = "http://localhost:3000"
    opened = serve(allowed_origins=[ui])
    granted = opened.options(P, headers={**preflight, "Origin": ui})
    assert granted.status_code == 200 and granted.headers["access-control-allow-origin"] == ui
    assert "access-control-allow-origin" not in opened.options(P, headers=preflight).headers


def test_metrics_need_the_api_key_unless_the_operator_opens_them(serve):
    guarded = serve(api_key="sekrit")
    assert_error(guarded.get("/metrics"), 401, "API key")
    assert_error(guarded.get("/metrics", headers={"Authorization": "Bearer wrong"}), 401)
    assert "kvflow:prefix_cache_hits_total" in guarded.get("/metrics", headers={"Authorization": "Bearer sekrit"}).text
    assert guarded.get("/health").status_code == 200  # load balancers
    opened = serve(api_key="sekrit", disable_metrics_auth=True)
    assert opened.get("/metrics").status_code == 200
    assert_error(opened.get("/v1/models"), 401)


@pytest.mark.parametrize("header,status", [("Bearer sekrit", 200), ("bearer sekrit", 200), ("BEARER sekrit", 200),
                                           ("bEaReR  sekrit", 200), ("Bearer Sekrit", 401), ("Basic sekrit", 401),
                                           ("bearer", 401), ("sekrit", 401), ("Bearersekrit", 401)])
def test_the_auth_scheme_is_case_insensitive_the_key_is_not(serve, header, status):
    http = serve(api_key="sekrit")
    assert http.get("/v1/models", headers={"Authorization": header}).status_code == status


def test_kvflow_serve_checks_host_and_content_type_by_default_and_clients_still_work(model_dir):
    server = start_process(["--model", model_dir, "--dtype", "float32", "--served-model-name", "tiny"])
    try:
        port = server.url.rsplit(":", 1)[1]
        assert_error(httpx.get(server.url + "/health", headers={"Host": f"evil.example:{port}"}, timeout=10), 403)
        assert_error(httpx.post(server.url + P, content=BODY, headers={"Content-Type": "text/plain"}, timeout=60), 415)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(server.url + "/health", headers={"Host": f"localhost:{port}"}, timeout=10).status_code == 200
    finally:
        server.stop()
    assert "Traceback" not in server.output


def test_a_bad_allowed_hosts_entry_stops_the_start_naming_the_flag(model_dir):
    proc = subprocess.run([*KVFLOW, "serve", "--model", model_dir, "--allowed-hosts", "proxy.example:8080"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "--allowed-hosts: 'proxy.example:8080'" in proc.stderr
    assert "Traceback" not in proc.stderr
