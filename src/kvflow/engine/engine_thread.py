"""The one background thread that drives an LLMEngine for AsyncLLM.

The engine is not thread-safe, so this thread is its only caller. Commands (add, abort, stop) come
in through a queue and are applied between steps; the thread steps while there is work and blocks
on the queue when there is none. Everything it hands back (acceptances, outputs, errors) goes to
the caller's event loop through `call_soon_threadsafe`, batched per loop so that one wake-up
carries a whole step.

Requests are named by the caller's id, but the thread aborts on a stream's behalf only while that
id still belongs to the stream: ids are reused once a request ends, and a refused duplicate has
the id of another request, so an abort by id alone could end someone else's request.

Faults are contained at the smallest scope the engine allows: a request that fails to be added
fails alone; a step that raises fails the requests the engine says it touched and the loop goes
on. A fault in the loop itself (or in abort, which means the engine's state is lost), a device
fault, or too many failed steps in a row stop the thread, and then every caller is told.

Load is bounded by `LoadLimits`: adds beyond the per-iteration quota wait in a backlog (in order;
an abort reaches them there too), and a full waiting queue refuses new requests as overloaded.

The live page's snapshots (engine/snapshot.py) are published here, between steps, when a viewer
asked since the last one; a viewer's ask wakes an idle engine so that what it sees is current.

Build the engine with `build_on_fresh_thread`, not on the thread that will serve HTTP. torch's
OpenMP (libgomp) keeps a team of worker threads for every thread that ever ran a parallel region.
Once there are more of those workers than cores, it stops letting them spin between regions, and
every region then waits ~80 µs for a worker to wake. Loading a model on the server's main thread
left such a team behind. Each of a decode step's ~150 regions on the engine thread paid that:
served decode steps took 45 ms against 30 offline (SmolLM2, 16 requests, 2 cores). A team whose
thread has ended is freed.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from kvflow.device_faults import is_device_fault
from kvflow.engine.llm_engine import LLMEngine, PromptType
from kvflow.engine.load_limits import EngineOverloadedError, LoadLimits
from kvflow.engine.outputs import RequestOutput
from kvflow.engine.request_timing import FinishedRequest, RequestTiming
from kvflow.engine.snapshot import EngineSnapshot, SnapshotFeed
from kvflow.lora.request import LoRARequest
from kvflow.sampling_params import SamplingParams
from kvflow.structured_output.backend import CompiledGrammar

logger = logging.getLogger("kvflow")

T = TypeVar("T")
Item = list[RequestOutput] | BaseException  # one step's outputs of one request, or why it ended
Deliver = Callable[[Item], None]  # runs on the request's event loop


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down or died); no request can run."""


class RequestFailedError(RuntimeError):
    """An internal fault ended this request; the engine goes on serving the others."""


@dataclass
class AddCommand:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    arrival_time: float
    priority: int
    cache_salt: str | None
    loop: asyncio.AbstractEventLoop
    deliver: Deliver
    accepted: asyncio.Future  # resolved (or failed with the ValueError) before any output
    owner: object  # the caller's handle of this request (its stream), for AbortCommand.owner
    lora_request: LoRARequest | None = None
    grammar: CompiledGrammar | None = None  # its structured_outputs, compiled off this thread


@dataclass
class CallCommand:
    """Run `fn(engine)` between steps (load or remove a LoRA adapter); `done` gets its result, or
    the ValueError it raised."""

    fn: Callable[[LLMEngine], object]
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


@dataclass
class AbortCommand:
    request_ids: list[str]
    owner: object | None = None  # abort only while the id belongs to this owner's request


@dataclass
class StopCommand:
    """End the thread: every request in flight fails with EngineDeadError(reason), none is cut
    short as if it had finished."""

    reason: str = "the engine is shut down"


@dataclass
class WakeCommand:
    """Nothing to do but one iteration: an idle engine publishes the snapshot a viewer asked for."""


@dataclass
class _Live:
    loop: asyncio.AbstractEventLoop
    deliver: Deliver
    owner: object
    timing: RequestTiming


@dataclass
class _Outbox:
    """What one loop iteration hands back, grouped by event loop."""

    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Callable, object]]] = field(default_factory=dict)

    def post(self, loop: asyncio.AbstractEventLoop, fn: Callable, arg: object) -> None:
        self.by_loop.setdefault(loop, []).append((fn, arg))


