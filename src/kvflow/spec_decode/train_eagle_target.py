"""What an EAGLE head is trained from, taken from the target as kvflow serves it (its own loader,
GGUF or safetensors, quantized or not): the features at every position, the embedding and LM head
rows, the RoPE tables, and its last layer's weights to start the head from.

The features are the target's final hidden states after its final norm, what `DecoderModel.forward`
returns. They come from the engine's own runner on the engine's own KV pool: one flat batch of
whole sequences built by `ModelRunner.prepare` and one forward pass of the model, as the drafter
(`worker/draft_runner.py`) drives it. The trainer's engine runs no request while it does this and
is built without prefix caching, so no block it writes is one a request holds or will read.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from kvflow.core.sched_output import ScheduledChunk
from kvflow.sampling_params import SamplingParams
from kvflow.spec_decode.train_eagle_head import FrozenTarget

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
FEATURE_BATCH_TOKENS = 2048  # rows of one feature pass: the activations of a prompt step's size


def check_target(arch) -> None:
    """An EAGLE-1 head is a Llama layer under the target's Llama LM head: refuse, naming what
    differs, a target whose layers it could not be started from or whose features mean more."""
    extras = [name for name, present in (
        ("attention_bias", arch.attention_bias), ("sliding windows", any(w is not None for w in arch.sliding_windows)),
        ("mixture of experts", arch.moe is not None), ("latent attention", arch.mla is not None),
        ("cross-layer KV sharing", arch.num_kv_shared_layers > 0)) if present]
    if arch.architecture not in SUPPORTED_ARCHITECTURES or extras:
        what = f"{arch.architecture} with {', '.join(extras)}" if extras else arch.architecture
        raise ValueError(f"train-drafter --method eagle: the target must be a plain "
                         f"{' or '.join(SUPPORTED_ARCHITECTURES)} (an EAGLE-1 head is one Llama layer); got {what}")


@torch.inference_mode()
def target_features(engine, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's features [len, hidden], float32 on the CPU. `engine`: an idle `LLMEngine`
    of the target without prefix caching."""
    runner, block_size = engine.runner, engine.config.cache.block_size
    groups = len(engine.arch.kv_layout.groups)
    pool = engine.num_kv_blocks * block_size
    longest = -(-max(map(len, sequences), default=0) // block_size) * block_size
    if longest > pool:
        raise ValueError(f"a sequence of {longest} tokens does not fit the engine's KV pool of "
                         f"{engine.num_kv_blocks} blocks of {block_size}; lower --seq-len")
    budget = min(max(FEATURE_BATCH_TOKENS, longest), pool)
    features: list[torch.Tensor] = []
    for batch in tqdm(_batches(sequences, block_size, budget), desc="target features", unit="pass", leave=False):
        chunks, next_block = [], 0
        for seq in batch:
            table = list(range(next_block, next_block + -(-len(seq) // block_size)))
            next_block += len(table)
            chunks.append(ScheduledChunk("eagle-features", seq, 0, (table,) * groups, False,
                                         SamplingParams(max_tokens=None), seq, [], frozenset()))
        flat = runner.prepare(chunks)
        hidden = runner.model(flat.input_ids, flat.positions, runner.kv_caches, flat.attn)
        features.extend(h.float().cpu() for h in hidden.split([len(s) for s in batch]))
    return features


def _batches(sequences: list[list[int]], block_size: int, budget: int) -> list[list[list[int]]]:
    """Consecutive sequences whose blocks' tokens fit `budget`; the same batches whatever ran
    before, so a resumed run gets the very features an uninterrupted one had."""
    batches: list[list[list[int]]] = [[]]
    used = 0
    for seq in sequences:
        cost = -(-len(seq) // block_size) * block_size
        if batches[-1] and used + cost > budget:
            batches.append([])
            used = 0
        batches[-1].append(seq)
        used += cost
    return [b for b in batches if b]


@torch.inference_mode()
def frozen_target(model) -> FrozenTarget:
    """The embedding and LM head rows as the model computes them (dequantized where it is
    quantized), and its RoPE tables. `model`: a kvflow Llama `CausalLM`."""
    embed = model.model.embed_tokens
    rows = embed(torch.arange(model.config.vocab_size, device=_activations(model).device))
    if model.lm_head is embed:
        head = rows
    else:  # the logits of the identity's rows e_i are W's columns: W^T
        head = model.compute_logits(_identity(model, model.config.hidden_size)).T
    rotary = model.model.rotary
    return FrozenTarget(rows.float().cpu(), head.float().contiguous().cpu(), rotary.cos.float().cpu(),
                        rotary.sin.float().cpu())


@torch.inference_mode()
def last_layer_tensors(model) -> dict[str, torch.Tensor]:
    """The target's last decoder layer as the head's HF-named float32 tensors (no input norm: the
    head has none). Each projection's matrix is read as the layer computes it, by running it on the
    identity, so a quantized layer gives its dequantized weights whatever its storage."""
    layer = model.model.layers[-1]
    attn, mlp = layer.self_attn, layer.mlp

    def matrix(linear) -> torch.Tensor:  # [out, in] of a layer without bias
        return linear(_identity(model, linear.input_size)).float().T.contiguous().cpu()

    q, k, v = matrix(attn.qkv_proj).split(attn.qkv_proj.output_sizes, dim=0)
    gate, up = matrix(mlp.gate_up_proj).split(mlp.gate_up_proj.output_sizes, dim=0)
    prefix = "layers.0."
    return {f"{prefix}self_attn.q_proj.weight": q, f"{prefix}self_attn.k_proj.weight": k,
            f"{prefix}self_attn.v_proj.weight": v, f"{prefix}self_attn.o_proj.weight": matrix(attn.o_proj),
            f"{prefix}mlp.gate_proj.weight": gate, f"{prefix}mlp.up_proj.weight": up,
            f"{prefix}mlp.down_proj.weight": matrix(mlp.down_proj),
            f"{prefix}post_attention_layernorm.weight": layer.post_attention_layernorm.weight.float().cpu()}


def _activations(model) -> torch.Tensor:
    """One embedding row: the dtype and device the model's activations have."""
    return model.model.embed_tokens(torch.zeros(1, dtype=torch.long, device=next(model.parameters()).device))


def _identity(model, size: int) -> torch.Tensor:
    like = _activations(model)
    return torch.eye(size, dtype=like.dtype, device=like.device)
