"""No bad input left unanswered: every case gets the right status and an OpenAI-shaped error with
no stack trace, and a normal request right after it still succeeds. Internal faults are 500s (or
an error event inside a stream) and the engine keeps serving; a dead engine is a 503.

The server runs in this process (uvicorn on a thread) around the real default model, so tests can
reach its engine to inject faults."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from live_server import start_thread, wait_until
from pydantic import TypeAdapter
from tiny_models import make_tiny_model

from kvflow import EngineArgs, LLMEngine
from kvflow.engine.async_llm import AsyncLLM
from kvflow.entrypoints.openai.api_server import build_app
from kvflow.entrypoints.openai.limits import ServerLimits
from kvflow.entrypoints.openai.responses import Usage

pytestmark = pytest.mark.slow

MODEL = "kvflow-test"
BODY_LIMIT = 256 * 1024
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
COMP = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
# The smallest PNG there is (one transparent pixel), as a data: URL.
PNG_DATA_URL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA"
                "60e6kgAAAABJRU5ErkJggg==")
LONG_TEXT = "hello " * 9000  # about 9000 tokens: more than the model's 8192
C, P = "/v1/chat/completions", "/v1/completions"


def chat(**fields) -> dict:
    return {k: v for k, v in {**CHAT, **fields}.items() if v is not ...}


def comp(**fields) -> dict:
    return {k: v for k, v in {**COMP, **fields}.items() if v is not ...}


def msg(**fields) -> dict:
    return chat(messages=[{k: v for k, v in {"role": "user", "content": "Hi", **fields}.items() if v is not ...}])


CASES: list[tuple[str, str, dict | bytes, int]] = [
    ("malformed json", C, b'{"messages": [', 400),
    ("empty body", C, b"", 400),
    ("json array body", C, b"[]", 400),
    ("invalid utf-8", P, b'{"prompt": "caf\xe9", "max_tokens": 1}', 400),
    ("missing messages", C, chat(messages=...), 400),
    ("empty messages", C, chat(messages=[]), 400),
    ("messages not a list", C, chat(messages="Hi"), 400),
    ("message without role", C, msg(role=...), 400),
    ("unknown role", C, msg(role="wizard"), 400),
    ("content is a number", C, msg(content=42), 400),
    ("image content part", C, msg(content=[{"type": "image_url", "image_url": {"url": "x"}}]), 400),
    # A real image for a model that reads text only: its template would choke on the part.
    ("image for a text model", C, msg(content=[{"type": "image_url", "image_url": {"url": PNG_DATA_URL}}]), 400),
    ("user content null", C, msg(content=None), 400),
    ("temperature -1", C, chat(temperature=-1), 400),
    ("temperature a string", C, chat(temperature="hot"), 400),
    ("top_p 0", C, chat(top_p=0), 400),
    ("top_p 1.5", C, chat(top_p=1.5), 400),
    ("max_tokens 0", C, chat(max_tokens=0), 400),
    ("max_tokens 0 without echo", P, comp(max_tokens=0), 400),
    ("max_tokens 10^9", P, comp(max_tokens=10**9), 400),
    ("max_tokens a string", P, comp(max_tokens="10"), 400),
    ("max_completion_tokens -5", C, chat(max_completion_tokens=-5), 400),
    ("n 0", C, chat(n=0), 400),
    ("n 1000", C, chat(n=1000), 400),
    ("n 1.5", P, comp(n=1.5), 400),
    ("stream a string", C, chat(stream="yes"), 400),
    ("stream_options without stream", C, chat(stream_options={"include_usage": True}), 400),
    ("logprobs not a bool (chat)", C, chat(logprobs="yes"), 400),
    ("top_logprobs 21", C, chat(logprobs=True, top_logprobs=21), 400),
    ("top_logprobs without logprobs", C, chat(top_logprobs=2), 400),
    ("logprobs past max_logprobs (completions)", P, comp(logprobs=21), 400),
    ("logprobs -1 (completions)", P, comp(logprobs=-1), 400),
    ("frequency_penalty 3", C, chat(frequency_penalty=3), 400),
    ("presence_penalty -2.5", P, comp(presence_penalty=-2.5), 400),
    ("seed 2^64", P, comp(seed=2**64), 400),
    ("stop list too long", C, chat(stop=[f"s{i}" for i in range(17)]), 400),
    ("stop empty string", P, comp(stop=""), 400),
    ("stop a number", P, comp(stop=7), 400),
    ("min_tokens > max_tokens", P, comp(min_tokens=5, max_tokens=2), 400),
    ("top_k -2", P, comp(top_k=-2), 400),
    ("min_p 2", P, comp(min_p=2), 400),
    ("repetition_penalty 0", P, comp(repetition_penalty=0), 400),
    ("stop_token_ids negative", P, comp(stop_token_ids=[-1]), 400),
    ("logit_bias past 100", C, chat(logit_bias={"42": 101}), 400),
    ("logit_bias key not a token id", C, chat(logit_bias={"x": 5}), 400),
    ("logit_bias token past the vocabulary", P, comp(logit_bias={"99999999": 5}), 400),
    ("tool without a function", C, chat(tools=[{"type": "function"}]), 400),
    ("tool_choice naming no tool", C, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                         tool_choice={"type": "function", "function": {"name": "g"}}), 400),
    ("response_format unknown type", C, chat(response_format={"type": "yaml"}), 400),
    ("guided_regex that does not compile", P, comp(guided_regex="a("), 400),
    ("missing prompt", P, comp(prompt=...), 400),
    ("empty prompt", P, comp(prompt=""), 400),
    ("empty prompt list", P, comp(prompt=[]), 400),
    ("empty token list in a list", P, comp(prompt=[[1, 2], []]), 400),
    ("mixed prompt list", P, comp(prompt=[1, "a"]), 400),
    ("token id outside the vocabulary", P, comp(prompt=[1, 10**9]), 400),
    ("prompt a bool list", P, comp(prompt=[True, False]), 400),
    ("suffix", P, comp(suffix="end"), 400),
    ("prompt over the context (completions)", P, comp(prompt=LONG_TEXT), 400),
    ("prompt over the context (chat)", C, msg(content=LONG_TEXT), 400),
    ("unknown model", C, chat(model="gpt-17"), 404),
    ("unknown model (completions)", P, comp(model="gpt-17"), 404),
    ("oversized body", P, comp(prompt="x" * BODY_LIMIT), 413),
]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineArgs(disable_log_stats=True))


@pytest.fixture(scope="module")
def async_llm(engine):
    llm = AsyncLLM(engine)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def server(async_llm):
    live = start_thread(build_app(async_llm, MODEL, limits=ServerLimits(max_body_bytes=BODY_LIMIT)))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert "Traceback" not in response.text and 'File "' not in response.text
    return error


def assert_still_serving(http: httpx.Client) -> None:
    response = http.post(P, json=COMP)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1


def send(http: httpx.Client, path: str, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(path, content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize("name,path,body,status", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_an_openai_error(http, name, path, body, status):
    assert_openai_error(send(http, path, body), status)
    assert_still_serving(http)


@pytest.mark.parametrize("path,body", [(P, comp(prompt=LONG_TEXT)), (C, msg(content=LONG_TEXT))])
def test_over_context_message_gives_both_numbers(http, async_llm, path, body):
    tokenizer = async_llm.get_tokenizer()
    if path == P:
        prompt_len = len(tokenizer.encode(LONG_TEXT))
    else:
        prompt_len = len(tokenizer.apply_chat_template(body["messages"], tokenize=True))
    message = assert_openai_error(send(http, path, body), 400)["message"]
    assert str(prompt_len) in message and str(async_llm.max_model_len) in message


def test_null_means_default_and_unknown_fields_are_ignored(http):
    nulls = dict(temperature=None, top_p=None, n=None, stop=None, seed=None, stream=None, logprobs=None, user=None)
    for path, body in ((C, chat(**nulls, some_future_field=1)), (P, comp(**nulls, max_tokens=None))):
        response = send(http, path, body)
        assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 16  # completions' default max_tokens


def test_streamed_oversized_body_without_length_is_a_413(http):
    chunks = (b"x" * 65536 for _ in range(BODY_LIMIT // 65536 + 2))  # chunked: no content-length to check
    assert_openai_error(http.post(P, content=chunks, headers={"content-type": "application/json"}), 413)
    assert_still_serving(http)


def test_unknown_route_and_wrong_method_are_openai_shaped(http):
    assert_openai_error(http.get("/v1/nothing"), 404)
    assert_openai_error(http.get(C), 405)


def test_api_key_guards_v1_and_metrics_not_health(async_llm):
    live = start_thread(build_app(async_llm, MODEL, api_key="sekrit"))
    try:
        with httpx.Client(base_url=live.url, timeout=60) as http:
            assert_openai_error(http.get("/v1/models"), 401)
            assert_openai_error(http.post(P, json=COMP, headers={"Authorization": "Bearer wrong"}), 401)
            assert_openai_error(http.post(P, json=COMP, headers={"Authorization": "sekrit"}), 401)
            assert http.post(P, json=COMP, headers={"Authorization": "Bearer sekrit"}).status_code == 200
            assert_openai_error(http.get("/metrics"), 401)
            assert http.get("/metrics", headers={"Authorization": "Bearer sekrit"}).status_code == 200
            assert http.get("/health").status_code == 200
    finally:
        live.stop()


def runtime_fault():
    raise RuntimeError("secret internals at 0xdeadbeef")


def validation_fault(*_):  # pydantic refusing a value of ours, not the client's body
    TypeAdapter(int).validate_python("secret internals at 0xdeadbeef")


@pytest.mark.parametrize("fault", ["runtime", "validation"])
def test_internal_fault_is_a_500_without_details(http, async_llm, monkeypatch, fault):
    if fault == "runtime":
        monkeypatch.setattr(async_llm.tokenizer, "apply_chat_template", lambda *a, **k: runtime_fault())
    else:
        monkeypatch.setattr(Usage, "of", validation_fault)  # while building the answer
    error = assert_openai_error(http.post(C, json=CHAT), 500)
    assert "secret" not in error["message"] and error["type"] == "server_error"
    monkeypatch.undo()
    assert http.post(C, json=CHAT).status_code == 200


def test_engine_step_fault_ends_only_that_request(http, engine, monkeypatch):
    real_step = engine.step
    armed = []

    def faulty_step():
        outputs = real_step()
        if armed and armed.pop():  # after the work, e.g. while making outputs
            raise RuntimeError("injected step fault")
        return outputs

    monkeypatch.setattr(engine, "step", faulty_step)
    armed.append(True)
    assert_openai_error(http.post(P, json=comp(max_tokens=50)), 500)
    body = comp(max_tokens=400, ignore_eos=True, stream=True)
    with http.stream("POST", P, json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        armed.append(True)  # the stream has started: the error must arrive as an event
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "injected" not in error["message"]
    assert_still_serving(http)


def test_dead_engine_is_503_on_health_and_requests(tmp_path):
    make_tiny_model("llama-mqa", tmp_path)
    engine = LLMEngine(EngineArgs(str(tmp_path), skip_tokenizer_init=True, num_kv_blocks=32, disable_log_stats=True))

    def broken_loop() -> bool:
        raise SystemExit("the loop itself broke")  # escapes every per-request guard

    engine.has_unfinished_requests = broken_loop
    llm = AsyncLLM(engine)
    live = start_thread(build_app(llm, MODEL))
    try:
        with httpx.Client(base_url=live.url, timeout=60) as http:
            assert wait_until(lambda: http.get("/health").status_code == 503, 10)
            error = assert_openai_error(http.post(P, json=comp(prompt=[1, 2, 3])), 503)
            assert error["type"] == "server_error"
    finally:
        live.stop()


def test_client_gone_before_the_answer_aborts_the_request(server, async_llm):
    async def leave_early():
        async with httpx.AsyncClient(base_url=server.url) as client:
            with pytest.raises(httpx.TimeoutException):
                await client.post(P, json=comp(max_tokens=2000, ignore_eos=True), timeout=1.5)

    asyncio.run(leave_early())
    assert wait_until(lambda: async_llm.get_stats().num_running == 0, 10)
    assert async_llm.get_stats().kv_cache_usage == 0


GRAMMAR_GIVES_UP = "(a{2000}){1234}"  # llguidance's lexer gives up after the first token
NEVER_COMPLETE = {"type": "array", "items": {"$ref": "#"}, "minItems": 1}  # the parser gives up a few brackets in


@pytest.mark.parametrize("path,body", [(P, comp(guided_regex=GRAMMAR_GIVES_UP, max_tokens=12)),
                                       (C, chat(response_format={"type": "json_schema", "json_schema": {
                                           "name": "endless", "schema": NEVER_COMPLETE}}, max_tokens=12))])
def test_a_constraint_that_breaks_mid_output_is_an_error_not_a_success(http, path, body):
    error = assert_openai_error(send(http, path, body), 400)
    assert error["code"] == "structured_output_failed" and "the grammar library" in error["message"]
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "structured_output_failed"
    reasons = {c.get("finish_reason") for e in events[:-2] for c in json.loads(e)["choices"]}
    assert not reasons & {"stop", "tool_calls", "error"}
    assert_still_serving(http)
