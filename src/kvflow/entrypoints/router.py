"""`kvflow router`: one OpenAI endpoint in front of prefill servers and decode servers.

Each completion or chat request goes first to a prefill server (`kvflow serve --kv-transfer-config
'{"kv_role": "kv_producer"}'`) with max_tokens=1 and no streaming: computing the prompt saves its
KV blocks to the store the servers share. The client's request then goes, unchanged, to a decode
server (`"kv_role": "kv_consumer"`), which loads those blocks instead of computing them; its
answer (streamed or not) is the client's. Servers of each role are taken in turn.

An error from the prefill server is the client's answer (the decode server never sees the
request); a client that leaves mid-stream closes the decode stream, which aborts the request there.
"""

from __future__ import annotations

import argparse
import itertools
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

# Fields of the client's request that the prefill request must not carry: it makes one token,
# unstreamed, and its output is thrown away.
PREFILL_DROPPED = ("stream", "stream_options", "max_completion_tokens", "n", "best_of", "logprobs", "top_logprobs",
                   "response_format", "tools", "tool_choice", "structured_outputs", "guided_json", "guided_regex",
                   "guided_choice", "guided_grammar")


def build_router_app(prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 600.0) -> FastAPI:
    if not prefill_urls or not decode_urls:
        raise ValueError("kvflow router needs at least one --prefill and one --decode server URL")
    client = httpx.AsyncClient(timeout=timeout_s)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await client.aclose()

    app = FastAPI(title="kvflow router", lifespan=lifespan)
    turns = itertools.count()

    async def forward(path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": {"message": "the request body is not JSON", "type": "invalid_request_error"}},
                                status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the request body must be a JSON object",
                                           "type": "invalid_request_error"}}, status_code=400)
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        turn = next(turns)
        prefill, decode = prefill_urls[turn % len(prefill_urls)], decode_urls[turn % len(decode_urls)]
        prefill_body = {k: v for k, v in body.items() if k not in PREFILL_DROPPED} | {"max_tokens": 1}
        done = await client.post(prefill + path, json=prefill_body, headers=headers)
        if done.status_code != 200:
            return Response(done.content, done.status_code, media_type=done.headers.get("content-type"))
        upstream = await client.send(client.build_request("POST", decode + path, json=body, headers=headers),
                                     stream=True)
        return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code,
                                 media_type=upstream.headers.get("content-type"), background=BackgroundTask(upstream.aclose))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        answer = await client.get(decode_urls[0] + "/v1/models", headers=headers)
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))

    @app.get("/health")
    async def health() -> Response:
        """200 when every server answers /health with 200; otherwise 503 naming the ones that do not."""
        down = []
        for url in (*prefill_urls, *decode_urls):
            try:
                ok = (await client.get(url + "/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                down.append(url)
        return JSONResponse({"unhealthy": down}, status_code=503) if down else Response(status_code=200)

    return app


def add_router_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("router", help="disaggregated serving: send each request to a prefill server, "
                                             "then to a decode server")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill servers (kv_producer)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode servers (kv_consumer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout-s", type=float, default=600.0, help="the longest one upstream request may take")
    p.set_defaults(func=run_router)
    return p


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    app = build_router_app([u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode], args.timeout_s)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