class EngineThread:
    def __init__(self, engine: LLMEngine, on_finished: Callable[[FinishedRequest], None],
                 limits: LoadLimits = LoadLimits()) -> None:
        self.engine = engine
        self.limits = limits
        self._backlog: dict[object, AddCommand] = {}  # by owner: adds not yet applied, in arrival order
        self._failed_steps = 0  # in a row
        self.stats = engine.get_stats()  # replaced whole after every iteration: readers need no lock
        self._on_finished = on_finished
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders "closed?" checks against the final drain of the queue
        self._closed_reason: str | None = None
        self._live: dict[str, _Live] = {}
        self._outbox = _Outbox()
        # Waiting for a command with nothing to run: whoever watches for a hung engine must not
        # count this time (a request may be on its way: its grammar compiling, say).
        self.idle = False
        self.snapshots = SnapshotFeed()
        self._thread = threading.Thread(target=self._run, name="kvflow-engine", daemon=True)
        self._thread.start()

    # -- any thread ------------------------------------------------------------------------
    def submit(self, command: AddCommand | AbortCommand | StopCommand | CallCommand | WakeCommand) -> None:
        with self._lock:
            if self._closed_reason is not None:
                raise EngineDeadError(self._closed_reason)
            self._commands.put(command)

    def is_alive(self) -> bool:
        return self._closed_reason is None and self._thread.is_alive()

    def latest_snapshot(self) -> EngineSnapshot | None:
        """The engine as of the last snapshot published (None before the first); the next
        iteration publishes a fresh one, waking the engine if it waits for work."""
        snapshot = self.snapshots.ask()
        if self.idle and self.snapshots.wanted:  # read after the ask: an engine going idle now sees it (_take)
            try:
                self.submit(WakeCommand())
            except EngineDeadError:
                pass  # the last snapshot stays the last
        return snapshot

    def join(self, timeout: float | None) -> None:
        self._thread.join(timeout)

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        reason = StopCommand.reason
        try:
            while (reason := self._serve_once()) is None:
                pass
        except EngineDeadError as e:
            logger.error("the engine is dead: %s", e)
            reason = str(e)
        except BaseException:
            logger.exception("the engine loop died")
            reason = "the engine loop died; see the server log"
        finally:
            self._close(reason)

    def _serve_once(self) -> str | None:
        """One iteration; returns why to stop, or None to go on."""
        commands = self._take(block=not self.engine.has_unfinished_requests() and not self._backlog)
        for i, command in enumerate(commands):
            if isinstance(command, StopCommand):
                for later in commands[i + 1:]:  # back on the queue, so _close refuses them
                    self._commands.put(later)
                self.engine.abort_request(list(self._live))  # free; _close tells each caller why
                self.stats = self.engine.get_stats()
                return command.reason
            if isinstance(command, AddCommand):
                self._backlog[_backlog_key(command)] = command
            elif isinstance(command, CallCommand):
                self._call(command)
            elif isinstance(command, AbortCommand):
                self._abort(command.request_ids, command.owner)
        for _ in range(min(len(self._backlog), self.limits.max_admissions_per_step)):
            self._add(self._backlog.pop(next(iter(self._backlog))))
        self._flush()  # acceptances go out now, not after the next step
        if self.engine.has_unfinished_requests():
            self._step()
        self.stats = self.engine.get_stats()
        self._flush()  # the step's tokens go out before a viewer's snapshot is taken
        self.snapshots.serve(self.engine, self.stats)
        return None

    def _take(self, block: bool) -> list:
        commands = []
        if block:
            self.idle = True
            try:
                if not self.snapshots.wanted:  # a viewer that asked just before goes unanswered otherwise
                    commands = [self._commands.get()]
            finally:
                self.idle = False
        while not self._commands.empty():
            commands.append(self._commands.get_nowait())
        return commands

    def _add(self, cmd: AddCommand) -> None:
        if self.limits.overloaded(self.engine.scheduler.num_waiting, cmd.params.n):
            self._outbox.post(cmd.loop, _settle(cmd.accepted), EngineOverloadedError(
                f"the server is busy: {self.engine.scheduler.num_waiting} completions are waiting; try again later"))
            return
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.arrival_time, cmd.priority, cmd.cache_salt,
                                    cmd.lora_request, cmd.grammar)
        except ValueError as e:  # bad input: the engine queued nothing
            self._outbox.post(cmd.loop, _settle(cmd.accepted), e)
            return
        except Exception:  # the engine queued nothing of it either
            logger.exception("adding request %s failed", cmd.request_id)
            self._outbox.post(cmd.loop, _settle(cmd.accepted), RequestFailedError("internal error while adding the request"))
            return
        self._live[cmd.request_id] = _Live(cmd.loop, cmd.deliver, cmd.owner, RequestTiming(cmd.request_id))
        self._outbox.post(cmd.loop, _settle(cmd.accepted), None)

    def _call(self, cmd: CallCommand) -> None:
        try:
            result = cmd.fn(self.engine)
        except ValueError as e:  # refused input (a bad adapter): the engine is unchanged
            self._outbox.post(cmd.loop, _settle(cmd.done), e)
            return
        except Exception:  # a fault of ours, but the call's alone: the loop goes on
            logger.exception("engine call failed")
            self._outbox.post(cmd.loop, _settle(cmd.done), RequestFailedError("internal error in the engine call"))
            return
        self._outbox.post(cmd.loop, _settle(cmd.done, result), None)

    def _abort(self, request_ids: list[str], owner: object | None = None) -> None:
        if owner is not None and owner in self._backlog:  # never added: nothing to abort
            cmd = self._backlog.pop(owner)
            self._outbox.post(cmd.loop, _settle(cmd.accepted), RequestFailedError("aborted before it was queued"))
            return
        if owner is None:  # an abort by id overtakes nothing: add what it names, then abort it
            for cmd in [c for c in self._backlog.values() if c.request_id in request_ids]:
                self._add(self._backlog.pop(_backlog_key(cmd)))
        for request_id in request_ids:
            live = self._live.get(request_id)
            if owner is not None and (live is None or live.owner is not owner):
                continue  # that request ended (or was never added); the id may be another's now
            self._live.pop(request_id, None)
            outputs = self.engine.abort_request(request_id)
            if live is not None and outputs:
                self._outbox.post(live.loop, live.deliver, outputs)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; failing the requests it was running")
            self._fail(self.engine.abort_failed_step())
            self._failed_steps += 1
            if is_device_fault(e):
                raise EngineDeadError("the device reported a fault; see the server log") from e
            if self._failed_steps >= self.limits.max_consecutive_step_failures:
                raise EngineDeadError(f"{self._failed_steps} engine steps failed in a row; see the server log") from e
            return
        self._failed_steps = 0
        self._dispatch(outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_request: dict[str, list[RequestOutput]] = {}
        for out in outputs:  # n > 1: a step can finish several completions of one request
            by_request.setdefault(out.request_id, []).append(out)
        for request_id, outs in by_request.items():
            live = self._live.get(request_id)
            if live is None:
                continue
            finished = live.timing.observe(outs)
            if outs[-1].finished:
                del self._live[request_id]
            if finished is not None:
                self._notify(finished)
            self._outbox.post(live.loop, live.deliver, outs)

    def _fail(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            live = self._live.pop(request_id, None)  # every engine request is live; a lapse must not kill the loop
            if live is not None:
                self._outbox.post(live.loop, live.deliver, RequestFailedError("internal error while running the request"))

    def _notify(self, finished: FinishedRequest) -> None:
        try:
            self._on_finished(finished)
        except Exception:  # a faulty metrics hook must not stop the engine
            logger.exception("request-finished hook failed")

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, _Outbox()
        for loop, items in outbox.by_loop.items():
            try:
                loop.call_soon_threadsafe(_run_all, items)
            except RuntimeError:  # that event loop is closed: nobody will read its requests
                orphans = [rid for rid, live in self._live.items() if live.loop is loop]
                for request_id in orphans:
                    del self._live[request_id]
                self.engine.abort_request(orphans)

    def _close(self, reason: str) -> None:
        with self._lock:
            self._closed_reason = reason
        queued = [*self._backlog.values()]
        self._backlog.clear()
        while not self._commands.empty():
            queued.append(self._commands.get_nowait())
        for cmd in queued:
            if isinstance(cmd, AddCommand):
                self._outbox.post(cmd.loop, _settle(cmd.accepted), EngineDeadError(reason))
            elif isinstance(cmd, CallCommand):
                self._outbox.post(cmd.loop, _settle(cmd.done), EngineDeadError(reason))
        for live in self._live.values():
            self._outbox.post(live.loop, live.deliver, EngineDeadError(reason))
        self._live.clear()
        self._flush()


def build_on_fresh_thread(build: Callable[[], T]) -> T:
    """`build()` (an engine, with whatever else touches its tensors at start) run on a thread of
    its own that has ended when this returns, so that the calling thread opens no OpenMP team
    (see above). Its exception, if it raises, is raised here."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvflow-engine-build") as pool:
        return pool.submit(build).result()  # leaving the block joins the thread


def _backlog_key(cmd: AddCommand) -> object:
    return cmd if cmd.owner is None else cmd.owner  # an abort names its request by owner


def _settle(future: asyncio.Future, result: object = None) -> Callable[[BaseException | None], None]:
    def settle(error: BaseException | None) -> None:
        if future.done():  # the caller gave up waiting (cancelled)
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    return settle


def _run_all(items: list[tuple[Callable, object]]) -> None:
    for fn, arg in items:
        fn(arg)
