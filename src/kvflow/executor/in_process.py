"""One worker in the engine's own process, called directly: the default, and no slower than the
engine calling its runner itself (no message is encoded; the SchedulerOutput is passed as is)."""

from __future__ import annotations

from kvflow.config import EngineConfig
from kvflow.core.runner_output import ModelRunnerOutput
from kvflow.core.sched_output import SchedulerOutput
from kvflow.executor.base import Executor
from kvflow.model.arch_config import ArchConfig
from kvflow.model.loader import Checkpoint
from kvflow.worker.worker import Worker


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig, arch: ArchConfig, quant_config, checkpoint: Checkpoint) -> None:
        self.driver_worker = Worker(config, arch, quant_config)
        self.driver_worker.load_model(checkpoint)
        self.num_kv_blocks, self.num_host_blocks = self.driver_worker.determine_num_kv_blocks()
        self.driver_worker.initialize_cache(self.num_kv_blocks, self.num_host_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_worker.execute_model(sched)
