"""The router's servers of one role (prefill or decode): which are up, whose turn it is, when to
look at a failed one again, and how each failure reads to a client.

A server that fails a request (refuses the connection, times out, drops the connection mid-answer)
is marked down with the reason, and requests skip it. Once `cooldown_s` has passed, the next
request that would use it first asks its /health: a 200 puts it back in turn, anything else starts
the cooldown again. The router's own /health asks every server and updates the marks as well, so
it names exactly the servers that are down, and a restarted server is back as soon as anyone asks.
Servers that answer with an error status are up: the error is the client's answer, not theirs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass

import httpx

from kvflow.entrypoints.openai.errors import APIError

logger = logging.getLogger("kvflow")
PROBE_TIMEOUT_SECONDS = 5.0  # a /health that takes longer than this is a server that is down


@dataclass
class Upstream:
    url: str
    role: str  # "prefill" or "decode"
    down_reason: str | None = None  # None while it is up
    retry_at: float = 0.0  # monotonic time from which a down server may be asked its /health again

    @property
    def name(self) -> str:
        return f"{self.role} server {self.url}"


class UpstreamPool:
    def __init__(self, role: str, urls: list[str], cooldown_s: float) -> None:
        if not urls:
            raise ValueError(f"kvflow router needs at least one --{role} server URL")
        self.role = role
        self.servers = [Upstream(url.rstrip("/"), role) for url in urls]
        self.cooldown_s = cooldown_s
        self._turns = itertools.count()

    async def in_turn(self, client: httpx.AsyncClient) -> list[Upstream]:
        """The servers that are up, in this request's order (round robin), once those whose
        cooldown has passed have been asked whether they are back."""
        turn = next(self._turns) % len(self.servers)
        ordered = self.servers[turn:] + self.servers[:turn]
        now = time.monotonic()
        await asyncio.gather(*(self.probe(client, s) for s in ordered if s.down_reason and s.retry_at <= now))
        return [s for s in ordered if s.down_reason is None]

    async def probe(self, client: httpx.AsyncClient, server: Upstream) -> None:
        """Ask `server`'s /health and mark it up or down by the answer."""
        server.retry_at = time.monotonic() + self.cooldown_s  # the requests meanwhile do not ask again
        try:
            status = (await client.get(server.url + "/health", timeout=PROBE_TIMEOUT_SECONDS)).status_code
            reason = None if status == 200 else f"its /health answered {status}"
        except httpx.HTTPError as e:
            reason = describe(e, PROBE_TIMEOUT_SECONDS)
        if reason is None:
            if server.down_reason is not None:
                logger.warning("%s is back", server.name)
            server.down_reason = None
        else:
            self.mark_down(server, reason)

    def mark_down(self, server: Upstream, reason: str) -> None:
        if server.down_reason is None:
            logger.error("%s is down: %s", server.name, reason)
        server.down_reason = reason
        server.retry_at = time.monotonic() + self.cooldown_s

    def failed(self, server: Upstream, error: httpx.HTTPError, timeout_s: float) -> APIError:
        """Mark `server` down for `error` and say so as the client's error: 504 when it ran out of
        time, else 502 (it could not be reached, or it broke off its answer)."""
        reason = describe(error, timeout_s)
        self.mark_down(server, reason)
        timed_out = isinstance(error, httpx.TimeoutException)
        return APIError(504 if timed_out else 502, f"{server.name} {reason}",
                        code="upstream_timeout" if timed_out else "upstream_failed")

    def none_up(self) -> APIError:
        """503 naming every server of the role and why it is down."""
        reasons = "; ".join(f"{s.url} {s.down_reason}" for s in self.servers)
        return APIError(503, f"no {self.role} server is up ({reasons}); each is asked again every "
                             f"{self.cooldown_s:g} s", code="upstream_unavailable")

    def down(self) -> list[Upstream]:
        return [s for s in self.servers if s.down_reason is not None]


def describe(error: httpx.HTTPError, timeout_s: float) -> str:
    """What went wrong with an upstream request, in words that fit after the server's name."""
    detail = str(error) or type(error).__name__
    if isinstance(error, httpx.TimeoutException):
        return f"did not answer within {timeout_s:g} s ({type(error).__name__})"
    if isinstance(error, httpx.ConnectError):
        return f"could not be reached ({detail})"
    return f"broke off its answer; it died or is restarting ({detail})"
