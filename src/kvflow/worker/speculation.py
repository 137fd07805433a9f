"""The drafter a runner builds for speculative decoding (`speculative_config`): the proposer,
with its draft model and that model's KV where it has them, and the speculator that verifies the
proposals and asks for the next ones. The scheduler's half (how many tokens each request
proposes: spec_decode/adaptive.py) is the engine's.

An EAGLE head (`eagle`, `eagle3`) is built here, never by the model registry: it is no model on
its own (it borrows the target's embedding and, for EAGLE-1, its LM head), and it is built in the
target's tensor-parallel scope so that it shards as the target does. Its KV, like a draft
model's, is its own tensors at the target's block ids, as many blocks as the target's pool.
"""

from __future__ import annotations

import dataclasses

import torch

from kvflow.attention.backend import get_attention_backend
from kvflow.config import EngineConfig
from kvflow.cpu_extension import kernel_scope
from kvflow.distributed.parallel_state import TensorParallel, tensor_parallel_scope
from kvflow.kv_cache_spec import KVLayout
from kvflow.model.arch_config import ArchConfig
from kvflow.model.loader.dummy import init_dummy_weights
from kvflow.model.loader.resolve import load_checkpoint
from kvflow.model.loader.weights import process_weights_after_loading
from kvflow.model.models.blocks import DecoderLayer
from kvflow.model.models.eagle import EagleHead, KeptLayerInputs
from kvflow.quant.registry import get_quantization_config
from kvflow.spec_decode.eagle import EagleProposer
from kvflow.spec_decode.model_proposer import ModelProposer
from kvflow.spec_decode.ngram import NgramProposer
from kvflow.spec_decode.proposer import Proposer
from kvflow.worker.draft_runner import DraftRunner, HeadRunner
from kvflow.worker.kv_cache import allocate_kv_caches
from kvflow.worker.rank_model import load_model, rank_arch
from kvflow.worker.speculator import Speculator


def build_speculator(config: EngineConfig, arch: ArchConfig, runner, num_blocks: int) -> Speculator:
    """`runner`: the target's ModelRunner, whose sampler, flat-batch builder (and, for layer skip,
    model and KV) the drafter shares."""
    return Speculator(make_proposer(config, arch, runner, num_blocks), runner.sampler, runner.device,
                      reads_layer_states=config.speculative.method == "eagle3")


def drafter_block_bytes(config: EngineConfig, tp) -> int:
    """What each block of the pool costs beside the target's KV for a drafter with KV of its own (a
    draft model, an EAGLE head: their tensors sit at the target's block ids, one block each per
    target block), on this rank (`tp`); 0 for a drafter without (ngram, layer_skip). Read from the
    drafter's config alone, before any weight loads: the pool is sized before the drafter is built."""
    spec = config.speculative
    if spec is None or spec.method not in ("draft_model", "eagle", "eagle3"):
        return 0
    draft_arch = ArchConfig.from_hf(load_checkpoint(spec.model, load_tokenizer=False, load_weights=False).hf_config)
    return rank_arch(draft_arch, tp).kv_layout.block_bytes(config.cache.block_size, config.model.dtype.itemsize)


def make_proposer(config: EngineConfig, arch: ArchConfig, runner, num_blocks: int) -> Proposer:
    spec = config.speculative
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method in ("eagle", "eagle3"):
        return make_eagle_proposer(config, arch, runner, num_blocks)
    if spec.method == "layer_skip":
        layers = spec.num_draft_layers
        if layers > arch.num_layers:
            raise ValueError(f"speculative_config: num_draft_layers ({layers}) exceeds the model's "
                             f"{arch.num_layers} layers")
        # Self-speculation: the target's first layers, on the target's own KV for those layers.
        draft = DraftRunner(runner.model, runner.kv_caches[:layers], runner)
        return ModelProposer(draft, runner.sampler.generator, shares_target_kv=True)
    checkpoint = load_checkpoint(spec.model, load_tokenizer=False, load_weights=config.model.load_format != "dummy")
    draft_arch = ArchConfig.from_hf(checkpoint.hf_config)
    if draft_arch.vocab_size != arch.vocab_size:
        raise ValueError(f"speculative_config: the draft model's vocabulary ({draft_arch.vocab_size} tokens) "
                         f"differs from the target's ({arch.vocab_size}); it must share the tokenizer")
    if draft_arch.max_position_embeddings < config.model.max_model_len:
        raise ValueError(f"speculative_config: the draft model's context ({draft_arch.max_position_embeddings} "
                         f"tokens) is shorter than max_model_len ({config.model.max_model_len}); lower max_model_len")
    target_group = target_group_for_draft(draft_arch.kv_layout, arch.kv_layout)
    # The draft runs as its checkpoint stores it (the engine's --quantization is the target's).
    draft_model = load_model(config, draft_arch, get_quantization_config(None, None, checkpoint.quant_config), checkpoint)
    kv_caches = allocate_kv_caches(draft_arch.kv_layout, num_blocks, config.cache.block_size, config.model.dtype,
                                   config.device, populate=config.cache.populate != "off")
    return ModelProposer(DraftRunner(draft_model, kv_caches, runner, (target_group,)), runner.sampler.generator,
                         shares_target_kv=False)


