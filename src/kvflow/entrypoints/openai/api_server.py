"""The OpenAI-compatible HTTP server: `build_app` (FastAPI) and `run_server` (`kvflow serve`).

Bodies are read by hand rather than by FastAPI's body parsing so that every way a body can be
wrong — too big, too slow, not UTF-8, not JSON, wrong types, out of range — gets OpenAI's error
shape and the right status (413 before reading more than the limit; 408 when it does not arrive in
time; 400, never 422, for the rest). The limits are `ServerLimits` (docs/limits.md).

On SIGTERM or SIGINT the server stops accepting connections and gives the requests in flight
`shutdown_timeout` seconds to finish; what is left then ends with a 503 error (a stream: an error
event), never as a truncated success. A second SIGINT ends the drain at once, the same way.

Who may call is decided before any route runs: the Host check and CORS (http_guards.py), the API
key on /v1, /metrics (whose prefix-cache counters would tell one client what others asked) and the
live engine page's state, /dashboard/state (dashboard.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from pydantic import BaseModel, ValidationError

import kvflow
from kvflow.config import EngineArgs
from kvflow.engine.async_llm import AsyncLLM
from kvflow.engine.engine_thread import build_on_fresh_thread
from kvflow.engine.llm_engine import LLMEngine
from kvflow.entrypoints.listening import AnnouncedServer
from kvflow.entrypoints.openai.dashboard import add_dashboard_routes, refuse_dashboard
from kvflow.entrypoints.openai.errors import APIError, from_exception, from_validation, install_error_handlers
from kvflow.entrypoints.openai.http_guards import HostAllowList, HostCheck, allow_origins, flag_values, require_json
from kvflow.entrypoints.openai.limits import ServerLimits
from kvflow.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvflow.entrypoints.openai.serving_chat import ChatServing
from kvflow.entrypoints.openai.serving_completion import CompletionServing
from kvflow.entrypoints.openai.serving_messages import MessagesRequest, MessagesServing, anthropic_error
from kvflow.entrypoints.openai.serving_models import (
    LoadLoRAAdapterRequest,
    ServingModels,
    UnloadLoRAAdapterRequest,
    parse_lora_modules,
)
from kvflow.entrypoints.openai.serving_responses import ResponsesRequest, ResponsesServing
from kvflow.entrypoints.openai.serving_tokens import DetokenizeRequest, TokenizeRequest, TokenServing
from kvflow.entrypoints.openai.tokenization import PromptTokenizer
from kvflow.lora.request import LoRARequest
from kvflow.model.chat_template import compile_chat_template

Body = TypeVar("Body", bound=BaseModel)
SHUTDOWN_GRACE_SECONDS = 5.0  # after the drain: time to write the 503s before connections are cut


def build_app(async_llm: AsyncLLM, served_model_name: str, api_key: str | None = None,
              limits: ServerLimits = ServerLimits(), escape_special_tokens: bool = False,
              tool_call_parser: str = "hermes", lora_modules: list[LoRARequest] = (),
              allow_runtime_lora_updating: bool = False, allowed_hosts: HostAllowList | None = None,
              allowed_origins: Sequence[str] = (), disable_metrics_auth: bool = False,
              enable_dashboard: bool = True) -> FastAPI:
    """Raises ValueError for a configuration that must not serve: an empty API key (an empty
    KVFLOW_API_KEY would otherwise turn auth off without a word), a chat template that does not compile.
    `lora_modules`: adapters served by name (already loaded into the engine). `allowed_hosts`: the
    Host check (None: none; run_server derives it from the bind); `allowed_origins`: CORS (none:
    no CORS headers); `disable_metrics_auth`: /metrics open even with an API key; `enable_dashboard`:
    serve the live engine page, /dashboard (its state behind the API key whatever /metrics does)."""
    if api_key is not None and not api_key:
        raise ValueError("the API key is empty (--api-key or KVFLOW_API_KEY): give a key, or unset it to serve without one")
    if async_llm.tokenizer is not None and async_llm.tokenizer.chat_template:
        compile_chat_template(async_llm.tokenizer.chat_template)
    app = FastAPI(title="kvflow", openapi_url=None)
    install_error_handlers(app)
    allow_origins(app, allowed_origins)
    if allowed_hosts is not None:  # added last, so outermost: refused before CORS or a route sees it
        app.add_middleware(HostCheck, allowed=allowed_hosts)
    key_check = [Depends(_require_key(api_key))] if api_key else []
    metrics = ServerMetrics(async_llm.get_stats, served_model_name)
    async_llm.add_finish_listener(metrics.observe)
    tokenizer = PromptTokenizer(async_llm.tokenizer, async_llm.max_model_len, limits.tokenizer_workers,
                                escape_special_tokens, reads_images=async_llm.reads_images)
    models = ServingModels(async_llm, served_model_name, list(lora_modules), limits.max_served_loras)
    chat = ChatServing(async_llm, models, limits, tokenizer, tool_call_parser)
    completions = CompletionServing(async_llm, models, limits, tokenizer)
    responses = ResponsesServing(chat)
    messages = MessagesServing(chat)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if async_llm.is_alive() else 503)

    @app.get("/metrics", dependencies=[] if disable_metrics_auth else key_check)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    if enable_dashboard:
        add_dashboard_routes(app, async_llm, metrics.registry, served_model_name, key_check)
    else:
        refuse_dashboard(app)

    v1 = APIRouter(prefix="/v1", dependencies=key_check)

    @v1.get("/models")
    async def list_models() -> Response:
        return _json(models.model_list())

    if allow_runtime_lora_updating:
        @v1.post("/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Response:
            return await _answer(request, LoadLoRAAdapterRequest, models.load, limits)

        @v1.post("/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Response:
            return await _answer(request, UnloadLoRAAdapterRequest, models.unload, limits)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _answer(request, ChatCompletionRequest, chat.create, limits)

    @v1.post("/completions")
    async def create_completions(request: Request) -> Response:
        return await _answer(request, CompletionRequest, completions.create, limits)

    @v1.post("/responses")
    async def create_response(request: Request) -> Response:
        return await _answer(request, ResponsesRequest, responses.create, limits)

    @v1.post("/messages")
    async def create_message(request: Request) -> Response:
        return anthropic_error(await _answer(request, MessagesRequest, messages.create, limits))

    app.include_router(v1)
    _add_vllm_utility_routes(app, TokenServing(tokenizer), key_check, limits)
    # A 404 lists these; a page's assets (include_in_schema=False) are not worth naming there.
    app.state.served_routes = sorted({r.path for router in (app, v1) for r in router.routes
                                      if hasattr(r, "methods") and getattr(r, "include_in_schema", True)})
    app.router.on_shutdown.append(tokenizer.shutdown)
    return app


def _add_vllm_utility_routes(app: FastAPI, tokens: TokenServing, key_check: list, limits: ServerLimits) -> None:
    """vLLM's routes beside the OpenAI API: /tokenize and /detokenize (behind the API key, as they
    run the tokenizer), /version and /ping (open, like /health)."""

    @app.post("/tokenize", dependencies=key_check)
    async def tokenize(request: Request) -> Response:
        return await _answer(request, TokenizeRequest, tokens.tokenize, limits)

    @app.post("/detokenize", dependencies=key_check)
    async def detokenize(request: Request) -> Response:
        return await _answer(request, DetokenizeRequest, tokens.detokenize, limits)

    @app.get("/version")
    async def version() -> Response:
        return Response(json.dumps({"version": kvflow.__version__}), media_type="application/json")

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return Response(status_code=200)


async def _answer(request: Request, body_type: type[Body], create: Callable[[Body], Awaitable[BaseModel | Response]],
                  limits: ServerLimits) -> Response:
    """Every failure is answered here, not by Starlette's last-resort handler, which would also
    drop the client's keep-alive connection."""
    try:
        body = await read_body(request, body_type, limits.max_body_bytes, limits.body_read_timeout)
        result = await until_disconnected(request, create(body))
    except Exception as e:
        return from_exception(e).response()
    return result if isinstance(result, Response) else _json(result)  # a Response: a stream, or a client that left


