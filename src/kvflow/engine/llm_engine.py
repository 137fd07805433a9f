"""LLMEngine: add requests, call step() until they finish.

One step = schedule → run the model once on a flat batch from many requests → sample → update
requests and emit outputs. Nothing else drives the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
from collections import deque
from concurrent.futures import Future

from kvflow.config import EngineArgs, EngineConfig
from kvflow.core.block_pool import BlockPool
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.kv_connector import KVConnectorScheduler, KVStoreConnector, OffloadConnector
from kvflow.core.kv_eviction import NOT_COMPOSED, KVEviction
from kvflow.core.request import PromptImage, Request, RequestStatus
from kvflow.core.runner_output import ModelRunnerOutput
from kvflow.core.sched_output import SchedulerOutput
from kvflow.core.scheduler import Scheduler, SchedulerStallError
from kvflow.engine.output_processor import OutputProcessor, ParentRequest
from kvflow.engine.outputs import RequestMetrics, RequestOutput
from kvflow.engine.snapshot import StepLog
from kvflow.engine.stats import EngineStats, StatsLogger
from kvflow.engine.step_budget import StepBudget
from kvflow.executor import create_executor
from kvflow.kv_store import open_kv_block_store
from kvflow.lora.request import LoRARequest
from kvflow.model.arch_config import ArchConfig
from kvflow.model.layers.rotary import rope_type
from kvflow.model.loader.resolve import load_checkpoint
from kvflow.model.registry import IMAGE_ARCHITECTURES
from kvflow.model.tokenizer import Tokenizer
from kvflow.phases import phase, progress
from kvflow.quant.registry import get_quantization_config
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams
from kvflow.spec_decode.adaptive import AdaptiveSpeculation
from kvflow.structured_output.backend import CompiledGrammar
from kvflow.structured_output.manager import MASK_WAIT_S, Settled, StructuredOutputManager

logger = logging.getLogger("kvflow")

PromptType = str | list[int] | dict

# The warm-up's prompt: a full step, up to this many tokens. Its products are what a start pays
# most for (a 1,024-token warm-up took 1.3 s of `kvflow serve`'s ~5 s cold start on the 2-core
# EPYC, 0.6 s of it the products), and steps of up to 512 rows already meet every lazily built
# kernel state but oneDNN's middle layout (packed_linear.MIDDLE_ROWS), which a first step of more
# rows then lays out once.
WARM_UP_MAX_TOKENS = 512


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        if isinstance(args.data_parallel_size, int) and args.data_parallel_size > 1:  # before anything loads
            raise ValueError(f"data_parallel_size={args.data_parallel_size}: an LLMEngine (and LLM) is one replica; "
                             "replicas are served by `kvflow serve --data-parallel-size N` (DPAsyncLLM)")
        dummy = args.load_format == "dummy"
        with phase("read the checkpoint"):
            checkpoint = load_checkpoint(args.model, load_tokenizer=not args.skip_tokenizer_init,
                                         load_weights=not dummy, native_gguf=args.quantization is None)
        self.quant_config = get_quantization_config(args.quantization, args.group_size, checkpoint.quant_config,
                                                    args.quantization_rotation)
        self.arch = ArchConfig.from_hf(checkpoint.hf_config)
        self.hf_config = checkpoint.hf_config
        self.config: EngineConfig = with_kv_store_namespace(args.create_config(self.arch.max_position_embeddings),
                                                            self.arch)
        self.tokenizer: Tokenizer | None = checkpoint.tokenizer
        self.prompt_images = self._prompt_images(args.model)
        if getattr(self.quant_config, "needs_calibration", False):  # before any worker starts
            self._check_calibration()
        self._check_kv_transfer()  # before any weight is read
        if self.arch.kv_layout.holds_state:
            self.config = self._for_recurrent_state(self.config)
        if self.config.cache.kv_eviction_policy != "none":
            self._check_eviction_composes(self.config.cache.kv_eviction_policy)
        # The workers load the model and size and allocate the KV pool; the engine schedules.
        with phase("loaded the model and allocated the KV cache") as done:
            self.model_executor = create_executor(self.config, self.arch, self.quant_config, checkpoint)
            self.num_kv_blocks, num_host_blocks = self.model_executor.num_kv_blocks, self.model_executor.num_host_blocks
            cache, layout = self.config.cache, self.arch.kv_layout
            done.detail = f"{self.num_kv_blocks} KV blocks of {cache.block_size} tokens"
        self.eos_token_ids = eos_token_ids(self.arch, self.tokenizer)
        # The grammars are the engine's: their masks travel to the sampler in the step.
        self.structured_output = self._make_structured_output()
        # How many tokens each request proposes is the scheduler's; the drafter is the worker's.
        self.speculation = None if self.config.speculative is None else AdaptiveSpeculation(self.config.speculative)
        self.scheduler = Scheduler(
            self.config.scheduler,
            KVCacheManager(self.num_kv_blocks, cache.block_size, cache.enable_prefix_caching, layout.sliding_windows,
                           layout.state_groups),
            self.config.model.max_model_len,
            BlockPool(num_host_blocks, enable_caching=False) if num_host_blocks else None,
            max_loras=None if self.config.lora is None else self.config.lora.max_loras,
            speculation=self.speculation,
            kv_connector=self._make_kv_connector(),
            pool_size_setting="kv_cache_memory_gb" if cache.num_kv_blocks is None else "num_kv_blocks",
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._configured_budget = self.config.scheduler.max_num_batched_tokens
        self.step_budget: StepBudget | None = None  # fit_token_budget
        self._children: dict[str, list[str]] = {}  # user request id → engine request ids
        self._ids = itertools.count()
        self._running_at_step: set[str] = set()
        self._in_flight: deque[tuple[SchedulerOutput, Future]] = deque()  # pipeline parallel: batches not back yet
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._kv_transfer_bytes_total, self._kv_transfer_seconds_total = 0, 0.0
        self.stats_logger = None if args.disable_log_stats else StatsLogger()
        self.step_log: StepLog | None = None  # set only while the live page watches (engine/snapshot.py)
        if getattr(self.quant_config, "needs_calibration", False):
            self._calibrate()

    def _check_calibration(self) -> None:
        """Refuse what cannot be calibrated, or (fp8) round it to nearest instead, saying so."""
        name, problem = self.quant_config.name, None
        if self.tokenizer is None:
            problem = f"quantization='{name}' calibrates on text and needs the model's tokenizer"
        elif self.config.parallel.world_size > 1:  # the hooks and folds would see rank 0's slices or layers only
            problem = (f"quantization='{name}' calibrates in one process: write the checkpoint with `kvflow "
                       f"quantize MODEL OUT --method {name}`, then load OUT with tensor or pipeline parallel")
        if problem is None:
            return
        if not self.quant_config.rounds_uncalibrated:
            raise ValueError(problem)
        logger.warning("%s; rounding its weights to nearest instead (lower quality)", problem)
        self.quant_config.calibrates = False

    def _calibrate(self) -> None:
        """AWQ, w8a8 or fp8 on a float checkpoint: run calibration text through the float model
        with the engine's own steps, while the worker records its layers' inputs; the worker then
        folds the searched scales (AWQ, w8a8) and quantizes (quant/calibration.py)."""
        from kvflow.data import english_text
        wanted = self.quant_config.calibration_tokens
        # Only the text's end is read: ~8 characters a token leaves the cut's partial word outside
        # the last `wanted` tokens (and encoding the whole text took 1.7 s).
        ids = self.tokenizer.encode(english_text()[-8 * wanted:], add_special_tokens=False)[-wanted:]
        windows = [ids[i:i + 256] for i in range(0, len(ids), 256)]
        params = SamplingParams(max_tokens=1, temperature=0)

        def run(prompts: list[list[int]]) -> None:
            for i, prompt in enumerate(prompts):
                self.add_request(f"calibration-{i}", {"prompt_token_ids": prompt}, params)
            finished = 0
            while self.has_unfinished_requests():
                finished += sum(out.finished for out in self.step())
                progress(finished, len(prompts), "windows of text run")

        with phase(f"calibrated and quantized ({self.quant_config.name}, {len(windows)} windows of text)", announce=True):
            self.model_executor.calibrate(run, windows)
        self.reset_prefix_cache()  # those blocks hold the float model's keys and values

    def _for_recurrent_state(self, config: EngineConfig) -> EngineConfig:
        """A state-space model: without the prefix cache (a state is the whole past, not a block of
        it; caching states at block ends is not built yet), refusing what needs per-position KV."""
        refused = {"speculative_config": config.speculative, "kv_transfer_config": config.kv_transfer,
                   "kv_offloading_size": config.kv_offload}
        for name, setting in refused.items():
            if setting is not None:
                raise ValueError(f"{name}: {self.arch.architecture} keeps a recurrent state, not per-position KV; "
                                 f"it does not compose with {name} yet")
        if config.cache.enable_prefix_caching:
            logger.info("%s keeps a recurrent state: prefix caching is off", self.arch.architecture)
        return dataclasses.replace(config, cache=dataclasses.replace(config.cache, enable_prefix_caching=False))

    def _check_kv_transfer(self) -> None:
        for name, asked in (("kv_transfer_config", self.config.kv_transfer), ("kv_offloading_size", self.config.kv_offload)):
            if asked is not None and self.arch.kv_layout.sliding_windows != (None,):
                raise ValueError(f"{name}: {self.arch.architecture} has sliding-window or several KV groups; KV "
                                 "connectors support models whose layers all keep full attention for now")
        if self.config.kv_offload is not None and getattr(self.quant_config, "needs_calibration", False):
            raise ValueError(f"kv_offloading_size with quantization='{self.quant_config.name}': calibration runs the "
                             "float model, whose KV must not be offloaded; write the checkpoint with `kvflow quantize` "
                             "and serve that")

    def _make_kv_connector(self) -> KVConnectorScheduler | None:
        """KV offloading's connector shares rank 0's tiers (host memory is that worker's, in this
        process) to look blocks up; a transfer connector opens the store both halves share."""
        if self.config.kv_offload is not None:
            return OffloadConnector(self.model_executor.driver_worker.kv_offload_store, self.config.cache.block_size,
                                    self.config.parallel.tensor_parallel_size)
        kv_transfer = self.config.kv_transfer
        if kv_transfer is None:
            return None
        return KVStoreConnector(open_kv_block_store(kv_transfer), kv_transfer.kv_role, self.config.cache.block_size,
                                self.config.parallel.tensor_parallel_size)

    def _make_structured_output(self) -> StructuredOutputManager | None:
        """Grammar matchers need the vocabulary: none without a tokenizer."""
        if self.tokenizer is None:
            return None
        cfg = self.config.structured_outputs
        return StructuredOutputManager(cfg.backend, self.tokenizer.backend, self.arch.vocab_size,
                                       sorted(self.eos_token_ids), cfg.compile_timeout_s,
                                       max_jobs=self.config.scheduler.max_num_seqs, strict_schemas=not cfg.lenient_schemas)

    def _compile_grammar(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of a request's structured_outputs (cached); ValueError if it is
        invalid, unsupported or too slow to compile. The server compiles off this thread
        (AsyncLLM) and passes the result to add_request."""
        if self.structured_output is None:
            raise ValueError("structured_outputs needs the model's tokenizer; this engine was started without one")
        return self.structured_output.compile(params)

    @property
    def runner(self):
        """Rank 0's runner, in this process, for tools and tests (`kvflow quantize` saves its
        model); the engine itself reaches the workers only through `model_executor`."""
        return self.model_executor.driver_worker.model_runner

    def shutdown(self) -> None:
        """Stop the workers (ranks in other processes) and the grammar threads; idempotent."""
        self.model_executor.shutdown()
        if self.structured_output is not None:
            self.structured_output.shutdown()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    def get_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this engine was started without a tokenizer (skip_tokenizer_init)")
        return self.tokenizer

    # -- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None, grammar: CompiledGrammar | None = None) -> str:
        """Queue a request. Raises ValueError if it can never run or its id is in use; whatever it
        raises, nothing of the request is queued. `priority`: lower runs first under
        scheduling_policy="priority". `cache_salt`: only requests with the same salt share
        prefix-cache blocks. `lora_request`: the adapter to run with, loaded (and checked) now.
        `grammar`: its structured_outputs compiled already (else it is compiled here)."""
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else request_id
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        # A completion's id may equal another request's own id ("x#1"): both are engine ids.
        if request_id in self._children or any(c in self.scheduler.requests for c in child_ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        self._check_params(params)
        if lora_request is not None:
            self.add_lora(lora_request)
        eviction = self._eviction(params)
        text, token_ids, images = self._tokenize_with_images(prompt)
        max_tokens = params.max_tokens or max(1, self.config.model.max_model_len - len(token_ids))
        error = self.scheduler.admission_error(len(token_ids), max_tokens, eviction)
        if error:
            raise ValueError(error)
        if params.structured_outputs is None:
            grammar = None
        elif grammar is None:
            grammar = self._compile_grammar(params.structured_outputs)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        parent = ParentRequest(request_id, text, token_ids, RequestMetrics(arrival_time=arrival))
        queued: list[str] = []
        try:
            for index, child_id in enumerate(child_ids):
                child_params = params if params.n == 1 else params.clone(
                    n=1, seed=None if params.seed is None else _child_seed(params.seed, index))
                request = Request(child_id, token_ids, child_params, max_tokens, self.eos_token_ids, arrival,
                                  priority=priority, cache_salt=cache_salt, lora_request=lora_request,
                                  eviction=eviction, images=images)
                self.scheduler.add_request(request)
                queued.append(child_id)
                if grammar is not None:  # forgotten once the request finishes
                    self.structured_output.add_request(child_id, grammar)
                self.output_processor.add_request(request, parent, index)
        except BaseException:  # all or nothing: a half-queued request would run with nobody to answer
            self.scheduler.finish_requests(queued, RequestStatus.FINISHED_ABORTED)
            self.output_processor.finish_aborted(queued)
            raise
        self._children[request_id] = child_ids
        self._prompt_tokens_total += len(token_ids)
        return request_id

    def warm_up(self) -> None:
        """Run one throwaway prompt the size of a full step (at most WARM_UP_MAX_TOKENS), then one
        step of 16 one-token prompts (a decode batch's row count), before the first request, so
        that the first requests do not wait for what a first step builds lazily: oneDNN's
        primitives, the SiLU·up pairs, the panel kernel's panels (on the 2026-11-27 VM a server's
        first ~1,000-token prompt took 604 ms to its first token, the next ones 217-228). A first
        step of more than WARM_UP_MAX_TOKENS still lays out oneDNN's middle layout (+0.17 s once
        for 1,000 tokens on the EPYC, where the warm-up gained 0.55 s). It leaves no trace: its
        blocks go back to the pool and out of the prefix cache, and the counters read as before.
        One token is sampled each, so no decode step runs (and no speculation)."""
        if self.has_unfinished_requests():
            raise RuntimeError("warm_up runs before any request")
        # Unseen by the stats line: the warm-up sets the counters back when it ends, so a line read
        # during it would report its tokens and leave the next one counting from them (a negative rate).
        with self.stats_logger.paused(self.get_stats) if self.stats_logger else contextlib.nullcontext(), \
                phase("warmed up"):
            self._warm_up()

    def _warm_up(self) -> None:
        num_tokens = max(1, min(self.config.scheduler.max_num_batched_tokens, WARM_UP_MAX_TOKENS,
                                self.config.model.max_model_len - 1))
        while num_tokens > 1 and self.scheduler.admission_error(num_tokens, 1):
            num_tokens //= 2  # a KV pool smaller than a step: as much of a step as it holds
        kv = self.scheduler.kv_cache
        counters = (self._prompt_tokens_total, self._generation_tokens_total, kv.prefix_cache_queries,
                    kv.prefix_cache_hits)
        few_rows = min(16, self.config.scheduler.max_num_seqs, num_tokens)
        for b, batch in enumerate(([[0] * num_tokens], [[0]] * few_rows)):
            for i, prompt in enumerate(batch):
                self.add_request(f"kvflow-warm-up-{b}-{i}", {"prompt_token_ids": prompt},
                                 SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
            while self.has_unfinished_requests():
                self.step()
        (self._prompt_tokens_total, self._generation_tokens_total, kv.prefix_cache_queries,
         kv.prefix_cache_hits) = counters
        self.reset_prefix_cache()

    def fit_token_budget(self) -> None:
        """From now on the token budget follows this machine's speed: lowered (never above the
        configured one) until a full step takes at most step_budget.STEP_TARGET_S. It starts at
        WARM_UP_MAX_TOKENS where the configured one is larger: a first step past what the warm-up
        ran pays for what it builds (oneDNN's primitives and middle layout: +0.17 s for 1,000
        tokens on the EPYC), and that step, fitted, held the budget at 256 for a quarter of a
        served load there. The fit raises it as soon as the steps seen say a larger one is fast."""
        self.step_budget = StepBudget(self._configured_budget)
        self.set_token_budget(min(self._configured_budget, WARM_UP_MAX_TOKENS))

    def set_token_budget(self, max_num_batched_tokens: int) -> None:
        """Schedule at most this many tokens a step from now on, at most the configured budget, so
        whatever the workers sized for it still fits."""
        if not 1 <= max_num_batched_tokens <= self._configured_budget:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens}: within 1..{self._configured_budget} "
                             "(the configured budget) only")
        if max_num_batched_tokens == self.config.scheduler.max_num_batched_tokens:
            return
        scheduler = dataclasses.replace(self.config.scheduler, max_num_batched_tokens=max_num_batched_tokens)
        self.config = dataclasses.replace(self.config, scheduler=scheduler)
        self.scheduler.config = scheduler
        logger.info("%d tokens a step from now on", max_num_batched_tokens)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        engine_ids = [c for rid in ids for c in self._children.pop(rid, [])]
        self.scheduler.finish_requests(engine_ids, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.finish_aborted(engine_ids)

    def abort_failed_step(self) -> list[str]:
        """After step() raised: abort the requests it may have left half-updated and return their
        ids. Those are the ones running when it began (scheduled or preempted by it) and any it
        started; a request still waiting since before it was not touched and keeps its place."""
        waiting = {r.request_id for r in self.scheduler.waiting}
        touched = [rid for rid, engine_ids in self._children.items()
                   if any(e in self._running_at_step or e not in waiting for e in engine_ids)]
        self.abort_request(touched)
        return touched

    # -- LoRA adapters (vLLM's names) -------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check an adapter into host memory. Raises ValueError naming it if it cannot
        run on this model, or if LoRA is not enabled."""
        if self.config.lora is None:
            raise ValueError(f"LoRA adapter {getattr(lora_request, 'lora_name', lora_request)!r} was asked for, "
                             "but LoRA is not enabled (enable_lora=True, --enable-lora)")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest; got {type(lora_request).__name__}")
        return self.model_executor.add_lora(lora_request, self._adapters_in_use())

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter: unfinished requests keep running with it; once they finish, its weights and
        identity are dropped and its id is retired (never loadable again: blocks cached under it must
        never reach another adapter)."""
        return self.config.lora is not None and self.model_executor.remove_lora(lora_int_id, self._adapters_in_use())

    def list_loras(self) -> list[int]:
        return [] if self.config.lora is None else self.model_executor.list_loras()

    def _adapters_in_use(self) -> frozenset[int]:
        return frozenset(r.lora_int_id for r in self.scheduler.requests.values()) - {0}

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or batches not back (an aborted request's blocks wait for its batch)."""
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no request holds (e.g. between benchmark runs)."""
        self.scheduler.kv_cache.pool.reset_prefix_cache()

    # -- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule a batch and run it. With pipeline parallel, up to one batch per
        stage is in flight: schedule another while there is room, and return what the oldest
        brought back once it must be waited for (or is already back)."""
        self._running_at_step = {r.request_id for r in self.scheduler.running}  # for abort_failed_step
        if self.step_log is not None:
            self.step_log.begin(self.scheduler.config.max_num_batched_tokens)
        if self.model_executor.max_concurrent_batches == 1:
            sched, broken = self._schedule_batch()
            return self._retire(broken + self._land(sched, self._execute(sched)))
        return self._retire(self._step_pipelined())

    def _schedule_batch(self) -> tuple[SchedulerOutput, list[RequestOutput]]:
        """The next batch with its grammar masks and adapters, and the outputs of the requests
        whose grammar broke (ended before it)."""
        settled = self._settle_grammars()
        broken = self._end_broken_grammars(settled.failed)
        try:
            sched = self.scheduler.schedule(settled.held)
        except SchedulerStallError as e:
            self._running_at_step.update(e.request_ids)  # abort_failed_step ends them too
            raise
        if self.structured_output is not None and self.structured_output.active:
            self._attach_grammar_masks(sched, settled)
        if self.config.lora is not None:
            sched.adapters_in_use = self._adapters_in_use()
        return sched, broken

    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        try:
            return self.model_executor.execute_model(sched)
        except BaseException:
            self.scheduler.batch_landed(sched)  # its requests are ended next (abort_failed_step)
            raise

    def _step_pipelined(self) -> list[RequestOutput]:
        outputs, scheduled = [], False
        depth = self.model_executor.max_concurrent_batches
        if len(self._in_flight) < depth:
            sched, outputs = self._schedule_batch()
            if sched.chunks or sched.swap_out or sched.swap_in or sched.block_copies or not self._in_flight:
                self._in_flight.append((sched, self.model_executor.submit(sched)))
                scheduled = bool(sched.chunks)
            else:  # nothing new to run beside the batches in flight: what finished goes with the next
                self.scheduler.give_back(sched)
        if self._in_flight and (len(self._in_flight) == depth or not scheduled or self._in_flight[0][1].done()):
            sched, future = self._in_flight.popleft()
            outputs += self._land(sched, self._wait(sched, future))
        return outputs

    def _wait(self, sched: SchedulerOutput, future: Future) -> ModelRunnerOutput:
        try:
            return future.result()
        except BaseException:  # the pipeline is broken: every batch in it lands, its requests end next
            self.scheduler.batch_landed(sched)
            while self._in_flight:
                self.scheduler.batch_landed(self._in_flight.popleft()[0])
            raise

    def _land(self, sched: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[RequestOutput]:
        """A batch came back: its tokens into the requests, the requests' outputs out."""
        if self.step_budget is not None:
            budget = self.step_budget.observe(sched.num_batched_tokens, runner_out.target_seconds)
            if budget is not None:
                self.set_token_budget(budget)
        if runner_out.kv_load_failed:  # before anything of theirs counts
            self.scheduler.recompute_failed_loads(sched, runner_out.kv_load_failed)
        self.scheduler.loads_landed({r for r, transfer in runner_out.kv_transfer.items() if transfer.loaded})
        produced = self.scheduler.update_from_output(sched, runner_out.sampled, runner_out.draft_token_ids)
        if runner_out.kv_transfer:
            self.output_processor.record_kv_transfers(runner_out)
            self._kv_transfer_bytes_total += sum(t.bytes for t in runner_out.kv_transfer.values())
            self._kv_transfer_seconds_total += sum(t.seconds for t in runner_out.kv_transfer.values())
        self._generation_tokens_total += sum(n for _, n in produced)
        if self.speculation is not None:
            decode_only = all(c.is_decode for c in sched.chunks)
            self.speculation.observe_step(sched.num_batched_tokens, runner_out.target_seconds,
                                          sum(map(len, runner_out.draft_token_ids.values())),
                                          runner_out.proposer_seconds, decode_only)
        outputs, stopped = self.output_processor.process(produced, runner_out)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self._advance_grammars(produced)
        if self.step_log is not None:
            self.step_log.land(sched, runner_out.sampled)
        return outputs

    def _retire(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for out in outputs:
            if out.finished:
                self._children.pop(out.request_id, None)
        if self.stats_logger is not None:
            self.stats_logger.maybe_log(self.get_stats)
        return outputs

    # -- grammars (structured output) ------------------------------------------------------
    def _settle_grammars(self) -> Settled:
        """The grammar jobs that finished since the last step: proposals cut to what each
        request's grammar accepts, and which requests may not sample yet or have broken."""
        if self.structured_output is None or not self.structured_output.active:
            return Settled()
        settled = self.structured_output.settle(self.scheduler.requests)
        for request_id, valid in settled.valid_proposals.items():
            del self.scheduler.requests[request_id].spec_token_ids[valid:]
        return settled

    def _end_broken_grammars(self, failed: dict[str, str]) -> list[RequestOutput]:
        """End the requests whose grammar cannot go on, each with finish_reason "error" and why."""
        if not failed:
            return []
        self.scheduler.finish_requests(list(failed), RequestStatus.FINISHED_ERROR)
        return self.output_processor.finish_failed(failed)

    def _attach_grammar_masks(self, sched: SchedulerOutput, settled: Settled) -> None:
        """The step's masks into the step. A step left empty by requests waiting for their masks
        waits for one of them instead of spinning."""
        if not sched.chunks and settled.held:
            self.structured_output.wait_for_any(settled.held, MASK_WAIT_S)
        sched.grammar = self.structured_output.step_masks(
            [(c.request_id, c.num_spec_tokens) for c in sched.chunks if c.sample])

    def _advance_grammars(self, produced: list[tuple[Request, int]]) -> None:
        """Start the next masks of every request that produced tokens and goes on."""
        if self.structured_output is None or not self.structured_output.active:
            return
        for request, _ in produced:
            if request.status is RequestStatus.RUNNING:
                self.structured_output.advance(request.request_id, request.output_token_ids, request.spec_token_ids)

    # -- helpers ---------------------------------------------------------------------------
    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the limits of this model and engine."""
        vocab = self.arch.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"{name} must be token ids in [0, {vocab}); got {bad}")
        cap = self.config.model.max_logprobs
        cap = vocab if cap < 0 else min(cap, vocab)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > cap:
                raise ValueError(f"{name} must be at most {cap} (max_logprobs); got {value}")

    def _eviction(self, params: SamplingParams) -> KVEviction | None:
        """The request's KV budget: its own policy and budget, each defaulting to the engine's."""
        cache = self.config.cache
        policy = cache.kv_eviction_policy if params.kv_eviction_policy is None else params.kv_eviction_policy
        budget = cache.kv_budget_tokens if params.kv_budget_tokens is None else params.kv_budget_tokens
        eviction = KVEviction.resolve(policy, budget, cache.block_size)
        if eviction is None and params.kv_budget_tokens is not None:
            raise ValueError("kv_budget_tokens applies with a kv_eviction_policy (sink_window)")
        if eviction is not None and params.kv_eviction_policy is not None:  # the default was checked at start
            self._check_eviction_composes(policy)
        return eviction

    def _check_eviction_composes(self, policy: str) -> None:
        """ValueError, with the reason, where this engine's model or settings cannot evict."""
        speculative = self.config.speculative
        refused = ((self.arch.architecture, "recurrent_state", self.arch.kv_layout.holds_state),
                   ("speculative_config", "speculative_config", speculative is not None and speculative.writes_kv),
                   ("kv_transfer_config", "kv_transfer_config", self.config.kv_transfer is not None))
        for name, why, applies in refused:
            if applies:
                raise ValueError(f"kv_eviction_policy={policy!r} does not compose with {name} yet ({NOT_COMPOSED[why]})")

    def _prompt_images(self, model_dir: str | None):
        """The image processing of a model that reads images (None for the others, which never
        import it: Pillow and the vision tower's spec cost a text model's start nothing)."""
        if self.arch.architecture not in IMAGE_ARCHITECTURES:
            return None
        from kvflow.engine.prompt_images import PromptImages

        return PromptImages(model_dir, self.arch)

    def _tokenize_with_images(self, prompt: PromptType) -> tuple[str | None, list[int], tuple[PromptImage, ...]]:
        """As `_tokenize`, and a dict's `multi_modal_data` images (engine/prompt_images.py)."""
        if not (isinstance(prompt, dict) and "multi_modal_data" in prompt):
            return (*self._tokenize(prompt), ())
        data = prompt["multi_modal_data"]
        if self.prompt_images is None:
            raise ValueError(f"multi_modal_data: {self.arch.architecture} reads no images")
        if not isinstance(data, dict) or set(data) != {"image"}:
            raise ValueError("multi_modal_data must be {'image': bytes or a list of bytes}")
        if "prompt_token_ids" in prompt:  # one <image> token per image, as a chat template writes it
            text = prompt.get("prompt") if isinstance(prompt.get("prompt"), str) else None
            token_ids, images = self.prompt_images.expand_ids(
                self._check_ids(list(prompt["prompt_token_ids"])), data["image"],
                lambda s: self.get_tokenizer().encode(s, add_special_tokens=False))
        else:
            text = prompt.get("prompt")
            expanded, images = self.prompt_images.expand(text, data["image"])
            _, token_ids = self._tokenize(expanded)
        # Each <image> token takes the next of the images' rows: their counts must agree exactly.
        found, expected = token_ids.count(self.prompt_images.image_token_id), sum(i.num_tokens for i in images)
        if found != expected:
            raise ValueError(f"prompt: its text tokenizes to {found} <image> tokens where its images stand for "
                             f"{expected}")
        return text, token_ids, images

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A dict may carry both: the text (for outputs) and its token ids (not tokenized again)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
                return text if isinstance(text, str) else None, self._check_ids(token_ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this engine has none (pass token ids)")
            token_ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            token_ids, text = list(prompt), None
        return text, self._check_ids(token_ids)

    def _check_ids(self, token_ids: list[int]) -> list[int]:
        if not token_ids:
            raise ValueError("prompt is empty: it must have at least one token")
        vocab = self.arch.vocab_size
        bad = next((t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is not an integer in [0, {vocab})")
        return token_ids

    @property
    def kv_cache_usage(self) -> float:
        return self.scheduler.kv_cache.usage

    def get_stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache_usage,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            prefix_cache_queries_total=self.scheduler.kv_cache.prefix_cache_queries,
            prefix_cache_hits_total=self.scheduler.kv_cache.prefix_cache_hits,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            spec_decoding=None if self.speculation is None else self.speculation.stats.snapshot(),
            kv_transfer_bytes_total=self._kv_transfer_bytes_total,
            kv_transfer_seconds_total=self._kv_transfer_seconds_total,
        )


def with_kv_store_namespace(config: EngineConfig, arch: ArchConfig) -> EngineConfig:
    """`config` with its KV transfer namespaced by what a block's bytes depend on besides its
    tokens (kvflow.kv_store.namespaced): both connector halves, on every rank, read it from here."""
    if config.kv_transfer is None and config.kv_offload is None:
        return config
    m, c, p = config.model, config.cache, config.parallel
    # longrope's factors and dynamic NTK's base are chosen for max_model_len (model/layers/rotary.py)
    length_dependent = rope_type(arch.rope_scaling) in ("longrope", "dynamic")
    served = f"; rotated for {m.max_model_len} positions" if length_dependent else ""
    namespace = (f"{arch!r}; weights {m.dtype} {m.quantization} g{m.group_size}; KV {c.cache_dtype} in blocks of "
                 f"{c.block_size}; tp {p.tensor_parallel_size} pp {p.pipeline_parallel_size}{served}")
    return dataclasses.replace(
        config, kv_transfer=None if config.kv_transfer is None else config.kv_transfer.with_namespace(namespace),
        kv_offload=None if config.kv_offload is None else config.kv_offload.with_namespace(namespace))


def eos_token_ids(arch: ArchConfig, tokenizer: Tokenizer | None) -> frozenset[int]:
    """The tokens that end a completion: the model config's and the tokenizer's."""
    return frozenset(arch.eos_token_ids) | (tokenizer.eos_token_ids if tokenizer else frozenset())


def _child_seed(seed: int, index: int) -> int:
    """Completion `index`'s seed: seed + index, wrapped to stay a signed 64-bit integer."""
    return (seed + index + 2**63) % 2**64 - 2**63