def target_group_for_draft(draft: KVLayout, target: KVLayout) -> int:
    """The target KV group whose block tables the draft model's KV follows (its own tensors at the
    target's block ids). The table must hold a block wherever the draft reads: a full-attention
    group's always does; a sliding group's only within its window, so only for a draft whose
    window is no wider. Two draft groups would need two tables with distinct blocks."""
    if len(draft.groups) != 1:
        raise ValueError(f"speculative_config: the draft model has {len(draft.groups)} KV groups (layers with "
                         "different attention, e.g. sliding and global); a draft model needs one kind of layer")
    window = draft.sliding_windows[0]
    usable = [g for g, w in enumerate(target.sliding_windows) if w is None or (window is not None and w >= window)]
    if not usable:
        raise ValueError(f"speculative_config: the target keeps only sliding windows {target.sliding_windows}, "
                         f"narrower than the draft model's attention (window {window})")
    return min(usable, key=lambda g: target.sliding_windows[g] is not None)  # a full group first



def make_eagle_proposer(config: EngineConfig, arch: ArchConfig, runner, num_blocks: int) -> EagleProposer:
    """An EAGLE (`eagle`) or EAGLE-3 (`eagle3`) head over the target `runner.model`, its KV at the
    target's block ids; a checkpoint that does not fit the target is refused, naming the field."""
    spec, target = config.speculative, runner.model
    eagle3 = spec.method == "eagle3"
    checkpoint = load_checkpoint(spec.model, load_tokenizer=False, load_weights=config.model.load_format != "dummy")
    head_arch = eagle_arch(checkpoint.hf_config, arch, config.model.max_model_len)
    layer_ids = eagle3_layer_ids(checkpoint.hf_config, arch, target) if eagle3 else ()
    tensors = dict(checkpoint.weights)
    tp = target.model.embed_tokens.tp  # the target's rank and group: the head shards as the target does
    head = build_eagle_head(config, head_arch, target, tensors, len(layer_ids) * arch.hidden_size or None, tp)
    kv_caches = allocate_kv_caches(rank_arch(head_arch, tp).kv_layout, num_blocks, config.cache.block_size,
                                   config.model.dtype, config.device, populate=config.cache.populate != "off")
    head_runner = HeadRunner(head, kv_caches, runner, (target_group_for_draft(head_arch.kv_layout, arch.kv_layout),))
    kept = KeptLayerInputs(target.model.layers, layer_ids) if eagle3 else None
    return EagleProposer(head_runner, head.combine, runner.sampler.generator, None if kept is None else kept.take)


def eagle_arch(hf: dict, target: ArchConfig, max_model_len: int) -> ArchConfig:
    """The head's config (a one-layer Llama config), checked against the target's."""
    head = ArchConfig.from_hf(hf)
    checks = (("num_hidden_layers", head.num_layers, 1, "an EAGLE head is one decoder layer"),
              ("hidden_size", head.hidden_size, target.hidden_size, "the target's: it reads the target's embedding"),
              ("target_hidden_size", hf.get("target_hidden_size", head.hidden_size), target.hidden_size,
               "the target's hidden size"),
              ("vocab_size", head.vocab_size, target.vocab_size, "the target's vocabulary"))
    for name, value, wanted, why in checks:
        if value != wanted:
            raise ValueError(f"speculative_config: the EAGLE head's {name} is {value}; it must be {wanted} ({why})")
    if head.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config: the EAGLE head's context ({head.max_position_embeddings} tokens) is "
                         f"shorter than max_model_len ({max_model_len}); lower max_model_len")
    return head


def eagle3_layer_ids(hf: dict, target: ArchConfig, model: torch.nn.Module) -> tuple[int, ...]:
    """The target layers whose inputs EAGLE-3 reads: the head config's
    `eagle_aux_hidden_state_layer_ids` (top level or in `eagle_config`), else vLLM's default."""
    ids = hf.get("eagle_aux_hidden_state_layer_ids") or (hf.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    layers = target.num_layers
    ids = tuple(ids) if ids else (2, layers // 2, layers - 3)
    if not all(isinstance(i, int) and 0 <= i < layers for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"speculative_config: the EAGLE-3 head's eagle_aux_hidden_state_layer_ids {list(ids)} must "
                         f"name distinct layers of the target's {layers} (0 to {layers - 1})")
    if not all(isinstance(layer, DecoderLayer) for layer in model.model.layers):
        raise ValueError(f"speculative_config: method eagle3 reads the residual stream of Llama-family decoder layers; "
                         f"{target.architecture}'s layers are not")
    return tuple(sorted(ids))  # the states side by side in layer order, as vLLM's target keeps them


def build_eagle_head(config: EngineConfig, head_arch: ArchConfig, target: torch.nn.Module,
                     tensors: dict[str, torch.Tensor], aux_width: int | None, tp: TensorParallel) -> EagleHead:
    """The head on the target's device, in the model dtype, with the checkpoint's weights (or
    dummy ones for load_format="dummy"); its attention dense (sparse decode's summaries and a CUDA
    graph's fixed grid are the target's)."""
    head_arch = dataclasses.replace(head_arch, max_model_len=config.model.max_model_len)
    with tensor_parallel_scope(tp), kernel_scope(config.kernels), torch.device(config.device):
        backend = get_attention_backend(config.attention_backend, None, config.batch_invariant)
        head = EagleHead(head_arch, backend, target.model.embed, target.compute_logits, "fc.bias" in tensors,
                         aux_width).eval()
    for param in head.parameters():  # built in float32: the RoPE tables stay so
        param.data = param.data.to(config.model.dtype)
    if config.model.load_format == "dummy":
        init_dummy_weights(head, config.model.seed)
    else:
        try:
            head.load_weights(tensors)
        except ValueError as e:
            raise ValueError(f"speculative_config: the EAGLE head {config.speculative.model!r}: {e}") from None
    process_weights_after_loading(head)
    return head
