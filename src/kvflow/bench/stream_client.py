"""One streamed `/v1/completions` request, timed as the client sees it.

The server-sent events are read line by line: each `data: {...}` chunk whose choices carry
text is a content chunk (its arrival time is a token time), a chunk with `usage` gives the
exact token counts (`stream_options.include_usage`), and `data: [DONE]` ends the stream.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvflow.bench.datasets import SampleRequest
from kvflow.bench.report import RequestRecord


def base_url(url: str) -> str:
    """The server root of `url`, which may also be given as …/v1 or …/v1/completions."""
    root = url.rstrip("/")
    for suffix in ("/completions", "/v1"):
        root = root.removesuffix(suffix)
    return root


def completions_url(url: str) -> str:
    return base_url(url) + "/v1/completions"


async def fetch_model_name(client: httpx.AsyncClient, url: str) -> str:
    """The first model the server lists, for when `--model` is not given."""
    response = await client.get(base_url(url) + "/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{url} lists no model at /v1/models; pass --model")
    return str(models[0]["id"])


def request_body(model: str, request: SampleRequest, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:  # not in OpenAI's API; vLLM, llama.cpp and kvflow read it, others ignore it
        body["ignore_eos"] = True
    return body


@dataclass
class _Stream:
    """What has arrived so far on one stream."""

    start: float
    stamps: list[float] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: str = ""

    def feed(self, line: str, now: float) -> bool:
        """Take one SSE line; False once the stream is over."""
        if not line.startswith("data:"):
            return True  # blank separators, comments, `event:` lines
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            return False
        chunk = json.loads(data)
        if "error" in chunk:
            self.error = str(chunk["error"].get("message", chunk["error"]) if isinstance(chunk["error"], dict)
                             else chunk["error"])
            return False
        if any(choice.get("text") for choice in chunk.get("choices") or []):
            self.stamps.append(now)
        self.usage = chunk.get("usage") or self.usage
        return True

    def record(self, end: float, prompt_len: int | None) -> RequestRecord:
        if self.error or not self.stamps:
            return RequestRecord(ok=False, error=self.error or "the stream carried no text")
        usage = self.usage or {}
        return RequestRecord(
            ok=True,
            ttft=self.stamps[0] - self.start,
            itls=tuple(b - a for a, b in zip(self.stamps, self.stamps[1:])),
            e2e=end - self.start,
            prompt_tokens=int(usage.get("prompt_tokens") or prompt_len or 0),
            # Without usage, count chunks: a server may pack several tokens into one.
            output_tokens=int(usage.get("completion_tokens") or len(self.stamps)),
        )


async def send_request(client: httpx.AsyncClient, url: str, model: str, request: SampleRequest,
                       ignore_eos: bool = True) -> RequestRecord:
    """Stream one completion; failures come back as a record with ok=False, never raise."""
    stream = _Stream(start=time.perf_counter())
    try:
        async with client.stream("POST", url, json=request_body(model, request, ignore_eos)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")[:300]
                return RequestRecord(ok=False, error=f"HTTP {response.status_code}: {body}")
            async for line in response.aiter_lines():
                if not stream.feed(line, time.perf_counter()):
                    break
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        return RequestRecord(ok=False, error=f"{type(err).__name__}: {err}")
    return stream.record(time.perf_counter(), request.prompt_len)
