"""Compiling grammars off the engine thread, with a time limit, once per spec.

A compile (`GrammarBackend.prepare`: the grammar and its first mask) runs on a compiler thread;
both libraries release the GIL while they work. Requests that arrive while the same spec
compiles share that compile, and results are cached, errors too: an invalid schema is refused at
once the second time.

No client's constraints can hold up another's:
- the threads are started as compiles arrive, up to COMPILER_THREADS, so a slow compile holds
  one thread and the next spec starts on another at once instead of queueing behind it;
- a waiter gives up after `timeout_s` of the compile's own running time, and only then is the
  spec blamed ("did not compile within ..."); a compile that could not even start within
  `timeout_s` (every thread busy) is refused as `GrammarCompilerBusyError`, a retry-later, with
  no word against the spec;
- a compile that nobody waits for any more and that has not started is cancelled, so a burst of
  abandoned requests leaves no queue behind it. One that has started cannot be interrupted (the
  libraries offer no way); it finishes in the background within their own work limits, and its
  result is cached for the next asker.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from kvflow.structured_output.backend import CompiledGrammar, GrammarBackend
from kvflow.structured_output.params import GrammarSpec

DEFAULT_CACHE_ENTRIES = 256
# Compiles that may run at once. Each slow one (up to the libraries' work limits) holds a thread;
# past this many at once new specs wait for a thread, at most `timeout_s`, then get a retry-later.
COMPILER_THREADS = 8


class GrammarCompilerBusyError(RuntimeError):
    """Every compiler thread stayed busy with other constraints for the whole time limit: the
    request's constraint was never looked at. Retry later (the server answers 503)."""


@dataclass
class _Compile:
    future: Future | None = None  # set right after the entry is made (the compile needs the entry)
    started: float | None = None  # monotonic time the compile began on a thread
    waiters: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class GrammarCompiler:
    def __init__(self, make_backend: Callable[[], GrammarBackend], timeout_s: float,
                 max_entries: int = DEFAULT_CACHE_ENTRIES, max_threads: int = COMPILER_THREADS) -> None:
        if not timeout_s > 0:
            raise ValueError(f"structured_outputs_compile_timeout must be > 0 seconds; got {timeout_s!r}")
        self.timeout_s = timeout_s
        self.max_entries = max_entries
        # The backend is built on first use, on a compiler thread: its vocabulary index takes a
        # fraction of a second that engines which never see a grammar should not pay.
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_error: ValueError | None = None
        self._backend_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the cache
        self._cache: OrderedDict[GrammarSpec, _Compile] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="kvflow-grammar")

    @property
    def backend(self) -> GrammarBackend:
        """ValueError (each time, built once) if the grammar library cannot read the tokenizer."""
        with self._backend_lock:
            if self._backend is None and self._backend_error is None:
                try:
                    self._backend = self._make_backend()
                except ValueError as e:
                    self._backend_error = e
            if self._backend_error is not None:
                raise ValueError(str(self._backend_error))
            return self._backend

    def submit(self, spec: GrammarSpec) -> Future:
        """The compile of `spec`: cached, in flight, or started now."""
        return self._entry(spec).future

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Wait for the compiled grammar; ValueError if it is invalid or too slow,
        GrammarCompilerBusyError if it never got a thread."""
        entry = self._entry(spec, waiting=True)
        try:
            try:
                return entry.future.result(timeout=self.timeout_s)
            except FutureTimeout:
                pass
            left = self._running_time_left(entry)
            if left is None:
                raise self._busy(spec)
            try:
                return entry.future.result(timeout=left)
            except FutureTimeout:
                raise self._late(spec) from None
        except CancelledError:
            raise self._busy(spec) from None
        finally:
            self._stop_waiting(spec, entry)

    async def compile_async(self, spec: GrammarSpec) -> CompiledGrammar:
        """`compile` for an event loop: the loop keeps serving while the grammar compiles."""
        entry = self._entry(spec, waiting=True)
        compiled = asyncio.wrap_future(entry.future)
        try:
            try:  # shield: giving up on a wait must not cancel the shared compile
                return await asyncio.wait_for(asyncio.shield(compiled), self.timeout_s)
            except asyncio.TimeoutError:
                pass
            left = self._running_time_left(entry)
            if left is None:
                raise self._busy(spec)
            try:
                return await asyncio.wait_for(asyncio.shield(compiled), left)
            except asyncio.TimeoutError:
                raise self._late(spec) from None
        except asyncio.CancelledError:
            if entry.future.cancelled():  # the compile was cancelled, not this waiter
                raise self._busy(spec) from None
            raise
        finally:
            self._stop_waiting(spec, entry)

    def cached(self, spec: GrammarSpec) -> bool:
        with self._lock:
            entry = self._cache.get(spec)
            return entry is not None and entry.future.done() and not entry.future.cancelled()

    def _entry(self, spec: GrammarSpec, waiting: bool = False) -> _Compile:
        with self._lock:
            entry = self._cache.get(spec)
            if entry is None or entry.future.cancelled():
                entry = _Compile()
                entry.future = self._pool.submit(self._compile, spec, entry)
                self._cache[spec] = entry
                self._evict()
            self._cache.move_to_end(spec)
            if waiting:
                with entry.lock:
                    entry.waiters += 1
            return entry

    def _running_time_left(self, entry: _Compile) -> float | None:
        """Seconds the compile may still run before it is late; None if it has not started."""
        with entry.lock:
            started = entry.started
        return None if started is None else max(0.0, started + self.timeout_s - time.monotonic())

    def _stop_waiting(self, spec: GrammarSpec, entry: _Compile) -> None:
        """The last waiter of a compile that has not started takes it off the queue."""
        with entry.lock:
            entry.waiters -= 1
            abandoned = entry.waiters == 0 and entry.started is None and entry.future.cancel()
        if abandoned:
            with self._lock:
                if self._cache.get(spec) is entry:
                    del self._cache[spec]

    def _compile(self, spec: GrammarSpec, entry: _Compile) -> CompiledGrammar:
        with entry.lock:
            entry.started = time.monotonic()
        backend = self.backend  # its error is about the model, not the spec
        try:
            return backend.prepare(spec)
        except ValueError as e:
            raise ValueError(f"{spec.label} is invalid or unsupported: {e}") from None

    def _late(self, spec: GrammarSpec) -> ValueError:
        return ValueError(f"{spec.label} did not compile within {self.timeout_s:g} s (the limit is "
                          "structured_outputs_compile_timeout); simplify it or raise the limit")

    def _busy(self, spec: GrammarSpec) -> GrammarCompilerBusyError:
        return GrammarCompilerBusyError(
            f"{spec.label} was not compiled: every grammar compiler thread stayed busy with other requests' "
            f"constraints for {self.timeout_s:g} s; try again later")

    def _evict(self) -> None:
        # Oldest finished entries first; a compile in flight stays (others may be waiting on it).
        for spec in [s for s, e in self._cache.items() if e.future.done()]:
            if len(self._cache) <= self.max_entries:
                break
            del self._cache[spec]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
