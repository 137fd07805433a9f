"""The shapes the engine would hand its GPU kernels for one model, without loading it or owning a
GPU: the model's architecture, the engine's defaults (dtype, block size, batch limits, KV pool),
a few representative steps, and meta tensors laid out as the model runner lays out its batch.

Meta tensors carry shape, strides and dtype but no memory, so a kernel's launch code can run on
them as it runs on CUDA tensors and choose the same configuration.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kvflow.analysis.model_spec import PRESETS, ModelSpec
from kvflow.attention.metadata import AttentionMetadata
from kvflow.config import CacheConfig, EngineArgs
from kvflow.model.arch_config import ArchConfig
from kvflow.worker.cuda_graphs import decode_buckets
from kvflow.worker.kv_cache import num_kv_blocks

META = torch.device("meta")
DEFAULT_CONTEXT_LEN = 1024  # each decoding request's context in the decode steps
PRESET_MAX_MODEL_LEN = 8192  # planner presets carry no context length


@dataclass(frozen=True)
class Step:
    """One engine step's batch: per request, its new tokens and its context after the step."""

    name: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    graph: bool  # a pure decode replayed from a CUDA graph: the attention grid is fixed by max_model_len

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


@dataclass(frozen=True)
class EngineShapes:
    model: str
    arch: ArchConfig
    dtype: torch.dtype
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    context_len: int = DEFAULT_CONTEXT_LEN

    def steps(self) -> list[Step]:
        """Every kind of step whose kernels differ: a full prompt budget; decodes at the largest
        and the smallest captured batch; and an eager mixed step (a prompt chunk beside short
        decodes, whose contexts fit one split, so decode writes its output without a merge)."""
        prompt = min(self.max_num_batched_tokens, self.max_model_len)
        ctx = min(self.context_len, self.max_model_len)
        batch = decode_buckets(self.max_num_seqs)[-1]
        chunk = min(256, prompt)
        return [
            Step("prefill", (prompt,), (prompt,), graph=False),
            Step("decode", (1,) * batch, (ctx,) * batch, graph=True),
            Step("decode b=1", (1,), (ctx,), graph=True),
            Step("mixed", (chunk, 1, 1, 1), (chunk, *[min(chunk, 100)] * 3), graph=False),
        ]

    def windows(self) -> list[int | None]:
        """The distinct attention windows of the model's layers (None: full attention)."""
        return sorted(set(self.arch.sliding_windows), key=lambda w: -1 if w is None else w)

    def empty(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype or self.dtype, device=META)

    def kv_cache(self) -> torch.Tensor:
        a = self.arch
        return self.empty(2, self.num_kv_blocks, a.num_kv_heads, self.block_size, a.head_dim)

    def metadata(self, step: Step) -> AttentionMetadata:
        """The runner's batch for this step (the decode graphs' static buffers when replayed)."""
        width = -(-(self.max_model_len if step.graph else max(step.seq_lens)) // self.block_size)
        requests = len(step.query_lens)
        long = torch.int64
        return AttentionMetadata(
            query_start_loc=self.empty(requests + 1, dtype=long), seq_lens=self.empty(requests, dtype=long),
            block_tables=self.empty(requests, width, dtype=long), slot_mapping=self.empty(step.num_tokens, dtype=long),
            block_size=self.block_size, query_lens_cpu=list(step.query_lens), seq_lens_cpu=list(step.seq_lens),
        )


def engine_shapes(model: str | None, args: EngineArgs, dtype: torch.dtype = torch.bfloat16,
                  context_len: int = DEFAULT_CONTEXT_LEN) -> EngineShapes:
    """`model`: None or "default" (the default model), a planner preset name (e.g. llama-3.1-8b),
    a config.json, an HF directory or a .gguf file. Engine limits come from `args`, as the engine
    takes them; dtype is what "auto" picks on the GPU (bfloat16 on sm_80 and later)."""
    name, config = _hf_config(model)
    arch = ArchConfig.from_hf(config)
    max_len = args.max_model_len or arch.max_position_embeddings
    if context_len < 1:
        raise ValueError("context_len must be >= 1")
    useful = -(-max_len // args.block_size) * args.max_num_seqs
    cache = CacheConfig(args.block_size, args.kv_cache_memory_gb, args.num_kv_blocks)
    return EngineShapes(
        model=name, arch=arch, dtype=dtype, block_size=args.block_size, max_model_len=max_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=num_kv_blocks(cache, arch.kv_layout.block_bytes(args.block_size, dtype.itemsize), useful), context_len=context_len,
    )


def _hf_config(model: str | None) -> tuple[str, dict]:
    from kvflow.model.default_model import default_model_path
    from kvflow.model.loader.resolve import load_checkpoint

    if model is None or model.strip().lower() == "default":
        path = default_model_path()
        return path.stem, load_checkpoint(str(path), load_tokenizer=False, load_weights=False).hf_config
    if model.strip().lower() in PRESETS:
        spec = PRESETS[model.strip().lower()]
        return spec.name, _preset_config(spec)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".json":
        return path.parent.name, json.loads(path.read_text())
    if not path.exists():
        raise ValueError(f"--model {model!r} is neither a path nor a preset ({', '.join(PRESETS)})")
    return path.stem, load_checkpoint(str(path), load_tokenizer=False, load_weights=False).hf_config


def _preset_config(spec: ModelSpec) -> dict:
    """A planner preset as the config.json of a Llama-family model."""
    if spec.mla is not None or spec.moe is not None:
        raise ValueError(f"--model {spec.name}: kvflow has no kernels for MLA or MoE layers yet")
    config = {
        "architectures": ["MistralForCausalLM" if spec.sliding_window else "LlamaForCausalLM"],
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "vocab_size": spec.vocab_size,
        "attention_bias": spec.qkv_bias, "max_position_embeddings": PRESET_MAX_MODEL_LEN,
    }
    if spec.sliding_window:
        config["sliding_window"] = spec.sliding_window
    return config
