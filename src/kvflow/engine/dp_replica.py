"""One data-parallel replica: an LLMEngine in its own process, driven over a pipe by its
`ReplicaClient` in the server's process (dp_client.py).

Inside, the replica is what a one-engine server is: an `EngineThread` stepping the engine, with the
same load limits and fault containment; this module only translates the pipe into its commands and
its deliveries back into messages. Requests are named on the wire by a key the client chose (an
integer never reused), not by the caller's request id, which may be reused once a request ends.

The wire, client → replica:
    ("add", key, request_id, prompt, params, arrival_time, priority, cache_salt, lora_request)
    ("abort", key)   ("call", call_id, method, argument)   ("stop", reason)
replica → client: first ("ready", EngineStats) or ("failed", message), then batches
    ("batch", [("accepted", key, error | None) | ("item", key, outputs | error)
               | ("finished", FinishedRequest) | ("called", call_id, result, error)], EngineStats, progressed)
one per engine iteration, and a heartbeat every HEARTBEAT_SECONDS besides. `progressed` says
whether the engine finished an iteration since the previous batch, or waits idle for work: the
server's watchdog (dp_watchdog.py) kills a replica that is busy and makes none, whose heartbeat
alone would not tell.

A request's grammar (structured output) is compiled here, on the replica's event loop and the
compiler's threads, before the request is handed to the engine thread: a compile that takes
seconds must never stop the replica's other streams, nor look to the watchdog like a hung step.
When the client's end closes (the server died), or the engine thread dies, the replica stops.
"""

from __future__ import annotations

import asyncio
import logging
from multiprocessing.connection import Connection

from kvflow.config import EngineArgs
from kvflow.engine.async_llm import compile_grammar
from kvflow.engine.engine_thread import (
    AbortCommand,
    AddCommand,
    CallCommand,
    EngineDeadError,
    EngineThread,
    RequestFailedError,
    StopCommand,
    build_on_fresh_thread,
)
from kvflow.engine.load_limits import LoadLimits
from kvflow.engine.request_timing import FinishedRequest

logger = logging.getLogger("kvflow")
HEARTBEAT_SECONDS = 0.5


def run_replica(conn: Connection, args: EngineArgs, limits: LoadLimits, num_threads: int) -> None:
    """The replica process's entry point (spawned: nothing of the server's state is inherited)."""
    import torch

    from kvflow.distributed.process_groups import die_with_parent
    from kvflow.engine.llm_engine import LLMEngine

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    die_with_parent()  # not a daemon (its tensor-parallel ranks are its children): it follows the server
    torch.set_num_threads(num_threads)
    try:
        def build() -> LLMEngine:
            engine = LLMEngine(args)
            engine.warm_up()  # before "ready": the first requests find its lazily built state made
            return engine

        engine = build_on_fresh_thread(build)  # the engine thread's OpenMP team alone
    except BaseException as e:  # the server reports it and stops starting
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", engine.get_stats()))
    try:
        asyncio.run(_Replica(conn, engine, limits).serve())
    finally:
        engine.shutdown()


class _Handle:
    """A request's owner token inside the replica (EngineThread aborts by owner identity)."""

    def __init__(self, key: int, request_id: str) -> None:
        self.key = key
        self.request_id = request_id


