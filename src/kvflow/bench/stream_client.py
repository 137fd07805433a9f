"""One streamed request, timed as the client sees it, on one of three routes (vLLM's bench
names them as backends): `openai` (/v1/completions), `openai-chat` (/v1/chat/completions, the
prompt as one user message) and `openai-responses` (/v1/responses, the prompt as `input`).

The server-sent events are read line by line: each `data: {...}` chunk that carries text is a
content chunk (its arrival time is a token time: a completion's `text`, a chat `delta.content`, a
`response.output_text.delta` event), a chunk with usage gives the exact token counts
(`stream_options.include_usage`; the Responses API's last event, completed or incomplete), and `data: [DONE]`
(or, for the Responses API, the end of the body) ends the stream. Chat and Responses take text:
a token-id prompt is sent as the text the server's /detokenize makes of it.
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


BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions", "openai-responses": "/v1/responses"}


def completions_url(url: str, backend: str = "openai") -> str:
    return base_url(url) + BACKENDS[backend]


async def prompt_text(client: httpx.AsyncClient, url: str, model: str, prompt: str | list[int]) -> str:
    """A prompt as text: token ids through the server's /detokenize."""
    if isinstance(prompt, str):
        return prompt
    response = await client.post(base_url(url) + "/detokenize", json={"model": model, "tokens": prompt})
    response.raise_for_status()
    return str(response.json()["prompt"])


async def fetch_model_name(client: httpx.AsyncClient, url: str) -> str:
    """The first model the server lists, for when `--model` is not given."""
    response = await client.get(base_url(url) + "/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{url} lists no model at /v1/models; pass --model")
    return str(models[0]["id"])


def request_body(model: str, request: SampleRequest, ignore_eos: bool, backend: str = "openai") -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "temperature": 0.0, "stream": True}
    if backend == "openai-responses":
        body.update(input=request.prompt, max_output_tokens=request.output_len)
    else:
        body.update(max_tokens=request.output_len, stream_options={"include_usage": True})
        body.update({"messages": [{"role": "user", "content": request.prompt}]} if backend == "openai-chat"
                    else {"prompt": request.prompt})
    if ignore_eos:  # not in OpenAI's API; vLLM, llama.cpp and kvflow read it, others ignore it
        body["ignore_eos"] = True
    return body


def _text_and_usage(chunk: dict[str, Any]) -> tuple[bool, dict[str, Any] | None]:
    """Whether a chunk carries text, and the usage it carries (completions' and chat's names)."""
    kind = chunk.get("type", "")
    if kind.startswith("response."):  # the Responses API's events
        usage = (chunk.get("response") or {}).get("usage")  # on the last: completed, incomplete or failed
        usage = usage and {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens")}
        return kind == "response.output_text.delta" and bool(chunk.get("delta")), usage
    choices = chunk.get("choices") or []
    has_text = any(c.get("text") or (c.get("delta") or {}).get("content") for c in choices)
    return has_text, chunk.get("usage")


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
        error = chunk.get("error") or (chunk.get("message") if chunk.get("type") == "error" else None)
        if error:
            self.error = str(error.get("message", error) if isinstance(error, dict) else error)
            return False
        has_text, usage = _text_and_usage(chunk)
        if has_text:
            self.stamps.append(now)
        self.usage = usage or self.usage
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
                       ignore_eos: bool = True, backend: str = "openai") -> RequestRecord:
    """Stream one completion; failures come back as a record with ok=False, never raise."""
    stream = _Stream(start=time.perf_counter())
    try:
        async with client.stream("POST", url, json=request_body(model, request, ignore_eos, backend)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")[:300]
                return RequestRecord(ok=False, error=f"HTTP {response.status_code}: {body}")
            async for line in response.aiter_lines():
                if not stream.feed(line, time.perf_counter()):
                    break
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        return RequestRecord(ok=False, error=f"{type(err).__name__}: {err}")
    return stream.record(time.perf_counter(), request.prompt_len)
