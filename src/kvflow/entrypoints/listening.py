"""The line a server prints once its socket is bound, `kvflow: <what> on http://host:port ...,
ready X s after the process started`: what scripts and the tests wait for, and how long a start
took as the user saw it (the interpreter's start and every import count)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import uvicorn

_IMPORTED_AT = time.monotonic()  # the fallback origin of the ready time (no /proc)


def listening_url(server: uvicorn.Server) -> str:
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def ready_line(server: uvicorn.Server, what: str, details: str = "") -> str:
    return (f"kvflow: {what} on {listening_url(server)}{f' ({details})' if details else ''}, "
            f"ready {seconds_since_process_start():.1f} s after the process started")


def seconds_since_process_start() -> float:
    """Wall time since this process began (Linux: its start time in /proc, so the interpreter's
    start and every import count), or since this module was imported where there is no /proc."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, in clock ticks
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_AT


class AnnouncedServer(uvicorn.Server):
    """uvicorn that prints its ready line once bound."""

    def __init__(self, config: uvicorn.Config, what: str, details: str = "") -> None:
        super().__init__(config)
        self.what = what
        self.details = details

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            print(ready_line(self, self.what, self.details), flush=True)
