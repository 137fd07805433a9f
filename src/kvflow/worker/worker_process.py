"""A rank other than 0: a worker in its own process, executing the steps rank 0 broadcasts (or, a
pipeline stage, the steps the previous stage passes on: kvflow.distributed.pipeline).

It follows the same life as rank 0's worker (join the others, load, agree on the KV pool size,
allocate), then loops: receive a `StepMessage`, rebuild the `SchedulerOutput`, run it (its collectives meet rank
0's), and drop the output: rank 0 samples for everyone. A `None` message, or losing rank 0,
ends the loop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
from collections.abc import Callable
from datetime import timedelta

import torch

from kvflow.config import EngineArgs, EngineConfig
from kvflow.distributed.parallel_state import TensorParallel
from kvflow.distributed.pipeline import PipelineLink, PipelineStage
from kvflow.distributed.process_groups import (
    IDLE_FOREVER,
    DistributedInit,
    ProcessGroups,
    announce_joined,
    broadcast_object,
    create_groups,
    create_store,
    create_subgroup,
    die_with_parent,
    rank_device,
    report_failure,
    wait_for_joins,
)
from kvflow.model.arch_config import ArchConfig
from kvflow.model.loader.resolve import load_checkpoint
from kvflow.quant.registry import get_quantization_config
from kvflow.worker.step_message import StepDecoder
from kvflow.worker.worker import Worker

logger = logging.getLogger(__name__)


def threads_per_rank(world_size: int) -> int:
    """Ranks on one CPU share its cores: each gets its part, so they do not oversubscribe."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _wait(work) -> None:
    work.wait()


def start_worker(worker: Worker, groups: ProcessGroups, checkpoint,
                 wait_for: Callable[[object], None] = _wait) -> tuple[int, int]:
    """Load, size the pool as the smallest any rank can hold, allocate: every rank calls this.
    Returns the (device, host) block counts agreed on. The agreement waits for the slowest rank's
    loading however long it takes (IDLE_FOREVER); `wait_for` waits for it (rank 0 watches its
    spawned ranks meanwhile: a rank that died loading is an error at once)."""
    worker.load_model(checkpoint)
    blocks = torch.tensor(worker.determine_num_kv_blocks(), dtype=torch.int64)
    opts = torch.distributed.AllreduceOptions()
    opts.reduceOp = torch.distributed.ReduceOp.MIN
    opts.timeout = IDLE_FOREVER
    wait_for(groups.cpu_group.allreduce([blocks], opts))
    device_blocks, host_blocks = (int(b) for b in blocks)
    worker.initialize_cache(device_blocks, host_blocks)
    return device_blocks, host_blocks


def run_worker_process(config: EngineConfig, init: DistributedInit, spawned: bool = True,
                       num_threads: int | None = None) -> None:
    """The whole life of rank `init.rank` (> 0). `spawned`: started by rank 0 on this machine,
    so it dies with it. It reaches the store first and says so, waits for the others, joins the
    groups, then loads: rank 0 learns at once that it arrived, and, if it fails at any point, of
    what. `num_threads`: its share of the cores (default: the machine's, shared by the ranks)."""
    if spawned:
        die_with_parent()
    config = dataclasses.replace(config, device=rank_device(config.device, init.machine_rank))
    if config.device == "cpu":
        torch.set_num_threads(num_threads or threads_per_rank(init.world_size))
    store, _ = create_store(init)
    announce_joined(store, init.rank)
    try:
        _serve(config, init, store)
    except BaseException as e:
        report_failure(store, init.rank, e)
        raise