def _json(result: BaseModel | dict) -> Response:
    body = result.model_dump_json() if isinstance(result, BaseModel) else json.dumps(result)
    return Response(body, media_type="application/json")


def _require_key(api_key: str) -> Callable[[Request], Awaitable[None]]:
    expected = api_key.encode()  # UTF-8, as clients send a non-ASCII key

    async def check(request: Request) -> None:
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        given = credentials.lstrip(" ").encode("latin-1")  # the header's own bytes back
        if "x-api-key" in request.headers:  # Anthropic's clients send the key here
            scheme, given = "bearer", request.headers["x-api-key"].encode("latin-1")
        # The scheme is case-insensitive (RFC 7235); the key is compared in constant time, so it
        # is not guessable by timing.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, expected):
            raise APIError(401, "missing or wrong API key; send it as 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    return check


async def read_body(request: Request, model: type[Body], limit: int, timeout: float) -> Body:
    require_json(request)  # before reading: a page's cross-site text/plain POST gets nothing done
    too_large = APIError(413, f"the request body is larger than {limit} bytes (--max-body-bytes)",
                         code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large

    async def read() -> bytes:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
        return bytes(body)

    try:
        body = await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} seconds (--body-read-timeout)",
                       code="request_timeout") from None
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation(e) from None


