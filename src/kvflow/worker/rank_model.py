"""A rank's model: the architecture as the rank sees it (its share of the heads) and the model built
for it, with its slices of the checkpoint's weights. Used by the worker for the target model and by
the drafter for a draft model."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from kvflow.attention.backend import get_attention_backend
from kvflow.config import EngineConfig
from kvflow.distributed.parallel_state import SINGLE, TensorParallel, split_heads, tensor_parallel_scope
from kvflow.distributed.pipeline import WHOLE, PipelineStage, pipeline_scope
from kvflow.model.arch_config import ArchConfig
from kvflow.model.layers.batch_invariant import make_batch_invariant
from kvflow.model.loader import Checkpoint
from kvflow.model.loader.dummy import init_dummy_weights
from kvflow.model.loader.weights import process_weights_after_loading
from kvflow.model.registry import build_model
from kvflow.phases import phase


def load_model(config: EngineConfig, arch: ArchConfig, quant_config, checkpoint: Checkpoint,
               tp: TensorParallel = SINGLE, stage: PipelineStage = WHOLE) -> torch.nn.Module:
    """A model of `arch` built for rank `tp.rank` (its slices of every layer) of pipeline stage
    `stage` (its layers only), with the checkpoint's weights (dummy ones for load_format="dummy"),
    ready to run."""
    # A CUDA-graph decode needs the triton decode grid fixed by a bound, not by the step.
    static_len = config.model.max_model_len if config.use_cuda_graphs else None
    # longrope and dynamic RoPE scale once, for the longest sequence the engine serves.
    arch = dataclasses.replace(arch, max_model_len=config.model.max_model_len)
    with tensor_parallel_scope(tp), pipeline_scope(stage):
        if config.batch_invariant and (arch.moe is not None or arch.mla is not None):
            raise ValueError(f"batch_invariant: {arch.architecture} is not covered yet (expert routing and latent "
                             "attention are batched by their own kernels); use a dense-attention model")
        backend = get_attention_backend(config.attention_backend, static_len, config.batch_invariant,
                                        config.kernels.sparse_decode_blocks)
        model = build_model(arch, backend,
                            config.model.dtype, config.device, quant_config)
    model.keep_stage(stage)
    if config.model.load_format == "dummy":
        init_dummy_weights(model, config.model.seed)
    else:
        model.load_weights(checkpoint.weights)
    method = getattr(quant_config, "name", None)
    with phase(f"prepared the weights ({method})", announce=True) if method else contextlib.nullcontext():
        if quant_config is not None:
            quant_config.prepare_model(model)
        process_weights_after_loading(model)
    if config.batch_invariant:
        make_batch_invariant(model)
    return model


def rank_arch(arch: ArchConfig, tp: TensorParallel) -> ArchConfig:
    """The architecture as rank `tp.rank` sees it: its share of the attention heads (so its KV
    layout holds only its KV heads; latent attention's cache is every head's, so an MLA rank keeps
    the whole latent of every token and its layout is the full model's). Raises, naming what does
    not split and the sizes that would, if the model cannot be split `tp.size` ways."""
    if tp.size == 1:
        return arch
    unsplit = _unsplit_parts(arch, tp.size)
    if unsplit:
        works = [n for n in range(1, arch.num_heads + 1) if not _unsplit_parts(arch, n)]
        raise ValueError(f"tensor_parallel_size={tp.size} does not split {arch.architecture}'s {' and '.join(unsplit)} "
                         f"evenly over ranks; sizes that would work: {', '.join(map(str, works))}")
    if arch.mla is not None:
        return dataclasses.replace(arch, num_heads=arch.num_heads // tp.size)
    heads = split_heads(arch.num_heads, arch.num_kv_heads, tp, arch.architecture)
    return dataclasses.replace(arch, num_heads=heads.num_heads, num_kv_heads=heads.num_kv_heads)


def _unsplit_parts(arch: ArchConfig, size: int) -> list[str]:
    """What of `arch` does not split evenly over `size` ranks: attention heads (MLA splits its query
    heads only), the dense MLPs' and the experts' intermediate channels (experts split by channels,
    not by expert: see `kvflow.model.layers.moe`)."""
    parts = []
    if arch.mla is not None:
        if arch.num_heads % size:
            parts.append(f"{arch.num_heads} attention heads")
    else:
        try:
            split_heads(arch.num_heads, arch.num_kv_heads, TensorParallel(0, size))
        except ValueError:
            parts.append(f"{arch.num_heads} attention heads and {arch.num_kv_heads} KV heads")
    if (arch.moe is None or arch.moe.dense_layers) and arch.intermediate_size % size:
        parts.append(f"MLP intermediate size (intermediate_size {arch.intermediate_size})")
    if arch.moe is not None and arch.moe.expert_intermediate_size % size:
        field = "moe_intermediate_size" if arch.hf.get("moe_intermediate_size") else "intermediate_size"
        parts.append(f"experts' intermediate size ({field} {arch.moe.expert_intermediate_size})")
    return parts
