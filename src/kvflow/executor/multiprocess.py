"""One worker per rank: rank 0 in this process (its output is the step's), the others in their
own processes, joined by torch.distributed.

Each step, rank 0 broadcasts the encoded step (`StepMessage`, only what changed) on a gloo
group, then every rank runs the same forward pass; the model's all-reduces and all-gathers keep
them in lockstep. Ranks are started here (`multiprocessing`, spawn) unless the user started them
(torchrun, or `--distributed-init-method` with `--node-rank` on each machine).

A rank that dies at start ends the engine's construction with an error naming it (rank 0 polls
its ranks while it waits for them: `RankWatch`); one that dies later is noticed before the next
step (its process is gone) or inside a collective (gloo reports the closed connection, or the
timeout passes): the step raises `WorkerDiedError` naming the rank and how it ended, the engine
ends the requests it carried with an error, and every later step raises at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import multiprocessing as mp
import os
import pickle
import weakref

import torch

from kvflow.config import EngineConfig
from kvflow.core.runner_output import ModelRunnerOutput
from kvflow.core.sched_output import SchedulerOutput
from kvflow.device_faults import WorkerDiedError
from kvflow.distributed.parallel_state import TensorParallel
from kvflow.distributed.pipeline import WHOLE, check_stages
from kvflow.distributed.process_groups import (
    DistributedInit,
    broadcast_object,
    create_groups,
    create_store,
    rank_device,
    wait_for_joins,
)
from kvflow.executor.base import Executor
from kvflow.executor.rank_watch import RankWatch
from kvflow.model.arch_config import ArchConfig
from kvflow.model.loader import Checkpoint
from kvflow.worker.rank_model import rank_arch
from kvflow.worker.step_message import StepEncoder
from kvflow.worker.worker import Worker
from kvflow.worker.worker_process import pipeline_stage, run_worker_process, start_worker

logger = logging.getLogger(__name__)


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, arch: ArchConfig, quant_config, checkpoint: Checkpoint) -> None:
        par = config.parallel
        _refuse_while_bootstrapping(par.world_size)
        # A model that cannot split fails before any rank starts.
        rank_arch(arch, TensorParallel(0, par.tensor_parallel_size))
        check_stages(arch.kv_cache_specs(), par.pipeline_parallel_size, arch.architecture)
        init, spawn = _rank_zero_init(par)
        self._threads = torch.get_num_threads()
        # The cores this engine was given (a data-parallel replica has its share), split among its ranks.
        rank_threads = max(1, self._threads // par.world_size)
        self._failed: str | None = None
        self._processes: list[mp.Process] = []
        self._finalizer = None
        store, init = create_store(init)
        try:
            if spawn:
                _spawn_ranks(config, init, self._processes, rank_threads)
            self._watch = RankWatch(init, store, self._processes)
            own = dataclasses.replace(config, device=rank_device(config.device, init.machine_rank))
            self._start(own, arch, quant_config, checkpoint, init, store, rank_threads)
        except BaseException:
            self._failed = "a rank failed to start"
            self.shutdown()
            raise
        self.encoder = StepEncoder()
        # An engine dropped without shutdown() (a script that just ends) still stops its ranks cleanly.
        self._finalizer = weakref.finalize(self, _stop_ranks, self._send_stop, self._processes, True, self._threads)

    def _start(self, config: EngineConfig, arch: ArchConfig, quant_config, checkpoint: Checkpoint,
               init: DistributedInit, store, num_threads: int) -> None:
        """Join the ranks, then load and agree on the pool, never waiting on a dead rank."""
        wait_for_joins(store, init, self._watch.check)
        if config.device == "cpu":
            torch.set_num_threads(num_threads)
        try:
            self.groups = create_groups(init, torch.device(config.device), store)
        except RuntimeError as e:  # a rank that joined did not connect: gone, or silent past the timeout
            raise self._watch.lost(e) from e
        if config.parallel.pipeline_parallel_size > 1:
            self.stage, tp = pipeline_stage(config, self.groups)
        else:
            self.stage, tp = WHOLE, TensorParallel(0, init.world_size, self.groups.device_group)
        self.driver_worker = Worker(config, arch, quant_config, tp, self.stage)
        self._send_stop = (functools.partial(broadcast_object, self.groups.cpu_group, None, 0) if self.stage.link is None
                           else functools.partial(_stop_pipeline, self.stage.link))
        try:
            self.num_kv_blocks, self.num_host_blocks = start_worker(self.driver_worker, self.groups, checkpoint,
                                                                    self._watch.wait)
        except RuntimeError as e:
            if isinstance(e, WorkerDiedError) or not _is_collective_error(e):
                raise
            raise self._watch.lost(e) from e

    @property
    def max_concurrent_batches(self) -> int:
        return self.stage.size

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if self.stage.size > 1:
            return self.submit(sched).result()
        self.check_health()
        with self._collectives():
            broadcast_object(self.groups.cpu_group, self.encoder.encode(sched), 0)
            return self.driver_worker.execute_model(sched)

    def submit(self, sched: SchedulerOutput):
        """Pipeline parallel: pass the step to stage 1 and run stage 0's layers on it; the output
        comes back from the last stage (`result()` of what this returns) while later batches start."""
        if self.stage.size == 1:
            return super().submit(sched)
        self.check_health()
        link = self.stage.link
        with self._collectives():
            link.send_step(pickle.dumps(self.encoder.encode(sched), protocol=pickle.HIGHEST_PROTOCOL))
            output = link.expect_output()
            self.driver_worker.execute_model(sched)
        return _GuardedOutput(output, self)

    @contextlib.contextmanager
    def _collectives(self):
        """A collective or point-to-point call that failed because a peer is gone or silent
        becomes a WorkerDiedError naming the rank, and fails every later step."""
        try:
            yield
        except RuntimeError as e:
            if isinstance(e, WorkerDiedError) or not _is_collective_error(e):
                raise
            error = self._watch.lost(e)
            self._failed = str(error)
            raise WorkerDiedError(f"the engine lost a worker: {self._failed}") from e

    def check_health(self) -> None:
        if self._failed is None:
            self._failed = self._watch.dead_ranks()
        if self._failed is not None:
            raise WorkerDiedError(f"the engine lost a worker: {self._failed}")

    def shutdown(self) -> None:
        if self._failed is None:
            self._failed = "shut down"
            self._stop(clean=True)
        else:
            self._stop(clean=False)

    def _stop(self, clean: bool) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        _stop_ranks(getattr(self, "_send_stop", None), self._processes, clean, self._threads)


class _GuardedOutput:
    """A pipelined batch's output, its wait failing as the executor's steps fail (`_collectives`)."""

    def __init__(self, output, executor: MultiprocExecutor) -> None:
        self._output, self._executor = output, executor

    def done(self) -> bool:
        return self._output.done()

    def result(self) -> ModelRunnerOutput:
        with self._executor._collectives():
            return self._output.result()


def _stop_pipeline(link) -> None:
    link.send_step(None)
    link.flush()


def _stop_ranks(send_stop, processes: list[mp.Process], clean: bool, threads: int) -> None:
    """Send the stop message (`clean`: every rank is alive and between steps), wait a little,
    kill what is left. Also run at interpreter exit for an engine nobody shut down."""
    if send_stop is not None and clean:
        try:
            if all(p.is_alive() for p in processes):
                send_stop()
        except RuntimeError as e:
            logger.warning("stopping workers: %s", e)
    for p in processes:
        if clean:
            p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    processes.clear()
    torch.set_num_threads(threads)


def _rank_zero_init(par) -> tuple[DistributedInit, bool]:
    """Where this engine's ranks meet, and whether it spawns them (no torchrun, no init method)."""
    init = (DistributedInit.parse(par.distributed_init_method, par.world_size, par.node_rank, par.distributed_timeout_s)
            if par.distributed_init_method else DistributedInit.from_torchrun(par.distributed_timeout_s))
    if init is None:
        return DistributedInit("127.0.0.1", 0, par.world_size, 0, par.distributed_timeout_s), True
    if init.world_size != par.world_size:
        raise ValueError(f"tensor_parallel_size x pipeline_parallel_size={par.world_size}, but {init.world_size} ranks "
                         "were started")
    if init.rank != 0:
        raise ValueError(f"rank {init.rank} does not run the engine: run the same `kvflow` command there "
                         "(ranks other than 0 become workers)")
    return init, False


