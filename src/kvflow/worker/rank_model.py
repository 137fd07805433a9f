"""A rank's model: the architecture as the rank sees it (its share of the heads) and the model built
for it, with its slices of the checkpoint's weights. Used by the worker for the target model and by
the drafter for a draft model."""

from __future__ import annotations

import dataclasses

import torch

from kvflow.attention.backend import get_attention_backend
from kvflow.config import EngineConfig
from kvflow.distributed.parallel_state import SINGLE, TensorParallel, split_heads, tensor_parallel_scope
from kvflow.model.arch_config import ArchConfig
from kvflow.model.layers.batch_invariant import make_batch_invariant
from kvflow.model.loader import Checkpoint
from kvflow.model.loader.dummy import init_dummy_weights
from kvflow.model.loader.weights import process_weights_after_loading
from kvflow.model.registry import build_model


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
