"""A throwaway Redis server for tests: `redis-server` (Debian's, installed by scripts/setup.sh) on a
free loopback port, no persistence, bounded by `maxmemory` with LRU eviction, as a KV-transfer store
would be run. Tests that need one say plainly when the binary is missing."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass

import pytest

REDIS_SERVER = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed here "
                                 "(scripts/setup.sh installs Debian's redis-server; or: apt-get install redis-server)")


@dataclass
class RedisServer:
    process: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(10)


def start_redis(max_bytes: int = 64 << 20, timeout_s: float = 20) -> RedisServer:
    with socket.socket() as probe:  # a free port (redis-server cannot pick one itself)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--maxmemory", str(max_bytes), "--maxmemory-policy", "allkeys-lru"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = RedisServer(process, port)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return server
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"redis-server did not come up on port {port}")
        time.sleep(0.05)
