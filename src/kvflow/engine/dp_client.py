"""ReplicaClient: the server's side of one data-parallel replica process (dp_replica.py).

Requests go in over a pipe; a reader thread takes the replica's batches and hands each request's
outputs to its `RequestStream` on the caller's event loop, exactly as a one-engine AsyncLLM does,
so the server cannot tell the difference. The replica's stats arrive with every batch.

A replica that dies closes its end of the pipe, so the reader sees end-of-file at once: every
request in flight there ends with EngineDeadError naming the replica and its exit code, and the
client refuses new requests; the other replicas are not touched. A replica that hangs (busy, yet
finishing no engine iteration for `engine_iteration_timeout_s`: dp_watchdog.py) is treated the
same way, by the reader's decision instead of the kernel's: it is killed, then its requests end.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvflow.config import EngineArgs
from kvflow.engine.async_llm import RequestStream
from kvflow.engine.dp_replica import run_replica
from kvflow.engine.dp_watchdog import ReplicaWatchdog
from kvflow.engine.engine_thread import EngineDeadError
from kvflow.engine.load_limits import LoadLimits
from kvflow.engine.request_timing import FinishedRequest
from kvflow.engine.stats import EngineStats

logger = logging.getLogger("kvflow")


@dataclass
class _Live:
    request_id: str
    stream: RequestStream
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future


class ReplicaClient:
    def __init__(self, index: int, args: EngineArgs, limits: LoadLimits, num_threads: int, context) -> None:
        self.index = index
        self._conn, child_end = context.Pipe()
        # Not a daemon: a replica with tensor parallel starts its own ranks, which a daemon may not.
        # It still dies with the server (it watches the server's process).
        self.process = context.Process(target=run_replica, args=(child_end, args, limits, num_threads),
                                       name=f"kvflow-dp{index}", daemon=False)
        self.process.start()
        child_end.close()  # ours must go, or the replica's death would never read as end-of-file
        self.stats: EngineStats | None = None  # as of the replica's last batch (set once it is ready)
        self.on_finished: Callable[[FinishedRequest], None] = lambda finished: None
        self.on_death: Callable[[ReplicaClient], None] = lambda client: None
        self.dead_reason: str | None = None
        self._lock = threading.Lock()  # guards the live table and orders sends against death
        self._keys = itertools.count()
        self._live: dict[int, _Live] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._stopping: str | None = None
        self._watchdog = ReplicaWatchdog(limits.engine_iteration_timeout_s, time.monotonic())

    def wait_ready(self) -> None:
        """Block until the replica has loaded its engine; ValueError with its message if it could not."""
        try:
            kind, detail = self._conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise ValueError(f"data-parallel replica {self.index} died while starting "
                             f"(exit code {self.process.exitcode})") from None
        if kind == "failed":
            raise ValueError(f"data-parallel replica {self.index} could not start: {detail}")
        self.stats = detail
        threading.Thread(target=self._read, name=f"kvflow-dp{self.index}-reader", daemon=True).start()

    # -- any thread ------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.dead_reason is None

    @property
    def num_in_flight(self) -> int:
        return len(self._live)

    def holds(self, request_id: str) -> bool:
        with self._lock:
            return any(live.request_id == request_id for live in self._live.values())

    async def add_request(self, request_id: str, prompt, params, priority: int, cache_salt: str | None,
                          lora_request) -> RequestStream:
        loop = asyncio.get_running_loop()
        key = next(self._keys)
        stream = RequestStream(request_id, lambda _: self._abort(key))
        accepted = loop.create_future()
        with self._lock:
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            if not self._live:
                self._watchdog.restart(time.monotonic())
            self._live[key] = _Live(request_id, stream, loop, accepted)
            self._send(("add", key, request_id, prompt, params, time.monotonic(), priority, cache_salt, lora_request))
        try:
            await accepted
        except asyncio.CancelledError:
            self._abort(key)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """By id (AsyncLLM.abort): the stream stays open for the final, aborted output."""
        with self._lock:
            for key in [k for k, live in self._live.items() if live.request_id == request_id]:
                if self.dead_reason is None:
                    self._send(("abort", key))

    async def call(self, method: str, argument) -> object:
        """`engine.<method>(argument)` in the replica, between its steps."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._lock:
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            call_id = next(self._keys)
            self._calls[call_id] = (loop, done)
            self._send(("call", call_id, method, argument))
        return await done

    def shutdown(self, reason: str, timeout: float) -> None:
        """Ask the replica to stop (its requests end with EngineDeadError(reason)) and wait for it;
        kill it if it does not stop within `timeout`."""
        self.request_stop(reason)
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def request_stop(self, reason: str) -> None:
        """Ask the replica to stop, without waiting (from the server's event loop)."""
        with self._lock:
            self._stopping = reason
            if self.dead_reason is None:
                self._send(("stop", reason))

    def _abort(self, key: int) -> None:
        with self._lock:
            if self._live.pop(key, None) is not None and self.dead_reason is None:
                self._send(("abort", key))

    def _send(self, message: tuple) -> None:  # under the lock
        try:
            self._conn.send(message)
        except (BrokenPipeError, OSError):
            pass  # the reader is about to find the replica dead and tell everyone

    # -- the reader thread -----------------------------------------------------------------
    def _read(self) -> None:
        try:
            kill_reason = self._read_until_eof()
        except Exception as e:  # a fault of ours here would leave every request of this replica waiting forever
            logger.exception("data-parallel replica %d: reading its messages failed", self.index)
            kill_reason = (f"data-parallel replica {self.index} (pid {self.process.pid}) was killed: the server "
                           f"could not read its messages ({type(e).__name__}: {e}); its requests were lost")
        if kill_reason is not None:
            self._kill(kill_reason)
            return
        self.process.join(2)  # it closed the pipe by exiting: wait for its exit code
        self._die(self._stopping or f"data-parallel replica {self.index} (pid {self.process.pid}) died "
                                    f"(exit code {self.process.exitcode}); its requests were lost")

    def _read_until_eof(self) -> str | None:
        """Deliver the replica's batches until it closes the pipe (None), or until the watchdog
        finds it hung (why, for `_kill`)."""
        while True:
            try:  # a timed wait: silence, too, must reach the watchdog
                batch = self._conn.recv() if self._conn.poll(self._watchdog.poll_s) else None
            except (EOFError, OSError):
                return None
            progressed = False
            if batch is not None:
                _, messages, self.stats, progressed = batch
                for message in messages:
                    self._dispatch(message)
            stalled = self._watchdog.observe(time.monotonic(), self.num_in_flight, progressed)
            if stalled is not None:
                return (f"data-parallel replica {self.index} (pid {self.process.pid}) hung: no engine step finished "
                        f"for {stalled:.1f} s with {self.num_in_flight} request(s) in flight "
                        f"(engine_iteration_timeout_s={self._watchdog.timeout_s:g}); it was killed and its requests "
                        "were lost")

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "accepted":
            _, key, error = message
            with self._lock:
                live = self._live.get(key) if error is None else self._live.pop(key, None)
            if live is not None:
                _settle(live.loop, live.accepted, None, error)
        elif kind == "item":
            _, key, item = message
            final = isinstance(item, BaseException) or item[-1].finished
            with self._lock:
                live = self._live.pop(key, None) if final else self._live.get(key)
            if live is not None:
                # Any output means it was accepted: the replica may send the acceptance after a
                # request that finished at once, and add_request must not wait for it forever.
                _settle(live.loop, live.accepted, None, None)
                _call_on(live.loop, live.stream.put, item)
        elif kind == "finished":
            try:
                self.on_finished(message[1])
            except Exception:  # a faulty metrics hook must not stop the reader
                logger.exception("request-finished hook failed")
        elif kind == "called":
            _, call_id, result, error = message
            loop, done = self._calls.pop(call_id)
            _settle(loop, done, result, error)

    def _kill(self, reason: str) -> None:
        """The replica is alive but stuck (or unreadable): kill it (SIGKILL ends a stopped process
        too, and a stuck step cannot be interrupted any other way), then end its requests."""
        self.process.kill()
        self.process.join(5)
        self._die(reason)

    def _die(self, reason: str) -> None:
        with self._lock:
            self.dead_reason = reason
            live, self._live = self._live, {}
            calls, self._calls = self._calls, {}
        if self._stopping is None:
            logger.error("%s", reason)
        error = EngineDeadError(reason)
        for entry in live.values():
            _settle(entry.loop, entry.accepted, None, error)
            _call_on(entry.loop, entry.stream.put, error)
        for loop, done in calls.values():
            _settle(loop, done, None, error)
        self.on_death(self)


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: object, error: BaseException | None) -> None:
    """Resolve `future` on its own loop, unless its waiter already gave up."""
    def settle(_: object) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    _call_on(loop, settle, None)


def _call_on(loop: asyncio.AbstractEventLoop, fn: Callable[[object], None], arg: object) -> None:
    try:
        loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:  # that event loop is closed: nobody is waiting for it
        pass
