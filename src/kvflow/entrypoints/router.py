"""`kvflow router`: one OpenAI endpoint in front of prefill servers and decode servers.

Each completion or chat request goes first to a prefill server (`kvflow serve --kv-transfer-config
'{"kv_role": "kv_producer"}'`) with max_tokens=1 and no streaming: computing the prompt saves its
KV blocks to the store the servers share. The client's request then goes, unchanged, to a decode
server (`"kv_role": "kv_consumer"`), which loads those blocks instead of computing them; its
answer (streamed or not) is the client's. Servers of each role are taken in turn.

An error answer from the prefill server is the client's answer (the decode server never sees the
request); a client that leaves mid-stream closes the decode stream, which aborts the request there.

Failures (router_upstreams.py): a server that cannot be reached, runs out of time or breaks off
its answer is marked down and skipped until its /health says it is back, and the client gets an
OpenAI-shaped error naming the server and what failed (502, 504 on a timeout, 503 when no server
of a role is up). The prefill step, which has no effect a client can see, is tried once more on
another prefill server; the decode step only when its server could not even be reached, since a
decode server that took the request may have loaded (and so deleted) its blocks. A stream whose
decode server fails mid-way ends with an error event and `[DONE]`, never a silent cut. Every
upstream call is bounded: the prefill step by `--prefill-timeout-s`, each wait on a decode server
(for its answer, or for a stream's next bytes) by `--timeout-s`.

Blocks a prefill saved whose decode never comes (its decode server could not be reached, or
failed before loading them) stay in the store: nothing in the router can delete them, since only
the servers know the store. What bounds them is the store's own size bound (least recently used
blocks evicted first); until a decode server loads or the store evicts them they take its space.
"""

from __future__ import annotations

import argparse
import asyncio
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from kvflow.entrypoints.openai.errors import APIError
from kvflow.entrypoints.openai.serving import SSE_DONE, sse
from kvflow.entrypoints.router_upstreams import Upstream, UpstreamPool

# Fields of the client's request that the prefill request must not carry: it makes one token,
# unstreamed, and its output is thrown away.
PREFILL_DROPPED = ("stream", "stream_options", "max_completion_tokens", "n", "best_of", "logprobs", "top_logprobs",
                   "response_format", "tools", "tool_choice", "structured_outputs", "guided_json", "guided_regex",
                   "guided_choice", "guided_grammar")
TRIES_PER_STEP = 2  # a failed step is tried once more, on another server of the role


