"""AsyncLLM: the engine loop runs in the background; each request is an async stream of outputs.

    llm = AsyncLLM.from_engine_args(EngineArgs())
    async for out in llm.generate("Hello", SamplingParams(output_kind=RequestOutputKind.DELTA), "req-1"):
        print(out.outputs[0].text, end="")

Requests from any number of event loops and tasks share one engine thread (see engine_thread.py).
Bad input raises ValueError from `add_request` (or the first step of `generate`) before any output
exists. Leaving a stream early — cancellation, `break`, a client that went away — aborts the
request, and its KV blocks are freed before the engine's next step.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from kvflow.config import EngineArgs
from kvflow.engine.engine_thread import (
    AbortCommand,
    AddCommand,
    CallCommand,
    EngineDeadError,
    EngineThread,
    Item,
    RequestFailedError,
    StopCommand,
    build_on_fresh_thread,
)
from kvflow.engine.llm_engine import LLMEngine, PromptType
from kvflow.engine.load_limits import EngineOverloadedError, LoadLimits
from kvflow.engine.outputs import RequestOutput
from kvflow.engine.request_timing import FinishedRequest
from kvflow.engine.snapshot import EngineSnapshot
from kvflow.engine.stats import EngineStats
from kvflow.lora.request import LoRARequest
from kvflow.model.tokenizer import Tokenizer
from kvflow.sampling_params import SamplingParams
from kvflow.structured_output.backend import CompiledGrammar
from kvflow.structured_output.compiler import GrammarCompiler, GrammarCompilerBusyError

__all__ = ["AsyncLLM", "RequestStream", "EngineDeadError", "EngineOverloadedError", "RequestFailedError", "LoadLimits"]


class RequestStream:
    """One request's outputs in order; an iterator that ends after the finished output and raises
    the error that ended the request, if one did. `close()` before the end aborts the request."""

    def __init__(self, request_id: str, abort: Callable[[RequestStream], None]) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self._pending: deque[RequestOutput] = deque()  # the rest of the step being read
        self._abort = abort
        self.finished = False  # the engine is done with it (or it failed): nothing to abort

    def put(self, item: Item) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._pending:
            if self.finished:
                raise StopAsyncIteration
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self._pending.extend(item)
            self.finished = item[-1].finished
        return self._pending.popleft()

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._abort(self)


class AsyncLLM:
    def __init__(self, engine: LLMEngine, limits: LoadLimits = LoadLimits()) -> None:
        # Read-only facts copied out now: the engine itself belongs to its thread from here on.
        self.tokenizer: Tokenizer | None = engine.tokenizer
        self.max_model_len: int = engine.config.model.max_model_len
        self.vocab_size: int = engine.arch.vocab_size
        self.reads_images: bool = engine.prompt_images is not None
        self.eos_token_ids: frozenset[int] = engine.eos_token_ids
        # The grammar compiler is safe to use from any thread (the matchers are the engine's).
        self._grammar_compiler = engine.structured_output.compiler if engine.structured_output else None
        self._listeners: tuple[Callable[[FinishedRequest], None], ...] = ()
        self._thread = EngineThread(engine, self._on_finished, limits)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, limits: LoadLimits = LoadLimits()) -> AsyncLLM:
        return cls(build_on_fresh_thread(lambda: LLMEngine(args)), limits)

    def get_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this engine was started without a tokenizer (skip_tokenizer_init)")
        return self.tokenizer

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def get_stats(self) -> EngineStats:
        """The engine's gauges and counters as of its last iteration."""
        return self._thread.stats

    def latest_snapshot(self) -> EngineSnapshot | None:
        """The engine as the live page shows it, as of the latest snapshot (engine/snapshot.py);
        asking makes the engine publish a fresh one after its next step."""
        return self._thread.latest_snapshot()

    def add_finish_listener(self, callback: Callable[[FinishedRequest], None]) -> None:
        """`callback` runs on the engine thread for every request that finishes (not aborted);
        it must be quick and thread-safe (prometheus-client metrics are)."""
        self._listeners = (*self._listeners, callback)  # swapped whole: the engine thread reads it unlocked

    # -- requests --------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          priority: int = 0, cache_salt: str | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue a request and wait until the engine took it. Raises ValueError for bad input
        (nothing queued), EngineOverloadedError when too many requests wait (or the grammar
        compiler is saturated), and EngineDeadError when the engine is not running. A grammar is
        compiled here, off the engine thread, and handed to the engine compiled."""
        grammar = await compile_grammar(self._grammar_compiler, params)
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, self._abort_stream)
        accepted = loop.create_future()
        self._thread.submit(AddCommand(request_id, prompt, params, time.monotonic(), priority, cache_salt,
                                       loop, stream.put, accepted, owner=stream, lora_request=lora_request,
                                       grammar=grammar))
        try:
            await accepted
        except asyncio.CancelledError:
            self._abort_stream(stream)  # it may have been added just as we stopped waiting
            raise
        return stream

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       priority: int = 0, cache_salt: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(request_id, prompt, params, priority, cache_salt, lora_request)
        try:
            async for output in stream:
                yield output
        finally:  # cancelled, closed early (GeneratorExit) or failed: free the request's blocks
            stream.close()

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check an adapter on the engine thread; ValueError names what is wrong with it."""
        return await self._call(lambda engine: engine.add_lora(lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self._call(lambda engine: engine.remove_lora(lora_int_id))

    async def _call(self, fn):
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._thread.submit(CallCommand(fn, loop, done))
        return await done

    def abort(self, request_id: str | list[str]) -> None:
        """Abort from any thread; a no-op for unknown or finished requests and a dead engine."""
        self._submit_abort(AbortCommand([request_id] if isinstance(request_id, str) else list(request_id)))

    def _abort_stream(self, stream: RequestStream) -> None:
        # By owner, not by id: the id may by now name another request (the engine refused this
        # one as a duplicate, or it finished and the id was reused).
        self._submit_abort(AbortCommand([stream.request_id], owner=stream))

    def _submit_abort(self, command: AbortCommand) -> None:
        try:
            self._thread.submit(command)
        except EngineDeadError:
            pass  # nothing is running any more

    def shutdown(self, wait: bool = True, timeout: float = 30.0, reason: str = StopCommand.reason) -> None:
        """Stop taking requests, fail those in flight with EngineDeadError(reason), stop the thread."""
        try:
            self._thread.submit(StopCommand(reason))
        except EngineDeadError:
            pass
        if wait:
            self._thread.join(timeout)

    def _on_finished(self, finished: FinishedRequest) -> None:
        for listener in self._listeners:
            listener(finished)


async def compile_grammar(compiler: GrammarCompiler | None, params: SamplingParams) -> CompiledGrammar | None:
    """A request's structured_outputs compiled on the compiler's threads (None: it has none, or
    the engine has no tokenizer and refuses it itself). A compiler saturated by other requests'
    constraints is an overload (retry later), not a fault of this request."""
    if params.structured_outputs is None or compiler is None:
        return None
    try:
        return await compiler.compile_async(params.structured_outputs.spec)
    except GrammarCompilerBusyError as e:
        raise EngineOverloadedError(str(e)) from None
