"""Compiling grammars off the engine thread, with a time limit, once per spec.

A compile runs on one of a few compiler threads (both libraries release the GIL while they
work). Whoever needs the result waits at most `timeout_s`; past that the request is refused with
a ValueError naming the limit, and the compile goes on in the background so that its result —
a grammar or an error — is cached for the next request with the same spec. Requests that arrive
while the same spec compiles share that compile. Errors are cached too: an invalid schema is
refused at once the second time.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from kvflow.structured_output.backend import GrammarBackend
from kvflow.structured_output.params import GrammarSpec

DEFAULT_CACHE_ENTRIES = 256
_COMPILER_THREADS = 2


class GrammarCompiler:
    def __init__(self, make_backend: Callable[[], GrammarBackend], timeout_s: float,
                 max_entries: int = DEFAULT_CACHE_ENTRIES) -> None:
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
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(_COMPILER_THREADS, thread_name_prefix="kvflow-grammar")

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
        with self._lock:
            future = self._cache.get(spec)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            self._evict()
            return future

    def compile(self, spec: GrammarSpec) -> object:
        """Wait (at most the time limit) for the compiled grammar; ValueError if it is invalid or late."""
        future = self.submit(spec)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise self._late(spec) from None
        except CancelledError:
            raise ValueError(f"{spec.label} was not compiled: the compiler was shut down") from None

    async def compile_async(self, spec: GrammarSpec) -> object:
        """`compile` for an event loop: the loop keeps serving while the grammar compiles."""
        future = self.submit(spec)
        try:
            # shield: giving up on the wait must not cancel the shared compile.
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout_s)
        except asyncio.TimeoutError:
            raise self._late(spec) from None

    def cached(self, spec: GrammarSpec) -> bool:
        with self._lock:
            future = self._cache.get(spec)
            return future is not None and future.done()

    def _compile(self, spec: GrammarSpec) -> object:
        backend = self.backend  # its error is about the model, not the spec
        try:
            return backend.compile(spec)
        except ValueError as e:
            raise ValueError(f"{spec.label} is invalid or unsupported: {e}") from None

    def _late(self, spec: GrammarSpec) -> ValueError:
        return ValueError(f"{spec.label} did not compile within {self.timeout_s:g} s (the limit is "
                          "structured_outputs_compile_timeout); simplify it or raise the limit")

    def _evict(self) -> None:
        # Oldest finished entries first; a compile in flight stays (others may be waiting on it).
        for spec in [s for s, f in self._cache.items() if f.done()]:
            if len(self._cache) <= self.max_entries:
                break
            del self._cache[spec]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
