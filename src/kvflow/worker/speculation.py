"""The drafter a runner builds for speculative decoding (`speculative_config`): the proposer,
with its draft model and that model's KV where it has them, and the speculator that verifies the
proposals and asks for the next ones. The scheduler's half (how many tokens each request
proposes: spec_decode/adaptive.py) is the engine's."""

from __future__ import annotations

from kvflow.config import EngineConfig
from kvflow.kv_cache_spec import KVLayout
from kvflow.model.arch_config import ArchConfig
from kvflow.model.loader.resolve import load_checkpoint
from kvflow.quant.registry import get_quantization_config
from kvflow.spec_decode.model_proposer import ModelProposer
from kvflow.spec_decode.ngram import NgramProposer
from kvflow.spec_decode.proposer import Proposer
from kvflow.worker.draft_runner import DraftRunner
from kvflow.worker.kv_cache import allocate_kv_caches
from kvflow.worker.rank_model import load_model
from kvflow.worker.speculator import Speculator


def build_speculator(config: EngineConfig, arch: ArchConfig, runner, num_blocks: int) -> Speculator:
    """`runner`: the target's ModelRunner, whose sampler, flat-batch builder (and, for layer skip,
    model and KV) the drafter shares."""
    return Speculator(make_proposer(config, arch, runner, num_blocks), runner.sampler, runner.device)


def make_proposer(config: EngineConfig, arch: ArchConfig, runner, num_blocks: int) -> Proposer:
    spec = config.speculative
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
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

