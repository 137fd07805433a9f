"""Live kvflow servers on 127.0.0.1 for tests: `kvflow serve` as a real process, or an app served
by uvicorn on a thread of the test process. Both bind port 0 and report the port they got."""

from __future__ import annotations

import ctypes
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import uvicorn

KVFLOW = [sys.executable, "-m", "kvflow.entrypoints.cli"]
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: the kernel kills the server when the test process dies, so a
    test run that is killed (a timeout, Ctrl-C) leaves no server holding gigabytes behind."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
_URL = re.compile(r"on (http://127\.0\.0\.1:\d+)")


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str = ""
    lines: list[str] = field(default_factory=list)  # everything it printed so far

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout)


def start_process(args: list[str], timeout: float = 180, command: str = "serve") -> ServerProcess:
    """Start `kvflow serve --port 0 ARGS` (or `kvflow router --port 0 ARGS`) and wait for the URL it prints."""
    quiet = ["--uvicorn-log-level", "warning", "--disable-log-stats"] if command == "serve" else []
    cmd = [*KVFLOW, command, "--port", "0", *quiet, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_die_with_parent)
    server = ServerProcess(proc)
    threading.Thread(target=_drain, args=(server,), daemon=True).start()  # the pipe must never fill
    deadline = time.monotonic() + timeout
    while not server.url:
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"kvflow {command} did not come up:\n{server.output}")
        time.sleep(0.1)
    return server


@pytest.fixture
def own_server() -> Iterator[Callable[[list[str]], ServerProcess]]:
    """`own_server(ARGS)` starts a server for this test alone, so a test that stops it leaves the
    module's server to the others whatever the order; stopped after the test however it ends.
    A test module uses it by binding it to a name of its own (`own_server = live_server.own_server`)."""
    started: list[ServerProcess] = []

    def start(args: list[str]) -> ServerProcess:
        started.append(start_process(args))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def _drain(server: ServerProcess) -> None:
    for line in server.proc.stdout:
        server.lines.append(line)
        match = _URL.search(line)
        if match and not server.url:
            server.url = match.group(1)


@dataclass
class ServerThread:
    server: uvicorn.Server
    thread: threading.Thread
    url: str

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_thread(app, timeout: float = 30) -> ServerThread:
    """Serve an ASGI app in this process (the engine it wraps is already loaded)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("in-process server did not start")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return ServerThread(server, thread, f"http://127.0.0.1:{port}")


def wait_until(condition, timeout: float, interval: float = 0.05) -> bool:
    """Poll `condition` until it is true or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {name: value} for unlabelled-or-single-labelled samples (labels dropped)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name.split("{")[0]] = float(value)
    return values


def edit_finished_outputs(monkeypatch, engine, edit: Callable[[object], None]) -> None:
    """Make `engine` (served in this process) pass every finished CompletionOutput through
    `edit` before the server sees it: how tests give the server outputs a real model would
    rarely produce."""
    step = engine.step

    def edited_step():
        outputs = step()
        for out in outputs:
            for completion in out.outputs:
                if completion.finish_reason is not None:
                    edit(completion)
        return outputs

    monkeypatch.setattr(engine, "step", edited_step)


@contextmanager
def served_engine(args, model_name: str) -> Iterator[tuple[ServerThread, object]]:
    """An AsyncLLM of `args` (EngineArgs) served in this process: (the server, the engine), both
    stopped when the block ends."""
    from kvflow import AsyncLLM  # here: importing kvflow imports triton's kernels, after TRITON_INTERPRET
    from kvflow.entrypoints.openai.api_server import build_app

    engine = AsyncLLM.from_engine_args(args)
    server = start_thread(build_app(engine, model_name))
    try:
        yield server, engine
    finally:
        server.stop()
        engine.shutdown()