class _Replica:
    def __init__(self, conn: Connection, engine, limits: LoadLimits) -> None:
        self.conn = conn
        self.thread = EngineThread(engine, self._on_finished, limits)
        # Safe to use from this loop's thread (the matchers stay the engine's).
        self.compiler = engine.structured_output.compiler if engine.structured_output else None
        self.handles: dict[int, _Handle] = {}  # requests the client may still abort
        self.outbox: list[tuple] = []
        # The stats last sent. EngineThread replaces its stats object after every iteration, so a
        # different object means the engine finished one since: progress, as the watchdog counts it.
        self.sent_stats = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.done: asyncio.Future | None = None
        self.stopping = False

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.done = self.loop.create_future()
        self.loop.add_reader(self.conn.fileno(), self._read)
        heartbeat = asyncio.create_task(self._heartbeat())
        try:
            await self.done
        finally:
            heartbeat.cancel()
            self.loop.remove_reader(self.conn.fileno())

    # -- client → replica ------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while self.conn.poll():
                self._apply(self.conn.recv())
        except (EOFError, OSError):  # the server is gone: nobody is left to answer
            self._stop("the server went away")

    def _apply(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            self._add(*msg[1:])
        elif kind == "abort":
            handle = self.handles.pop(msg[1], None)
            if handle is not None:
                self._submit(AbortCommand([handle.request_id], owner=handle))
        elif kind == "call":
            _, call_id, method, argument = msg
            done = self.loop.create_future()
            done.add_done_callback(lambda f: self._post(("called", call_id, *_outcome(f))))
            self._submit(CallCommand(lambda engine: getattr(engine, method)(argument), self.loop, done))
        elif kind == "stop":
            self._stop(msg[1])

    def _add(self, key: int, request_id: str, prompt, params, arrival: float, priority: int, salt, lora) -> None:
        handle = _Handle(key, request_id)
        accepted = self.loop.create_future()
        accepted.add_done_callback(lambda f: self._accepted(handle, f))
        self.handles[key] = handle  # now, so that an abort read right after finds it
        command = AddCommand(request_id, prompt, params, arrival, priority, salt, self.loop,
                             lambda item: self._deliver(handle, item), accepted, owner=handle, lora_request=lora)
        if params.structured_outputs is None or self.compiler is None:
            self._submit(command)
        else:
            self.loop.create_task(self._compile_then_submit(handle, command))

    async def _compile_then_submit(self, handle: _Handle, command: AddCommand) -> None:
        """Compile the request's grammar on this loop's compiler threads (never on the engine
        thread, which would stop every stream of the replica), then queue it."""
        try:
            command.grammar = await compile_grammar(self.compiler, command.params)
        except Exception as e:  # refused (ValueError) or overloaded: the client is told, nothing is queued
            command.accepted.set_exception(e)
            return
        if self.handles.get(handle.key) is not handle:  # aborted while its grammar compiled
            command.accepted.set_exception(RequestFailedError("aborted before it was queued"))
            return
        self._submit(command)

    def _submit(self, command) -> None:
        try:
            self.thread.submit(command)
        except EngineDeadError as e:  # the engine died: fail what the command was waiting for
            if isinstance(command, (AddCommand, CallCommand)):
                future = command.accepted if isinstance(command, AddCommand) else command.done
                if not future.done():
                    future.set_exception(e)

    def _stop(self, reason: str) -> None:
        if self.stopping:
            return
        self.stopping = True
        try:
            self.thread.submit(StopCommand(reason))
        except EngineDeadError:
            pass
        self.loop.create_task(self._finish())

    async def _finish(self) -> None:
        await asyncio.to_thread(self.thread.join, None)
        await asyncio.sleep(0)  # the thread's last deliveries run on this loop first
        self._flush()
        self.done.set_result(None)

    # -- replica → client ------------------------------------------------------------------
    def _accepted(self, handle: _Handle, future: asyncio.Future) -> None:
        error = _outcome(future)[1]
        if error is not None:
            self.handles.pop(handle.key, None)
        self._post(("accepted", handle.key, error))

    def _deliver(self, handle: _Handle, item) -> None:
        if isinstance(item, BaseException) or item[-1].finished:
            self.handles.pop(handle.key, None)
        self._post(("item", handle.key, item))

    def _on_finished(self, finished: FinishedRequest) -> None:  # on the engine thread
        self.loop.call_soon_threadsafe(self._post, ("finished", finished))

    def _post(self, message: tuple) -> None:
        if not self.outbox:  # one send per wake-up: a step's deliveries arrive in one callback
            self.loop.call_soon(self._flush)
        self.outbox.append(message)

    def _flush(self) -> None:
        messages, self.outbox = self.outbox, []
        stats = self.thread.stats
        # An idle engine is not a hung one: its requests may still be compiling their grammars here.
        progressed, self.sent_stats = stats is not self.sent_stats or self.thread.idle, stats
        try:
            self.conn.send(("batch", messages, stats, progressed))
        except (BrokenPipeError, OSError):
            self._stop("the server went away")

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            if not self.outbox:
                self._flush()
            if not self.thread.is_alive():  # the engine died (its requests were told why): so does
                self._stop("the engine died")  # the replica, and the server sees it gone


def _outcome(future: asyncio.Future) -> tuple[object, BaseException | None]:
    """(result, error) of a settled future; a cancelled one reads as an error."""
    if future.cancelled():
        return None, RuntimeError("cancelled")
    error = future.exception()
    return (None, error) if error is not None else (future.result(), None)