async def until_disconnected(request: Request, work: Awaitable[BaseModel | Response]) -> BaseModel | Response:
    """Run `work`, cancelling it (which aborts its engine requests) if the client leaves first.
    A stream watches for disconnects itself once it has started."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        return await task
    return Response(status_code=499)  # nobody is there to read it


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Server(AnnouncedServer):
    """uvicorn, plus: prints its URL once bound (AnnouncedServer); on shutdown gives in-flight requests
    `drain_timeout` seconds, then stops the engine so that what is left ends with an error while
    uvicorn still waits for the responses to be written; and a signal ends it with status 0 rather
    than being re-raised after shutdown, as uvicorn does.

    uvicorn's own second SIGINT skips that wait: the handlers still running are cancelled, and
    a request not yet answered gets uvicorn's plain-text 500, a stream is cut without [DONE]. Here
    a second SIGINT ends the drain instead: the engine stops at once, so every request ends with
    its 503 (a stream: an error event, then [DONE]), and the server exits as soon as those are
    written (at most SHUTDOWN_GRACE_SECONDS later). A third is uvicorn's: exit without waiting."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None], banner: str,
                 drain_timeout: float) -> None:
        super().__init__(config, banner, "OpenAI API at /v1")
        self.on_shutdown = on_shutdown
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_cut_short = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()  # before the signals are captured: their handler needs it
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGINT and self.should_exit and not self._drain_cut_short:
            self._drain_cut_short = True
            # A signal handler may interrupt the loop anywhere: the engine is stopped from the loop.
            self._loop.call_soon_threadsafe(self._cut_drain_short)
            return
        super().handle_exit(sig, frame)

    def _cut_drain_short(self) -> None:
        self.on_shutdown()
        self._loop.call_later(SHUTDOWN_GRACE_SECONDS, setattr, self, "force_exit", True)

    async def shutdown(self, sockets=None) -> None:
        # uvicorn stops accepting, then waits for the open connections (timeout_graceful_shutdown,
        # longer than the drain); the engine stops when the drain ends or nothing is left.
        timer = asyncio.get_running_loop().call_later(self.drain_timeout, self.on_shutdown)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
            self.on_shutdown()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach only the main thread; an embedding caller stops us by should_exit
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def served_name(model: str | None) -> str:
    from kvflow.model.default_model import default_model_path

    return model if model else default_model_path().stem


def _start_engine(engine_args: EngineArgs, limits: ServerLimits, lora_modules: list[LoRARequest],
                  fit_budget: bool = False) -> AsyncLLM:
    """One engine, or `data_parallel_size` replicas behind a router; a bad adapter stops the
    start, naming it. `fit_budget`: the engine's token budget follows this machine's speed
    (LLMEngine.fit_token_budget; replicas keep theirs)."""
    if engine_args.data_parallel_size == 1:
        def build() -> LLMEngine:
            engine = LLMEngine(engine_args)
            for adapter in lora_modules:
                engine.add_lora(adapter)
            engine.warm_up()  # before /health answers: the first requests find its lazily built state made
            if fit_budget:  # after the warm-up, whose first steps are slow by what they build
                engine.fit_token_budget()
            return engine

        return AsyncLLM(build_on_fresh_thread(build), limits.load_limits())
    from kvflow.engine.dp_async_llm import DPAsyncLLM

    replicas = DPAsyncLLM(engine_args, limits.load_limits())
    try:
        for adapter in lora_modules:
            asyncio.run(replicas.add_lora(adapter))
    except BaseException:
        replicas.shutdown()
        raise
    return replicas


def run_server(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    limits = ServerLimits.from_cli_args(args)
    allowed_hosts = HostAllowList.for_server(args.host, args.allowed_hosts)  # a bad entry stops the start here
    lora_modules = parse_lora_modules(args.lora_modules)
    async_llm = _start_engine(EngineArgs.from_cli_args(args), limits, lora_modules, getattr(args, "fit_token_budget", False))
    name = args.served_model_name or served_name(args.model)
    try:
        app = build_app(async_llm, name, args.api_key, limits, args.disallow_special_tokens_in_content,
                        args.tool_call_parser, lora_modules, args.allow_runtime_lora_updating, allowed_hosts,
                        flag_values(args.allowed_origins), args.disable_metrics_auth, not args.disable_dashboard)
    except ValueError:
        async_llm.shutdown()
        raise
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=limits.shutdown_timeout + SHUTDOWN_GRACE_SECONDS)
    server = _Server(config, on_shutdown=lambda: async_llm.shutdown(wait=False, reason="the server is shutting down"),
                     banner=f"serving {name}", drain_timeout=limits.shutdown_timeout)
    try:
        server.run()
    finally:
        async_llm.shutdown()
    return 0
