"""The executor interface the engine sees: the only way it reaches the workers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future

from kvflow.core.runner_output import ModelRunnerOutput
from kvflow.core.sched_output import SchedulerOutput
from kvflow.lora.request import LoRARequest
from kvflow.worker.worker import Worker


class Executor(ABC):
    """Owns the workers. After construction the model is loaded on every rank and the KV pool is
    allocated: `num_kv_blocks` device blocks (the same on every rank) and `num_host_blocks` of
    swap space. Rank 0's worker lives in this process (`driver_worker`): its output is the
    step's, and tools read its model through it."""

    driver_worker: Worker
    num_kv_blocks: int
    num_host_blocks: int

    @abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    @property
    def max_concurrent_batches(self) -> int:
        """Batches the engine may keep in flight at once (one per pipeline stage)."""
        return 1

    def submit(self, sched: SchedulerOutput) -> Future:
        """Start a batch; its output (or error) arrives in the future. Here it runs at once."""
        future = Future()
        try:
            future.set_result(self.execute_model(sched))
        except BaseException as e:
            future.set_exception(e)
        return future

    def calibrate(self, run_prompts: Callable[[list[list[int]]], None], windows: list[list[int]]) -> dict[str, float]:
        """Calibrate the model's quantization on `windows`, which `run_prompts` runs through the
        engine's steps (one process only: calibration folds scales across a layer's whole input)."""
        return self.driver_worker.calibrate(run_prompts, windows)

    def add_lora(self, request: LoRARequest, in_use: frozenset[int]) -> bool:
        """Load and check an adapter; ValueError naming it if it cannot run on this model."""
        return self.driver_worker.add_lora(request, in_use)

    def remove_lora(self, lora_int_id: int, in_use: frozenset[int]) -> bool:
        return self.driver_worker.remove_lora(lora_int_id, in_use)

    def list_loras(self) -> list[int]:
        return self.driver_worker.list_loras()

    def check_health(self) -> None:  # noqa: B027 (no worker can die in this process)
        """Raise if a worker has died."""

    def shutdown(self) -> None:  # noqa: B027 (nothing to stop in this process)
        """Stop the workers (idempotent)."""
