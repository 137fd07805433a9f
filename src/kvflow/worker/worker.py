"""Worker: one rank's device, model, KV cache and runner — the one owner of the step.

Everything a step runs is built here, from the `EngineConfig`, never attached from outside: the
model, the KV pool, the runner with its sampler, the LoRA slots, the drafter of speculative
decoding (its draft model and KV), the KV connector, and the fast step (CUDA graphs, or the CPU
decode step). The engine reaches a worker only through its executor, with `SchedulerOutput`s in
and `ModelRunnerOutput`s out, plus adapter loading between steps.

Its life, in the order every rank follows (ranks stay in lockstep because they make the same
collective calls in the same order):

1. `__init__`: the device, and the tensor-parallel group this rank belongs to;
2. `load_model`: the model built for this rank (its slices of every layer), weights loaded;
3. `determine_num_kv_blocks`: how many KV blocks fit, from memory measured after loading;
4. `initialize_cache`: the KV tensors (the count every rank agreed on), swap space and the runner
   with all it runs beside the model. A quantization that calibrates (AWQ, w8a8, fp8 from a float
   checkpoint) first gets a bare runner: the engine runs calibration text through it, `calibrate`
   rounds the weights, and only then is the runner built whole (LoRA wraps the final layers, the
   fast step captures them);
5. `execute_model`: one step.

The worker knows nothing of requests' text or of scheduling; it receives `SchedulerOutput`s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from kvflow.attention import sparse_decode
from kvflow.config import EngineConfig
from kvflow.core.runner_output import ModelRunnerOutput
from kvflow.core.sched_output import SchedulerOutput
from kvflow.cpu_extension import kernel_scope
from kvflow.distributed.parallel_state import SINGLE, TensorParallel
from kvflow.distributed.pipeline import WHOLE, PipelineStage, stage_layers
from kvflow.kv_store import KVBlockStore, open_kv_block_store, open_offload_store
from kvflow.lora.manager import LoRAManager
from kvflow.lora.request import LoRARequest
from kvflow.model.arch_config import ArchConfig
from kvflow.model.layers.batch_invariant import ROW_TILE
from kvflow.model.loader import Checkpoint
from kvflow.quant.calibration import calibrate_and_quantize
from kvflow.worker import host_malloc
from kvflow.worker.cpu_decode import CpuDecodeLoop
from kvflow.worker.cuda_graphs import DecodeGraphs
from kvflow.worker.kv_cache import (
    IdleGate,
    PagePopulator,
    allocate_kv_caches,
    available_memory_bytes,
    pool_blocks,
    unique_caches,
    utilization_budget_gb,
)
from kvflow.worker.kv_connector import KVStoreConnectorWorker, OffloadConnectorWorker
from kvflow.worker.model_runner import ModelRunner
from kvflow.worker.rank_model import load_model, rank_arch
from kvflow.worker.speculation import build_speculator, drafter_block_bytes


class Worker:
    def __init__(self, config: EngineConfig, arch: ArchConfig, quant_config, tp: TensorParallel = SINGLE,
                 stage: PipelineStage = WHOLE) -> None:
        """`stage`: the pipeline stage this rank runs (its `layers` left None: this worker works
        them out from the model's layer count)."""
        self.config = config
        self.arch = arch
        self.quant_config = quant_config
        self.tp = tp
        if stage.size > 1 and stage.layers is None:
            stage = dataclasses.replace(stage, layers=stage_layers(arch.num_layers, stage.index, stage.size))
        self.stage = stage
        self.device = torch.device(config.device)
        self.model: torch.nn.Module | None = None
        self.model_runner: ModelRunner | None = None
        self.lora: LoRAManager | None = None  # the adapters' slots, once the model's layers are final
        self.local_arch = rank_arch(arch, tp)
        # With --kv-populate when-idle, the KV pool's populate runs only while no step does.
        self.idle = IdleGate() if config.cache.populate == "when-idle" else None
        self.populators: list[tuple[PagePopulator, bool]] = []  # (the pool's, whether the pool is the host's)
        # Adapters unfinished requests use (the engine says so with each step and each load): the
        # host cache never evicts them, and a removed adapter is forgotten only once unused.
        self._adapters_in_use: frozenset[int] = frozenset()
        self._pools: tuple[list[torch.Tensor], list[torch.Tensor] | None, int] | None = None
        # KV offloading's tiers (rank 0's are shared with the scheduler's connector, for lookups).
        self.kv_offload_store: KVBlockStore | None = None
        if self.device.type == "cpu":
            host_malloc.keep_freed_memory()  # each step's activations on pages the last step freed

    def load_model(self, checkpoint: Checkpoint) -> torch.nn.Module:
        # Built and processed in the engine's kernel choices: its layers keep them (cpu_extension).
        with kernel_scope(self.config.kernels):
            self.model = load_model(self.config, self.arch, self.quant_config, checkpoint, self.tp, self.stage)
        return self.model

    def determine_num_kv_blocks(self) -> tuple[int, int]:
        """(device blocks, host blocks for swapping) this rank can hold: the configured budget,
        capped by the memory measured free now that the model is loaded."""
        cfg = self.config
        cache = cfg.cache
        if cache.gpu_memory_utilization is not None and cache.num_kv_blocks is None:
            cache = dataclasses.replace(cache, kv_cache_memory_gb=utilization_budget_gb(cache.gpu_memory_utilization,
                                                                                        self.device))
        layout = self.local_arch.kv_layout
        side = 0 if cfg.kernels.sparse_decode_blocks is None else sparse_decode.summary_bytes(layout, self.stage.layers)
        side += drafter_block_bytes(cfg, self.tp)  # the drafter's KV sits at the same block ids
        return pool_blocks(cache, layout, cfg.model.dtype.itemsize, cfg.model.max_model_len,
                           cfg.scheduler.max_num_seqs, available_memory_bytes(self.device), self.stage.layers, side)

    @property
    def needs_calibration(self) -> bool:
        """The model's weights are rounded only after calibration text has run through it."""
        return getattr(self.quant_config, "needs_calibration", False)

    def initialize_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        """The KV tensors and swap space; then the runner, whole, or bare until `calibrate`."""
        cache, dtype = self.config.cache, self.config.model.dtype
        layout = self.local_arch.kv_layout
        layers = self.stage.layers
        kv_caches = allocate_kv_caches(layout, num_blocks, cache.block_size, dtype, self.device, cache.cache_dtype,
                                       populate=False, layers=layers, num_state_slots=self.config.scheduler.max_num_seqs)
        host_caches = (allocate_kv_caches(layout, num_host_blocks, cache.block_size, dtype, "cpu", cache.cache_dtype,
                                          populate=False, layers=layers) if num_host_blocks else None)
        self.start_populate(kv_caches, host_caches)
        self._pools = (kv_caches, host_caches, num_blocks)
        if self.config.kv_offload is not None:  # before calibration: the engine's scheduler reads it
            self.kv_offload_store = open_offload_store(self.config.kv_offload, self.tp.rank, self.tp.size,
                                                       pin_memory=self.device.type == "cuda")
        if self.needs_calibration:
            self.model_runner = self._bare_runner()
        else:
            self.model_runner = self._build_runner()

    def calibrate(self, run_prompts: Callable[[list[list[int]]], None], windows: list[list[int]]) -> dict[str, float]:
        """Record the layers' inputs while `run_prompts` runs `windows` through the float model
        (the engine's steps, which come back here), fold the searched scales, round the weights,
        then build the whole runner. Returns each searched layer's choice."""
        if not self.needs_calibration or self._pools is None:
            raise RuntimeError("calibrate: this worker's model has nothing to calibrate, or no KV pool yet")
        chosen = calibrate_and_quantize(self.model, run_prompts, windows, self.config.model.seed)
        self.model_runner = self._build_runner()
        return chosen

    def _bare_runner(self) -> ModelRunner:
        kv_caches, host_caches, _ = self._pools
        return ModelRunner(self.model, kv_caches, self.config.cache.block_size, self.device, self.config.model.seed,
                           host_caches, stage=self.stage, kv_layout=self.local_arch.kv_layout)

    def _build_runner(self) -> ModelRunner:
        """The runner and what a step runs beside the model, in the order each needs the others:
        LoRA wraps the final linear layers; the fast step captures the layers as they will run; the
        runner builds its own drafter (which shares its sampler and, for layer skip, its model)."""
        cfg = self.config
        kv_caches, host_caches, num_blocks = self._pools
        if cfg.lora is not None:
            self.lora = LoRAManager(self.model, cfg.lora.max_loras, cfg.lora.max_lora_rank, cfg.lora.max_cpu_loras,
                                    cfg.model.dtype, self.device, in_use=lambda: self._adapters_in_use,
                                    row_tile=ROW_TILE if cfg.batch_invariant else None)
        connector = None if cfg.kv_transfer is None else KVStoreConnectorWorker(open_kv_block_store(cfg.kv_transfer),
                                                                                 kv_caches, self.tp)
        if self.kv_offload_store is not None:
            connector = OffloadConnectorWorker(
                self.kv_offload_store, kv_caches, self.tp, cfg.kv_offload.load_timeout_s,
                max_backlog_bytes=cfg.kv_offload.host_bytes)
        speculator = None if cfg.speculative is None else (
            lambda runner: build_speculator(cfg, self.arch, runner, num_blocks))
        return ModelRunner(self.model, kv_caches, cfg.cache.block_size, self.device, cfg.model.seed, host_caches,
                           self._fast_step(kv_caches), lora=self.lora, kv_connector=connector,
                           build_speculator=speculator, stage=self.stage, kv_layout=self.local_arch.kv_layout)

    def _fast_step(self, kv_caches: list[torch.Tensor]) -> DecodeGraphs | CpuDecodeLoop | None:
        """Decode steps replayed from captured CUDA graphs, or run by the CPU decode step; None:
        through the modules. A mixture of experts sizes its per-expert matmuls from the routing, on
        the host: not capturable. LoRA's per-step slots are not captured yet. The CPU step calls the
        fused kernels itself: not with `custom_ops="none"`, nor with `enforce_eager`. A pipeline
        stage runs part of the model: through its modules. A model with recurrent state reads
        and writes its states by the step's request list: through its modules."""
        cfg = self.config
        if self.stage.size > 1 or self.local_arch.kv_layout.holds_state:
            return None
        if cfg.use_cuda_graphs and self.arch.moe is None:
            graphs = DecodeGraphs(self.model, kv_caches, cfg.cache.block_size, cfg.scheduler.max_num_seqs,
                                  cfg.model.max_model_len, self.device, len(self.local_arch.kv_layout.groups))
            graphs.capture()
            return graphs
        kernels = cfg.kernels
        if self.device.type == "cpu" and self.lora is None and kernels.decode_step and kernels.custom_ops:
            return CpuDecodeLoop.build(self.model, kv_caches)
        return None

    def start_populate(self, kv_caches: list[torch.Tensor], host_caches: list[torch.Tensor] | None) -> None:
        """Map the pools' pages in (`--kv-populate`, `kv_cache.PagePopulator`): all of them while
        the worker is idle (when-idle), or ahead of the steps' writes (background): as many blocks
        past the highest a step holds as one step can start writing (a block per request past
        its tokens' blocks, in every KV group)."""
        cache, sched = self.config.cache, self.config.scheduler
        if cache.populate == "off":
            return
        ahead = None
        if cache.populate == "background":
            step_blocks = -(-sched.max_num_batched_tokens // cache.block_size) + sched.max_num_seqs
            ahead = step_blocks * len(self.local_arch.kv_layout.groups)
        pools = [(kv_caches, False)] + ([(host_caches, True)] if host_caches else [])
        populators = [(PagePopulator(unique_caches(caches), ahead, self.idle), host) for caches, host in pools]
        self.populators = [(populator, host) for populator, host in populators if populator.thread is not None]

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._adapters_in_use = sched.adapters_in_use
        if self.idle is None:
            if self.populators:  # background: ahead of the blocks this step holds
                device_block, host_block = highest_blocks(sched)
                for populator, host in self.populators:
                    populator.reach(host_block if host else device_block)
            return self.model_runner.execute(sched)
        with self.idle:
            return self.model_runner.execute(sched)

    @property
    def kv_offload(self) -> OffloadConnectorWorker | None:
        """KV offloading's worker half: the runner's connector, when offloading is on."""
        connector = getattr(self.model_runner, "kv_connector", None)
        return connector if isinstance(connector, OffloadConnectorWorker) else None

    # -- LoRA adapters, between steps ------------------------------------------------------
    def add_lora(self, request: LoRARequest, in_use: frozenset[int]) -> bool:
        """Load and check an adapter into host memory; ValueError naming it if it cannot run here."""
        if self.lora is None:
            raise ValueError(f"LoRA adapter {getattr(request, 'lora_name', request)!r} was asked for, but LoRA is "
                             "not enabled (enable_lora=True, --enable-lora)")
        self._adapters_in_use = in_use
        self.lora.load(request)
        return True

    def remove_lora(self, lora_int_id: int, in_use: frozenset[int]) -> bool:
        self._adapters_in_use = in_use
        return self.lora is not None and self.lora.remove(lora_int_id)

    def list_loras(self) -> list[int]:
        return [] if self.lora is None else self.lora.list_loras()


def highest_blocks(sched: SchedulerOutput) -> tuple[int, int]:
    """The highest device block the step's requests hold (a table's newest block is its last) and
    the highest host block it swaps out to; -1 for none."""
    device = max((table[-1] for chunk in sched.chunks for table in chunk.block_ids if table), default=-1)
    return device, max((host for _, host in sched.swap_out), default=-1)
