"""Worker: one rank's device, model, KV cache and runner.

Its life, in the order every rank follows (ranks stay in lockstep because they make the same
collective calls in the same order):

1. `__init__`: the device, and the tensor-parallel group this rank belongs to;
2. `load_model`: the model built for this rank (its slices of every layer), weights loaded;
3. `num_kv_blocks`: how many KV blocks fit, from memory measured after loading;
4. `initialize_cache`: the KV tensors (the count every rank agreed on), swap space, CUDA graphs,
   and the `ModelRunner` that runs steps on them;
5. `execute_model`: one step.

The worker knows nothing of requests' text or of scheduling; it receives `SchedulerOutput`s.
"""

from __future__ import annotations

import dataclasses

import torch

from kvflow.attention.backend import get_attention_backend
from kvflow.config import EngineConfig
from kvflow.core.sched_output import SchedulerOutput
from kvflow.distributed.parallel_state import SINGLE, TensorParallel, split_heads, tensor_parallel_scope
from kvflow.kv_store import open_kv_block_store
from kvflow.model.arch_config import ArchConfig
from kvflow.model.layers.batch_invariant import make_batch_invariant
from kvflow.model.loader import Checkpoint
from kvflow.model.loader.dummy import init_dummy_weights
from kvflow.model.loader.weights import process_weights_after_loading
from kvflow.model.registry import build_model
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
)
from kvflow.worker.kv_connector import KVStoreConnectorWorker
from kvflow.worker.model_runner import ModelRunner
from kvflow.worker.runner_output import ModelRunnerOutput


class Worker:
    def __init__(self, config: EngineConfig, arch: ArchConfig, quant_config, tp: TensorParallel = SINGLE) -> None:
        self.config = config
        self.arch = arch
        self.quant_config = quant_config
        self.tp = tp
        self.device = torch.device(config.device)
        self.model: torch.nn.Module | None = None
        self.model_runner: ModelRunner | None = None
        self.local_arch = rank_arch(arch, tp)
        # With --kv-populate when-idle, the KV pool's populate runs only while no step does.
        self.idle = IdleGate() if config.cache.populate == "when-idle" else None
        self.populators: list[tuple[PagePopulator, bool]] = []  # (the pool's, whether the pool is the host's)
        if self.device.type == "cpu":
            host_malloc.keep_freed_memory()  # each step's activations on pages the last step freed

    def load_model(self, checkpoint: Checkpoint) -> torch.nn.Module:
        self.model = load_model(self.config, self.arch, self.quant_config, checkpoint, self.tp)
        return self.model

    def determine_num_kv_blocks(self) -> tuple[int, int]:
        """(device blocks, host blocks for swapping) this rank can hold: the configured budget,
        capped by the memory measured free now that the model is loaded."""
        cfg = self.config
        return pool_blocks(cfg.cache, self.local_arch.kv_layout, cfg.model.dtype.itemsize, cfg.model.max_model_len,
                           cfg.scheduler.max_num_seqs, available_memory_bytes(self.device))

    def initialize_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        """The KV tensors, swap space and captured decode graphs; then the runner."""
        cfg, cache, dtype = self.config, self.config.cache, self.config.model.dtype
        layout = self.local_arch.kv_layout
        kv_caches = allocate_kv_caches(layout, num_blocks, cache.block_size, dtype, self.device, cache.cache_dtype,
                                       populate=False)
        host_caches = (allocate_kv_caches(layout, num_host_blocks, cache.block_size, dtype, "cpu", cache.cache_dtype,
                                          populate=False) if num_host_blocks else None)
        self.start_populate(kv_caches, host_caches)
        graphs = None
        # A mixture of experts sizes its per-expert matmuls from the routing, on the host: not capturable.
        if cfg.use_cuda_graphs and self.arch.moe is None:
            graphs = DecodeGraphs(self.model, kv_caches, cache.block_size, cfg.scheduler.max_num_seqs,
                                  cfg.model.max_model_len, self.device, len(layout.groups))
            graphs.capture()
        elif self.device.type == "cpu" and cfg.lora is None:
            graphs = CpuDecodeLoop.build(self.model, kv_caches)  # LoRA wraps the layers later: not with it
        self.model_runner = ModelRunner(self.model, kv_caches, cache.block_size, self.device, cfg.model.seed,
                                        host_caches, graphs)
        if cfg.kv_transfer is not None:
            self.model_runner.kv_connector = KVStoreConnectorWorker(open_kv_block_store(cfg.kv_transfer), kv_caches)

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
        if self.idle is None:
            if self.populators:  # background: ahead of the blocks this step holds
                device_block, host_block = highest_blocks(sched)
                for populator, host in self.populators:
                    populator.reach(host_block if host else device_block)
            return self.model_runner.execute(sched)
        with self.idle:
            return self.model_runner.execute(sched)


def highest_blocks(sched: SchedulerOutput) -> tuple[int, int]:
    """The highest device block the step's requests hold (a table's newest block is its last) and
    the highest host block it swaps out to; -1 for none."""
    device = max((table[-1] for chunk in sched.chunks for table in chunk.block_ids if table), default=-1)
    return device, max((host for _, host in sched.swap_out), default=-1)


def load_model(config: EngineConfig, arch: ArchConfig, quant_config, checkpoint: Checkpoint,
               tp: TensorParallel = SINGLE) -> torch.nn.Module:
    """A model of `arch` built for rank `tp.rank` (its slices of every layer), with the
    checkpoint's weights (dummy ones for load_format="dummy"), ready to run."""
    # A CUDA-graph decode needs the triton decode grid fixed by a bound, not by the step.
    static_len = config.model.max_model_len if config.use_cuda_graphs else None
    with tensor_parallel_scope(tp):
        if config.batch_invariant and (arch.moe is not None or arch.mla is not None):
            raise ValueError(f"batch_invariant: {arch.architecture} is not covered yet (expert routing and latent "
                             "attention are batched by their own kernels); use a dense-attention model")
        model = build_model(arch, get_attention_backend(config.attention_backend, static_len, config.batch_invariant),
                            config.model.dtype, config.device, quant_config)
    if config.model.load_format == "dummy":
        init_dummy_weights(model, config.model.seed)
    else:
        model.load_weights(checkpoint.weights)
    process_weights_after_loading(model)
    if config.batch_invariant:
        make_batch_invariant(model)
    return model


def rank_arch(arch: ArchConfig, tp: TensorParallel) -> ArchConfig:
    """The architecture as rank `tp.rank` sees it: its share of the attention heads (so its KV
    layout holds only its KV heads). Raises if the model cannot be split `tp.size` ways."""
    if tp.size == 1:
        return arch
    if arch.mla is not None or arch.moe is not None:
        raise ValueError(f"tensor_parallel_size={tp.size}: {arch.architecture} cannot run tensor-parallel yet "
                         "(latent attention and mixtures of experts are not sharded); use tensor_parallel_size=1")
    heads = split_heads(arch.num_heads, arch.num_kv_heads, tp, arch.architecture)
    return dataclasses.replace(arch, num_heads=heads.num_heads, num_kv_heads=heads.num_kv_heads)
