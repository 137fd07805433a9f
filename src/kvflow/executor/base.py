"""The executor interface the engine sees, and the choice of executor."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvflow.config import EngineConfig
from kvflow.core.sched_output import SchedulerOutput
from kvflow.model.arch_config import ArchConfig
from kvflow.model.loader import Checkpoint
from kvflow.worker.runner_output import ModelRunnerOutput
from kvflow.worker.worker import Worker


class Executor(ABC):
    """Owns the workers. After construction the model is loaded on every rank and the KV pool is
    allocated: `num_kv_blocks` device blocks (the same on every rank) and `num_host_blocks` of
    swap space."""

    driver_worker: Worker  # rank 0, in this process: its output is the step's output
    num_kv_blocks: int
    num_host_blocks: int

    @abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    def check_health(self) -> None:  # noqa: B027 (no worker can die in this process)
        """Raise if a worker has died."""

    def shutdown(self) -> None:  # noqa: B027 (nothing to stop in this process)
        """Stop the workers (idempotent)."""


def create_executor(config: EngineConfig, arch: ArchConfig, quant_config, checkpoint: Checkpoint) -> Executor:
    """`checkpoint`: the one the engine opened (its weights not yet read), loaded by rank 0."""
    if config.parallel.world_size == 1:
        from kvflow.executor.in_process import InProcessExecutor

        return InProcessExecutor(config, arch, quant_config, checkpoint)
    from kvflow.executor.multiprocess import MultiprocExecutor

    return MultiprocExecutor(config, arch, quant_config, checkpoint)