def _serve(config: EngineConfig, init: DistributedInit, store) -> None:
    """Join, load, then run the steps rank 0 sends until it says stop or is gone."""
    wait_for_joins(store, init)
    groups = create_groups(init, torch.device(config.device), store)
    checkpoint = load_checkpoint(config.model.model or None, load_tokenizer=False,
                                 load_weights=config.model.load_format != "dummy",
                                 native_gguf=config.model.quantization is None)
    arch = ArchConfig.from_hf(checkpoint.hf_config)
    quant_config = get_quantization_config(config.model.quantization, config.model.group_size, checkpoint.quant_config,
                                           config.model.quantization_rotation)
    if config.parallel.pipeline_parallel_size > 1:
        stage, tp = pipeline_stage(config, groups)
        worker = Worker(config, arch, quant_config, tp, stage)
        start_worker(worker, groups, checkpoint)
        return _serve_stage(worker, stage)
    worker = Worker(config, arch, quant_config, TensorParallel(init.rank, init.world_size, groups.device_group))
    start_worker(worker, groups, checkpoint)
    decoder = StepDecoder()
    while True:
        try:  # the next step may be hours away (an idle server): no timeout
            msg = broadcast_object(groups.cpu_group, None, init.rank, timeout=IDLE_FOREVER)
        except RuntimeError as e:  # rank 0 is gone (closed connection)
            logger.error("rank %d: lost rank 0 (%s); exiting", init.rank, e)
            return
        if msg is None:
            return
        worker.execute_model(decoder.decode(msg))


def pipeline_stage(config: EngineConfig, groups: ProcessGroups) -> tuple[PipelineStage, TensorParallel]:
    """This rank's pipeline stage (rank // tensor_parallel_size), linked to its neighbours, and its
    tensor-parallel group within the stage (a group of its own per stage)."""
    init, par = groups.init, config.parallel
    tp_size, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    link = PipelineLink.for_rank(init.rank, tp_size, pp, groups.cpu_group, groups.device_group, config.model.dtype,
                                 timedelta(seconds=init.timeout_s))
    index, tp_rank = divmod(init.rank, tp_size)
    tp = TensorParallel()
    if tp_size > 1:
        group = create_subgroup(groups, torch.device(config.device), f"stage{index}", index * tp_size, tp_size)
        tp = TensorParallel(tp_rank, tp_size, group)
    return PipelineStage(index, pp, link=link), tp


def _serve_stage(worker: Worker, stage: PipelineStage) -> None:
    """A pipeline rank other than 0: take each step from the rank before it, pass it on, run this
    stage's layers on it (which takes and passes on the activations); the last stage's first rank
    sends the step's output to rank 0. A stop, or losing the rank before it, ends it."""
    link, decoder = stage.link, StepDecoder()
    while True:
        try:  # the next step may be hours away (an idle server): no timeout
            payload = link.recv_step(IDLE_FOREVER)
        except RuntimeError as e:
            logger.error("pipeline stage %d: lost the previous stage (%s); exiting", stage.index, e)
            return
        link.send_step(payload)
        if payload is None:
            if link.output_to is None:  # the next ranks get the stop (outputs may have no reader now)
                link.flush()
            return
        out = worker.execute_model(decoder.decode(pickle.loads(payload)))
        if link.output_to is not None:
            link.send_output(out)


def external_rank(args: EngineArgs) -> DistributedInit | None:
    """Where this process joins as a rank other than 0, when it was started as one (by torchrun,
    or by hand with --distributed-init-method and --node-rank); None when it runs the engine."""
    if args.world_size == 1:
        return None
    if args.distributed_init_method:
        init = DistributedInit.parse(args.distributed_init_method, args.world_size, args.node_rank,
                                     args.distributed_timeout_s)
    else:
        init = DistributedInit.from_torchrun(args.distributed_timeout_s)
    return init if init is not None and init.rank != 0 else None


def run_external_rank(args: EngineArgs, init: DistributedInit) -> None:
    """A rank started outside the engine: the same worker, until rank 0 stops or is lost."""
    hf_config = load_checkpoint(args.model, load_tokenizer=False, load_weights=False).hf_config
    config = args.create_config(ArchConfig.from_hf(hf_config).max_position_embeddings)
    logger.info("rank %d of %d: joining %s:%d", init.rank, init.world_size, init.host, init.port)
    run_worker_process(config, init, spawned=False)