def build_router_app(prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 600.0,
                     prefill_timeout_s: float = 300.0, down_cooldown_s: float = 5.0) -> FastAPI:
    for name, value in (("--timeout-s", timeout_s), ("--prefill-timeout-s", prefill_timeout_s),
                        ("--down-cooldown-s", down_cooldown_s)):
        if not value > 0:
            raise ValueError(f"kvflow router: {name} must be a number > 0; got {value!r}")
    prefill = UpstreamPool("prefill", prefill_urls, down_cooldown_s)
    decode = UpstreamPool("decode", decode_urls, down_cooldown_s)
    # No cap on connections: a full pool would time out requests and mark healthy servers down.
    client = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=None))

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await client.aclose()

    app = FastAPI(title="kvflow router", lifespan=lifespan)

    async def run_prefill(path: str, body: dict, headers: dict) -> Response | None:
        """None once a prefill server has computed the prompt; otherwise the client's answer."""
        servers = await prefill.in_turn(client)
        if not servers:
            return prefill.none_up().response()
        prefill_body = {k: v for k, v in body.items() if k not in PREFILL_DROPPED} | {"max_tokens": 1}
        for server in servers[:TRIES_PER_STEP]:
            try:
                done = await client.post(server.url + path, json=prefill_body, headers=headers,
                                         timeout=prefill_timeout_s)
            except httpx.HTTPError as e:
                failure = prefill.failed(server, e, prefill_timeout_s)
                continue
            return None if done.status_code == 200 else \
                Response(done.content, done.status_code, media_type=done.headers.get("content-type"))
        return failure.response()

    async def run_decode(path: str, body: dict, headers: dict) -> Response:
        servers = await decode.in_turn(client)
        if not servers:  # the prompt's saved blocks are left to the store's bound (module docstring)
            return decode.none_up().response()
        for server in servers[:TRIES_PER_STEP]:
            try:
                upstream = await client.send(client.build_request("POST", server.url + path, json=body,
                                                                  headers=headers), stream=True)
                break
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # it never got the request: another may
                failure = decode.failed(server, e, timeout_s)
            except httpx.HTTPError as e:  # it may have taken the request (and its blocks): not retried
                return decode.failed(server, e, timeout_s).response()
        else:
            return failure.response()
        media_type = upstream.headers.get("content-type", "")
        if upstream.status_code == 200 and media_type.startswith("text/event-stream"):
            return StreamingResponse(relay_events(server, upstream), media_type=media_type,
                                     headers={"Cache-Control": "no-cache"}, background=BackgroundTask(upstream.aclose))
        try:
            content = await upstream.aread()
        except httpx.HTTPError as e:
            return decode.failed(server, e, timeout_s).response()
        finally:
            await upstream.aclose()
        return Response(content, upstream.status_code, media_type=media_type or None)

    async def relay_events(server: Upstream, upstream: httpx.Response):
        """The decode server's events, whole ones only; if it fails before `[DONE]`, an error
        event naming it, then `[DONE]`, so the client knows the answer is cut short."""
        pending, finished = b"", False
        try:
            async for chunk in upstream.aiter_bytes():
                events, end, pending = (pending + chunk).rpartition(b"\n\n")
                if end:
                    finished = events.endswith(SSE_DONE.strip().encode())
                    yield events + end
            if not finished:
                raise httpx.RemoteProtocolError("the stream ended before [DONE]")
        except httpx.HTTPError as e:
            yield sse(decode.failed(server, e, timeout_s).body())
            yield SSE_DONE
        finally:
            await upstream.aclose()

    async def forward(path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return APIError(400, "the request body is not JSON").response()
        if not isinstance(body, dict):
            return APIError(400, "the request body must be a JSON object").response()
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        refused = await run_prefill(path, body, headers)
        return refused if refused is not None else await run_decode(path, body, headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        for server in await decode.in_turn(client):
            try:
                answer = await client.get(server.url + "/v1/models", headers=headers)
            except httpx.HTTPError as e:
                decode.failed(server, e, timeout_s)
                continue
            return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))
        return decode.none_up().response()

    @app.get("/health")
    async def health() -> Response:
        """200 when every server answers /health with 200; otherwise 503 naming the ones that
        do not, and why."""
        await asyncio.gather(*(pool.probe(client, server) for pool in (prefill, decode) for server in pool.servers))
        down = [*prefill.down(), *decode.down()]
        if not down:
            return Response(status_code=200)
        return JSONResponse({"unhealthy": [s.url for s in down], "reasons": {s.url: f"{s.name} {s.down_reason}"
                                                                          for s in down}}, status_code=503)

    return app


def add_router_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("router", help="disaggregated serving: send each request to a prefill server, "
                                             "then to a decode server")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill servers (kv_producer)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode servers (kv_consumer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="the longest the router waits on a decode server: for its answer, or a stream's next bytes")
    p.add_argument("--prefill-timeout-s", type=float, default=300.0,
                   help="the longest one prefill step may take (then 504, or the next prefill server)")
    p.add_argument("--down-cooldown-s", type=float, default=5.0,
                   help="seconds a failed server is skipped before its /health is asked again")
    p.set_defaults(func=run_router)
    return p


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    from kvflow.entrypoints.listening import AnnouncedServer

    app = build_router_app(args.prefill, args.decode, args.timeout_s, args.prefill_timeout_s, args.down_cooldown_s)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    AnnouncedServer(config, "router", f"prefill: {', '.join(args.prefill)}; decode: {', '.join(args.decode)}").run()
    return 0