def _spawn_ranks(config: EngineConfig, init: DistributedInit, processes: list[mp.Process], num_threads: int) -> None:
    """Start ranks 1..N-1, each added to `processes` as it starts (so a failure stops those before it).
    Each takes its own device from the one `config.device` names (`rank_device`)."""
    ctx = mp.get_context("spawn")
    for rank in range(1, init.world_size):
        p = ctx.Process(target=run_worker_process, args=(config, _for_rank(init, rank), True, num_threads),
                        daemon=True, name=f"kvflow-rank-{rank}")
        p.start()
        processes.append(p)


def _refuse_while_bootstrapping(world_size: int) -> None:
    """A process that multiprocessing started and that is still importing the main script (spawn
    re-runs it in every child) must not start ranks of its own: the script builds its engine at
    its top level. Said here, in the child, before it starts any; rank 0 then reports the
    child's exit."""
    process = mp.current_process()
    if getattr(process, "_inheriting", False):  # multiprocessing's own mark of that phase
        raise RuntimeError(
            f"process {process.name} (pid {os.getpid()}) is re-importing the main script, as multiprocessing's "
            f"spawn does in each process it starts, and that script builds an engine with tensor_parallel_size="
            f"{world_size} at its top level: put the code that builds the LLM under `if __name__ == '__main__':`")


def _for_rank(init: DistributedInit, rank: int) -> DistributedInit:
    """Spawned rank `rank`, on rank 0's machine: its machine rank counts from rank 0's."""
    return DistributedInit(init.host, init.port, init.world_size, rank, init.timeout_s,
                           local_rank=init.machine_rank + rank)


def _is_collective_error(e: RuntimeError) -> bool:
    """Whether a step failed in a collective (a peer gone or silent), not in the model itself."""
    if isinstance(e, torch.distributed.DistBackendError):
        return True
    text = str(e).lower()
    return any(s in text for s in ("connection", "timed out", "timeout", "gloo", "nccl", "peer"))
