"""Executors: how the engine's steps reach the workers. In-process (one worker, called directly)
or multi-process (one worker per rank over torch.distributed)."""

from __future__ import annotations

from kvflow.config import EngineConfig
from kvflow.executor.base import Executor
from kvflow.model.arch_config import ArchConfig
from kvflow.model.loader import Checkpoint


def create_executor(config: EngineConfig, arch: ArchConfig, quant_config, checkpoint: Checkpoint) -> Executor:
    """`checkpoint`: the one the engine opened (its weights not yet read), loaded by rank 0. The
    multi-process executor (torch.distributed) is imported only for tensor parallel."""
    if config.parallel.world_size == 1:
        from kvflow.executor.in_process import InProcessExecutor

        return InProcessExecutor(config, arch, quant_config, checkpoint)
    from kvflow.executor.multiprocess import MultiprocExecutor

    return MultiprocExecutor(config, arch, quant_config, checkpoint)
