"""DPAsyncLLM: N engine replicas, one process each, behind one AsyncLLM-shaped front.

    llm = DPAsyncLLM(EngineArgs(data_parallel_size=2))
    async for out in llm.generate("Hello", SamplingParams(output_kind=RequestOutputKind.DELTA), "req-1"):
        ...

The server (`kvflow serve --data-parallel-size N`) uses it exactly as it uses AsyncLLM. Each
replica has its own scheduler and KV pool; `DPRouter` picks one per request (its prefix's replica,
else the least loaded). Prompts are tokenized here, once, because the router keys on token ids.

Health: `is_alive()` is true only while every replica is; after one dies the server's /health
answers 503 (the deployment is degraded and should be restarted) while the surviving replicas go on
serving new requests. The dead replica's requests end with EngineDeadError naming it. A replica
that hangs with requests in flight (no engine step for `limits.engine_iteration_timeout_s`) is
killed and counts as dead from then on; an idle one is never suspected (dp_watchdog.py).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import weakref
from collections.abc import Callable
from dataclasses import replace

import torch

from kvflow.config import EngineArgs
from kvflow.engine.async_llm import AsyncLLM, RequestStream
from kvflow.engine.dp_client import ReplicaClient
from kvflow.engine.dp_router import DPRouter, ReplicaLoad
from kvflow.engine.engine_thread import EngineDeadError
from kvflow.engine.llm_engine import PromptType, eos_token_ids
from kvflow.engine.load_limits import LoadLimits
from kvflow.engine.request_timing import FinishedRequest
from kvflow.engine.snapshot import SnapshotUnavailableError
from kvflow.engine.stats import EngineStats
from kvflow.lora.request import LoRARequest
from kvflow.model.arch_config import ArchConfig
from kvflow.model.loader.resolve import load_checkpoint
from kvflow.model.registry import IMAGE_ARCHITECTURES
from kvflow.model.tokenizer import Tokenizer
from kvflow.sampling_params import SamplingParams

REPLICA_STOP_SECONDS = 30.0


class DPAsyncLLM:
    def __init__(self, args: EngineArgs, limits: LoadLimits = LoadLimits(), router: DPRouter | None = None) -> None:
        # Check every argument and read the tokenizer before any process starts.
        checkpoint = load_checkpoint(args.model, load_tokenizer=not args.skip_tokenizer_init, load_weights=False,
                                     native_gguf=args.quantization is None)
        arch = ArchConfig.from_hf(checkpoint.hf_config)
        config = args.create_config(arch.max_position_embeddings)
        n = config.parallel.data_parallel_size
        self.tokenizer: Tokenizer | None = checkpoint.tokenizer
        self.max_model_len: int = config.model.max_model_len
        self.vocab_size: int = arch.vocab_size
        self.reads_images: bool = arch.architecture in IMAGE_ARCHITECTURES
        self.eos_token_ids: frozenset[int] = eos_token_ids(arch, checkpoint.tokenizer)
        self.router = router or DPRouter(config.cache.block_size)
        self._listeners: tuple[Callable[[FinishedRequest], None], ...] = ()
        num_threads = max(1, torch.get_num_threads() // n)  # the cores are shared out, not fought over
        context = multiprocessing.get_context("spawn")  # a fork would copy this process's threads' locks
        tp = config.parallel.tensor_parallel_size
        self.replicas = [ReplicaClient(i, replace(args, data_parallel_size=1, device=replica_device(config.device, i, n, tp)),
                                       limits, num_threads, context) for i in range(n)]
        # Replicas are not daemons (their ranks are their children), so nothing would stop them at
        # exit, and the interpreter waits for non-daemon children: a front dropped without
        # shutdown() must not hang its process's exit.
        weakref.finalize(self, _kill, [r.process for r in self.replicas])
        try:
            for replica in self.replicas:
                replica.wait_ready()
        except BaseException:
            self.shutdown(timeout=5)
            raise
        for replica in self.replicas:
            replica.on_finished = self._on_finished
            replica.on_death = lambda dead: self.router.forget_replica(dead.index)

    def get_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this engine was started without a tokenizer (skip_tokenizer_init)")
        return self.tokenizer

    def is_alive(self) -> bool:
        return all(replica.alive for replica in self.replicas)

    def get_stats(self) -> EngineStats:
        """Every replica's gauges and counters added up (KV usage: their mean); a dead replica
        keeps its last counters, so totals never go backwards."""
        stats = [r.stats for r in self.replicas]
        live = [r.stats for r in self.replicas if r.alive]
        return EngineStats(
            num_running=sum(s.num_running for s in live), num_waiting=sum(s.num_waiting for s in live),
            kv_cache_usage=sum(s.kv_cache_usage for s in live) / len(live) if live else 0.0,
            **{name: sum(getattr(s, name) for s in stats) for name in (
                "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                "prompt_tokens_total", "generation_tokens_total")})

    def latest_snapshot(self) -> None:
        """The live page shows one engine's KV pool and scheduler; replicas each have their own."""
        raise SnapshotUnavailableError(
            f"this server runs {len(self.replicas)} data-parallel replicas, each with its own KV pool and scheduler; "
            "the live page shows a single engine. /metrics sums the replicas (examples/grafana-kvflow.json charts them)")

    def add_finish_listener(self, callback: Callable[[FinishedRequest], None]) -> None:
        """`callback` runs on a replica's reader thread for every request that finishes."""
        self._listeners = (*self._listeners, callback)

    # -- requests --------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          priority: int = 0, cache_salt: str | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """As AsyncLLM.add_request; EngineDeadError only when no replica is alive."""
        if any(replica.holds(request_id) for replica in self.replicas):
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt, token_ids = self._tokenize(prompt)
        hashes = self._block_hashes(token_ids, cache_salt, lora_request)
        loads = [ReplicaLoad(r.alive, r.num_in_flight, r.stats.kv_cache_usage)
                 for r in self.replicas]
        try:
            index = self.router.route(hashes, loads)
        except RuntimeError as e:
            raise EngineDeadError(f"{e}: {self.replicas[0].dead_reason}") from None
        return await self.replicas[index].add_request(request_id, prompt, params, priority, cache_salt, lora_request)

    # The same stream-and-close loop as one engine's, over this add_request.
    generate = AsyncLLM.generate

    def abort(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            for replica in self.replicas:
                replica.abort(rid)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loaded into every live replica (any of them may serve a request that names it)."""
        return all(await self._broadcast("add_lora", lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        return any(await self._broadcast("remove_lora", lora_int_id))

    async def _broadcast(self, method: str, argument) -> list:
        replicas = [r for r in self.replicas if r.alive]
        return list(await asyncio.gather(*(r.call(method, argument) for r in replicas)))

    def shutdown(self, wait: bool = True, timeout: float = REPLICA_STOP_SECONDS,
                 reason: str = "the engine is shut down") -> None:
        """Stop every replica; requests in flight end with EngineDeadError(reason)."""
        for replica in self.replicas:
            replica.request_stop(reason)
        if wait:
            for replica in self.replicas:
                replica.shutdown(reason, timeout)

    # -- helpers ---------------------------------------------------------------------------
    def _tokenize(self, prompt: PromptType) -> tuple[PromptType, list[int] | None]:
        """The prompt as the replica should get it (text tokenized here, once) and its token ids,
        or None where it is malformed: the replica then refuses it with the engine's own error."""
        if isinstance(prompt, str) and self.tokenizer is not None:
            token_ids = self.tokenizer.encode(prompt)
            return {"prompt": prompt, "prompt_token_ids": token_ids}, token_ids
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt, prompt["prompt_token_ids"]
            return self._tokenize(prompt["prompt"]) if isinstance(prompt.get("prompt"), str) else (prompt, None)
        return prompt, prompt if isinstance(prompt, list) else None

    def _block_hashes(self, token_ids, cache_salt: str | None, lora_request) -> list[bytes]:
        try:
            return self.router.block_hashes(token_ids, cache_salt, getattr(lora_request, "lora_int_id", 0))
        except (TypeError, ValueError, OverflowError):  # not token ids: the replica will say why
            return []

    def _on_finished(self, finished: FinishedRequest) -> None:
        for listener in self._listeners:
            listener(finished)


def _kill(processes) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(5)


def replica_device(device: str, index: int, num_replicas: int, tensor_parallel_size: int = 1) -> str:
    """Replica `index`'s device: the CPU is shared; on CUDA replica i owns GPUs i·tp .. i·tp + tp − 1
    (its tensor-parallel ranks take them in order from the first)."""
    if device == "cpu" or num_replicas == 1:
        return device
    if device != "cuda":
        raise ValueError(f"data_parallel_size > 1 puts replica i on its own GPUs; give device=cuda, not {device!r}")
    needed = num_replicas * tensor_parallel_size
    if torch.cuda.device_count() < needed:
        raise ValueError(f"data_parallel_size={num_replicas} x tensor_parallel_size={tensor_parallel_size} needs "
                         f"{needed} GPUs; torch sees {torch.cuda.device_count()}")
    return f"cuda:{index * tensor_parallel_size}"
