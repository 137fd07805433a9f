"""What keeps web pages from driving the server (docs/limits.md, "Whom the server trusts").

Any page a local user opens can make the browser send requests to 127.0.0.1: a POST whose body
is `text/plain` is a "simple" cross-site request, sent without asking the server first (no CORS
preflight); and with DNS rebinding (the page's own name re-pointed at 127.0.0.1 after it loaded)
the browser even lets the page read the answers, since the server then looks like the page's own
origin. Three rules close both ways in:

- the Host check: on a loopback bind, a request must name the server by a loopback name or
  address, which a rebound page cannot (its requests carry its own name); `--allowed-hosts` adds
  names (a reverse proxy's), or turns the check on for another bind (`*`: no check);
- POST bodies are JSON only (`Content-Type: application/json`, checked by `require_json`): a
  cross-site page can send that only after a preflight, and a preflight gets no CORS grant;
- no CORS headers at all unless `--allowed-origins` names the origins that may call.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from kvflow.entrypoints.openai.errors import APIError

ANY_HOST = "*"


def flag_values(values: Sequence[str] | None) -> list[str]:
    """A list flag given comma-separated, repeated, or both: its entries, stripped, empty ones dropped."""
    return [entry.strip() for value in values or () for entry in value.split(",") if entry.strip()]


def is_loopback_bind(host: str) -> bool:
    """Whether binding `host` serves only this machine: a loopback address, `localhost`, or a name
    whose every address is loopback. An empty host binds every interface."""
    if not host:
        return False
    if _is_loopback_name(host.strip("[]")):
        return True
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:  # uvicorn will say why it cannot bind it
        return False
    return bool(addresses) and all(_is_loopback_name(a) for a in addresses)


@dataclass(frozen=True)
class HostAllowList:
    """The names a request's Host header may give: any loopback name or address, and `names`."""

    names: frozenset[str] = frozenset()

    @classmethod
    def for_server(cls, bind_host: str, allowed_hosts: Sequence[str] | None) -> HostAllowList | None:
        """The check a server bound to `bind_host` makes (None: none), from `--allowed-hosts`."""
        names = {_host_entry(entry) for entry in flag_values(allowed_hosts)}
        if ANY_HOST in names or not (names or is_loopback_bind(bind_host)):
            return None
        return cls(frozenset(names))

    def admits(self, host_header: str) -> bool:
        host = _host_name(host_header)
        return host is not None and (host in self.names or _is_loopback_name(host))


class HostCheck:
    """ASGI middleware: a request whose Host the allow list does not admit is a 403 before any
    route sees it (/health and /metrics too: a rebound page could read them as well)."""

    def __init__(self, app: ASGIApp, allowed: HostAllowList) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if not self.allowed.admits(host):
                error = APIError(403, f"the Host header {host!r} is not a name of this server: it serves loopback "
                                      "names and the names in --allowed-hosts (a check against web pages "
                                      "reaching it by DNS rebinding)", code="host_not_allowed")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def require_json(request: Request) -> None:
    """A POST body must say it is JSON; parameters (`; charset=utf-8`) may follow."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        got = f"got {content_type!r}" if content_type else "it has none"
        raise APIError(415, f"the request body must be sent with 'Content-Type: application/json'; {got}",
                       param="Content-Type", code="unsupported_media_type")


def allow_origins(app: FastAPI, origins: Sequence[str]) -> None:
    """CORS for the origins given (vLLM's --allowed-origins; none by default, so no page may call)."""
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])


def _is_loopback_name(host: str) -> bool:
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(host_header: str) -> str | None:
    """The host of a Host header (`name`, `name:port`, `[v6]`, `[v6]:port`), lower-case, without
    its port, brackets or a final dot; None if it is empty or malformed."""
    value = host_header.strip().lower()
    if value.startswith("["):
        address, bracket, rest = value[1:].partition("]")
        ok = bracket and address and (not rest or (rest.startswith(":") and rest[1:].isdigit()))
        return _canonical(address) if ok else None
    name, _, port = value.partition(":")
    if not name or (port and not port.isdigit()):
        return None
    return _canonical(name.rstrip("."))


def _canonical(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))  # one spelling per address
    except ValueError:
        return host


def _host_entry(entry: str) -> str:
    """One `--allowed-hosts` entry as _host_name gives hosts: a name or an address, no port."""
    if entry == ANY_HOST:
        return entry
    try:
        return str(ipaddress.ip_address(entry.strip("[]")))  # an address, IPv6 bracketed or not
    except ValueError:
        pass
    if ":" in entry or "/" in entry:  # a name with a port (or a URL): the check never sees ports
        raise ValueError(f"--allowed-hosts: {entry!r} is not a host name or address (give it without a port)")
    return entry.lower().rstrip(".")
