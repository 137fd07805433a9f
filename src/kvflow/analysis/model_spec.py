"""The shape of a decoder-only transformer, and what that shape costs in bytes and FLOPs.

Everything here is closed-form arithmetic on config values; nothing is loaded or run.
Conventions follow the lecture notes in the seeds (CS336 Lec. 10 and the AAAI'26 tutorial):
weights and KV are counted in plain bytes, a matmul of a [1, P] vector by a [P, Q] matrix
costs 2·P·Q FLOPs, and "GB" means 10^9 bytes unless a caller says otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvflow.kv_cache_spec import (
    STATE_BYTES,
    FullAttentionSpec,
    KVCacheSpec,
    MambaStateSpec,
    MLAAttentionSpec,
    RecurrentStateSpec,
    SharedKVSpec,
    ShortConvStateSpec,
    SlidingWindowSpec,
    kv_bytes_per_token,
    token_bytes,
)
from kvflow.model.arch_config import ArchConfig

# Bits per element of each storage dtype the planner understands.
DTYPE_BITS: Mapping[str, int] = MappingProxyType(
    {"float32": 32, "bfloat16": 16, "float16": 16, "float8": 8, "int8": 8, "int4": 4}
)
_DTYPE_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "fp32": "float32",
        "bf16": "bfloat16",
        "fp16": "float16",
        "half": "float16",
        "fp8": "float8",
        "float8_e4m3fn": "float8",
        "float8_e5m2": "float8",
    }
)


def canonical_dtype(dtype: str) -> str:
    name = dtype.lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BITS:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BITS)}")
    return name


def dtype_bits(dtype_or_bits: str | int) -> int:
    """Bits per element; an int is taken to already be a bit width (e.g. 4 for int4)."""
    if isinstance(dtype_or_bits, int):
        if dtype_or_bits <= 0:
            raise ValueError(f"bit width must be positive, got {dtype_or_bits}")
        return dtype_or_bits
    return DTYPE_BITS[canonical_dtype(dtype_or_bits)]


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2): the cache holds one shared latent per token."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None


@dataclass(frozen=True)
class MoESpec:
    """Routed experts replacing the dense MLP, optionally with always-on shared experts."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP (DeepSeek: the first k)


def mixer_params(state: RecurrentStateSpec, hidden: int, conv_bias: bool = False) -> int:
    """A Mamba-2 mixer's parameters: in_proj (z, x, B, C, dt), the depthwise convolution and its
    bias, A, D and dt's bias, the gated norm, out_proj. A short convolution's: in_proj (B, C, x),
    the convolution, out_proj, each with a bias where `conv_bias`."""
    if isinstance(state, ShortConvStateSpec):
        channels = state.conv_dim
        weights = 3 * hidden * channels + channels * state.conv_kernel + channels * hidden
        return weights + (5 * channels if conv_bias else 0)  # in_proj's 3, the convolution's, out_proj's
    inner = state.num_heads * state.head_dim
    in_proj = hidden * (inner + state.conv_dim + state.num_heads)
    return in_proj + state.conv_dim * (state.conv_kernel + 1) + 3 * state.num_heads + inner + inner * hidden


def scan_flops_per_token(state: RecurrentStateSpec) -> int:
    """The recurrence per token and layer: decay and input into the state, the state read by C; a
    short convolution's kernel over each channel and its two gates (B·x before it, C after)."""
    if isinstance(state, ShortConvStateSpec):
        return 2 * state.conv_dim * state.conv_kernel + 2 * state.conv_dim
    return 6 * state.num_heads * state.head_dim * state.state_size


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False
    gated_mlp: bool = True
    qkv_bias: bool = False
    # With a window, every layer is local except those listed in global_layers.
    sliding_window: int | None = None
    global_layers: tuple[int, ...] = ()
    mla: MLASpec | None = None
    moe: MoESpec | None = None
    kv_sharing: tuple[tuple[int, int], ...] = ()  # (layer, the earlier layer whose KV it reads)
    # A state-space model (Mamba-2): no attention, no MLP, no KV; or a hybrid's state layers' state.
    ssm: RecurrentStateSpec | None = None
    # With `ssm`, the layers that attend instead of mixing (a hybrid, Bamba, LFM2: every layer has the MLP).
    attention_layers: tuple[int, ...] = ()
    conv_bias: bool = False  # LFM2's short convolutions and their projections carry biases
    qk_norm: bool = False  # an RMSNorm over each head of q and k in every attention layer (LFM2's counted)

    # ---- shape ----------------------------------------------------------------------------

    @property
    def hybrid(self) -> bool:
        return self.ssm is not None and bool(self.attention_layers)

    @property
    def mixers_only(self) -> bool:
        """A Mamba-2 stack: each layer a mixer under one norm, no MLP (a hybrid's layers, and every
        LFM2 layer, have an MLP and two norms)."""
        return isinstance(self.ssm, MambaStateSpec) and not self.attention_layers

    def is_mixer_layer(self, layer: int) -> bool:
        """Does the layer keep a recurrent state rather than attend?"""
        return self.ssm is not None and layer not in self.attention_layers

    @property
    def attention_kind(self) -> str:
        if self.ssm is not None and not self.hybrid:
            return "no"
        if self.mla is not None:
            return "mla"
        if self.num_kv_heads == 1 and self.num_heads > 1:
            return "mqa"
        return "mha" if self.num_kv_heads == self.num_heads else "gqa"

    @property
    def kv_lora_rank(self) -> int | None:
        return self.mla.kv_lora_rank if self.mla else None

    @property
    def qk_rope_head_dim(self) -> int | None:
        return self.mla.qk_rope_head_dim if self.mla else None

    @property
    def num_experts(self) -> int:
        return self.moe.num_experts if self.moe else 0

    @property
    def experts_per_token(self) -> int:
        return self.moe.experts_per_token if self.moe else 0

    def is_local_layer(self, layer: int) -> bool:
        return self.sliding_window is not None and layer not in self.global_layers

    def _is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    # ---- parameters -----------------------------------------------------------------------

    def _attn_params(self, layer: int) -> int:
        """Linear weights of one layer's attention block (norms excluded), or of its mixer."""
        d, n = self.hidden_size, self.num_heads
        if self.is_mixer_layer(layer):
            return mixer_params(self.ssm, d, self.conv_bias)
        if self.mla is None:
            kv = 2 * d * self.num_kv_heads * self.head_dim
            bias = (n + 2 * self.num_kv_heads) * self.head_dim if self.qkv_bias else 0
            return 2 * d * n * self.head_dim + kv + bias
        m = self.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            q = d * m.q_lora_rank + m.q_lora_rank * n * qk
        else:
            q = d * n * qk
        kv = d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * n * (
            m.qk_nope_head_dim + m.v_head_dim
        )
        return q + kv + n * m.v_head_dim * d

    def _mlp_params(self, intermediate: int) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden_size * intermediate

    def _ffn_params(self, layer: int, active: bool) -> int:
        """MLP weights of one layer; `active` counts only what a single token runs through."""
        if self.mixers_only:
            return 0
        if not self._is_moe_layer(layer):
            return self._mlp_params(self.intermediate_size)
        assert self.moe is not None
        routed = self.moe.experts_per_token if active else self.moe.num_experts
        experts = routed + self.moe.num_shared_experts
        router = self.hidden_size * self.moe.num_experts
        return experts * self._mlp_params(self.moe.expert_intermediate_size) + router

    def _norm_params(self) -> int:
        # Two RMSNorm vectors per layer plus the final one (MLA adds its two latent norms).
        # Extra norms some families carry (Gemma's four, Qwen3's q/k norms) are <0.01% and left
        # out; LFM2's q/k norms are counted (`qk_norm`), so its count is transformers' exactly.
        per_layer = (1 if self.mixers_only else 2) * self.hidden_size
        if self.mla is not None:
            per_layer += self.mla.kv_lora_rank + (self.mla.q_lora_rank or 0)
        attending = sum(not self.is_mixer_layer(i) for i in range(self.num_layers))
        qk_norms = attending * 2 * self.head_dim if self.qk_norm else 0
        return self.num_layers * per_layer + qk_norms + self.hidden_size

    def embedding_params(self) -> int:
        """Input embedding plus the LM head (once when they are tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    def _layer_params(self, active: bool) -> int:
        return sum(self._attn_params(i) + self._ffn_params(i, active) for i in range(self.num_layers))

    def param_count(self) -> int:
        return self._layer_params(active=False) + self.embedding_params() + self._norm_params()

    def active_param_count(self) -> int:
        """Parameters one token touches (differs from param_count only for MoE)."""
        return self._layer_params(active=True) + self.embedding_params() + self._norm_params()

    def weight_bytes(self, dtype_or_bits: str | int = "bfloat16") -> int:
        # Seed convention: every parameter at the same width (memory factor 0.5x for int8,
        # 0.25x for int4); per-group scales of real int4 formats are left out.
        return self.param_count() * dtype_bits(dtype_or_bits) // 8

    def expected_experts_touched(self, batch_size: int) -> float:
        """Distinct routed experts a decode step of `batch_size` tokens reads (uniform routing)."""
        if self.moe is None:
            return 0.0
        e, k = self.moe.num_experts, self.moe.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** batch_size)

    def decode_weight_bytes(self, batch_size: int, dtype_or_bits: str | int = "bfloat16") -> int:
        """Weight bytes one decode step must read: all of them, minus experts nobody routed to."""
        total = self.weight_bytes(dtype_or_bits)
        if self.moe is None:
            return total
        moe_layers = sum(self._is_moe_layer(i) for i in range(self.num_layers))
        expert_params = self._mlp_params(self.moe.expert_intermediate_size)
        idle = self.moe.num_experts - self.expected_experts_touched(batch_size)
        return int(total - moe_layers * idle * expert_params * dtype_bits(dtype_or_bits) / 8)

    # ---- KV cache -------------------------------------------------------------------------

    def layer_kv_specs(self) -> list[KVCacheSpec]:
        """What each layer caches, in the engine's terms (kvflow.kv_cache_spec)."""
        if self.ssm is not None:
            attention = FullAttentionSpec(self.num_kv_heads, self.head_dim)
            return [self.ssm if self.is_mixer_layer(i) else attention for i in range(self.num_layers)]
        if self.mla is not None:
            specs: list[KVCacheSpec] = [MLAAttentionSpec(self.mla.kv_lora_rank, self.mla.qk_rope_head_dim)] * self.num_layers
        else:
            specs = [SlidingWindowSpec(self.num_kv_heads, self.head_dim, self.sliding_window) if self.is_local_layer(i)
                     else FullAttentionSpec(self.num_kv_heads, self.head_dim) for i in range(self.num_layers)]
        for layer, target in self.kv_sharing:
            specs[layer] = SharedKVSpec(target)
        return specs

    def kv_elements_per_token_per_layer(self) -> int:
        """Cached numbers per token in a layer that keeps KV: K and V of each KV head, or MLA's
        one latent plus its RoPE key."""
        return next(s.elements_per_token for s in self.layer_kv_specs() if not isinstance(s, SharedKVSpec))

    def kv_bytes_per_token(self, kv_dtype: str | int = "bfloat16", kv_cache_dtype: str = "auto") -> int:
        """KV bytes one token adds across all layers, before any sliding-window cap (the same
        function sizes the engine's pool). `kv_cache_dtype` fp8/int8: one byte per number plus
        the scales, whatever `kv_dtype` is."""
        return int(kv_bytes_per_token(self.layer_kv_specs(), dtype_bits(kv_dtype) / 8, kv_cache_dtype))

    def attended_tokens(self, context_len: int) -> int:
        """Sum over layers of the positions a new token sees (window-capped on local layers)."""
        w = self.sliding_window
        return sum(
            min(context_len, w) if w is not None and self.is_local_layer(i) else context_len
            for i in range(self.num_layers) if not self.is_mixer_layer(i)
        )

    def kv_bytes_for_context(self, context_len: int, kv_dtype: str | int = "bfloat16", kv_cache_dtype: str = "auto") -> int:
        """KV bytes one request holds at `context_len` tokens (local layers keep only W, layers
        that share another's KV keep none, a mixer layer its state of one size, whatever the context)."""
        per_number = dtype_bits(kv_dtype) / 8
        return self.state_bytes_per_request() + int(sum(
            token_bytes(s, per_number, kv_cache_dtype)
            * (context_len if s.sliding_window is None else min(context_len, s.sliding_window))
            for s in self.layer_kv_specs()))

    def state_bytes_per_request(self) -> int:
        """The mixer layers' states one request holds (float32), whatever its length."""
        return sum(self.ssm.state_elements * STATE_BYTES for i in range(self.num_layers) if self.is_mixer_layer(i))

    def attention_twin(self) -> ModelSpec:
        """The same model with attention in every layer (a hybrid's heads; a Mamba-2's hidden size
        in heads of 64, K and V of every channel), the MLP in every layer: what a state is weighed
        against."""
        if self.ssm is None or self.hybrid:
            return replace(self, ssm=None, attention_layers=())
        heads = self.hidden_size // 64
        return replace(self, ssm=None, num_heads=heads, num_kv_heads=heads, head_dim=64)

    def state_crossover_tokens(self, kv_dtype: str | int = "bfloat16", kv_cache_dtype: str = "auto") -> int | None:
        """The shortest context at which a request of this model holds less memory than one of its
        `attention_twin`: the states over the KV per token the mixers spare; None without a state."""
        if self.ssm is None:
            return None
        spared = (self.attention_twin().kv_bytes_per_token(kv_dtype, kv_cache_dtype)
                  - self.kv_bytes_per_token(kv_dtype, kv_cache_dtype))
        return self.state_bytes_per_request() // spared + 1

    # ---- FLOPs ----------------------------------------------------------------------------

    def _attn_dims(self) -> tuple[int, int]:
        """(query·key dim, value dim) per head, which set attention-score and mixing FLOPs."""
        if self.mla is not None:
            return self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim, self.mla.v_head_dim
        return self.head_dim, self.head_dim

    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def flops_per_token(self, context_len: int = 0) -> float:
        """Forward FLOPs to decode one token that attends to `context_len` cached positions.

        2 per matmul weight a token passes through (the embedding lookup is not a matmul,
        the LM head is), plus QK^T and attention·V over the positions each layer sees.
        """
        qk, v = self._attn_dims()
        matmul = self._layer_params(active=True) + self.lm_head_params()
        attention = 2 * self.num_heads * (qk + v) * self.attended_tokens(context_len)
        return 2.0 * matmul + attention + self._scan_flops(1)

    def prefill_flops(self, num_tokens: int) -> float:
        """Forward FLOPs of a causal prefill of `num_tokens`; logits only for the last one."""
        qk, v = self._attn_dims()
        matmul = 2.0 * self._layer_params(active=True) * num_tokens + 2.0 * self.lm_head_params()
        pairs = sum(self._causal_pairs(num_tokens, i) for i in range(self.num_layers) if not self.is_mixer_layer(i))
        if self.ssm is not None:
            return matmul + self._scan_flops(num_tokens) + 2.0 * self.num_heads * (qk + v) * pairs
        return matmul + 2.0 * self.num_heads * (qk + v) * pairs

    def _scan_flops(self, num_tokens: int) -> float:
        """A state-space model's recurrences over `num_tokens` (the chunked form's extra
        within-chunk products are left out: the closed form counts the recurrence)."""
        mixers = sum(self.is_mixer_layer(i) for i in range(self.num_layers))
        return 0.0 if self.ssm is None else float(mixers * scan_flops_per_token(self.ssm) * num_tokens)

    def _causal_pairs(self, num_tokens: int, layer: int) -> int:
        """Query-key pairs a causal (optionally windowed) layer scores: sum_i min(i, W)."""
        w = self.sliding_window if self.is_local_layer(layer) else None
        if w is None or num_tokens <= w:
            return num_tokens * (num_tokens + 1) // 2
        return w * (w + 1) // 2 + (num_tokens - w) * w

    # ---- construction ---------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], name: str | None = None) -> ModelSpec:
        """A config.json dict, read by the engine's own parser (ArchConfig)."""
        spec = cls.from_arch(ArchConfig.from_hf(config))
        return replace(spec, name=name or str(config.get("_name_or_path") or spec.name))

    @classmethod
    def from_arch(cls, arch: ArchConfig) -> ModelSpec:
        """The shape the engine runs (`LLMEngine.arch`), as the planner's closed forms see it:
        per-layer windows become one window plus the list of full-attention layers."""
        windows = [w for w in arch.sliding_windows if w is not None]
        mla = moe = None
        head_dim = arch.head_dim
        if (m := arch.mla) is not None:
            mla = MLASpec(m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim, m.q_lora_rank)
            head_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        if (e := arch.moe) is not None:
            moe = MoESpec(e.num_experts, e.experts_per_token, e.expert_intermediate_size, e.num_shared_experts,
                          e.dense_layers)
        kv_specs = arch.kv_cache_specs()
        return cls(
            name=arch.model_type or arch.architecture or "custom",
            num_layers=arch.num_layers,
            hidden_size=arch.hidden_size,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=head_dim,
            intermediate_size=arch.intermediate_size,
            vocab_size=arch.vocab_size,
            tie_embeddings=arch.tie_word_embeddings,
            qkv_bias=arch.attention_bias,
            sliding_window=max(windows) if windows else None,
            global_layers=tuple(i for i, w in enumerate(arch.sliding_windows) if w is None) if windows else (),
            mla=mla,
            moe=moe,
            kv_sharing=tuple((i, s.target_layer) for i, s in enumerate(kv_specs) if isinstance(s, SharedKVSpec)),
            ssm=arch.recurrent_state,
            attention_layers=arch.attention_layers,
            conv_bias=arch.model_type == "lfm2" and bool(arch.hf.get("conv_bias")),
            qk_norm=arch.model_type == "lfm2",
        )


# ---- presets (values from each model's public config.json) -----------------------------------


def _llama_like(
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    inter: int,
    vocab: int,
    **extra: Any,
) -> ModelSpec:
    return ModelSpec(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=extra.pop("head_dim", hidden // heads),
        intermediate_size=inter,
        vocab_size=vocab,
        **extra,
    )


PRESETS: Mapping[str, ModelSpec] = MappingProxyType(
    {
        "smollm2-135m": _llama_like(
            "smollm2-135m", 30, 576, 9, 3, 1536, 49152, head_dim=64, tie_embeddings=True
        ),
        "llama-2-7b": _llama_like("llama-2-7b", 32, 4096, 32, 32, 11008, 32000),
        "llama-2-13b": _llama_like("llama-2-13b", 40, 5120, 40, 40, 13824, 32000),
        "llama-2-70b": _llama_like("llama-2-70b", 80, 8192, 64, 8, 28672, 32000),
        "llama-3.1-8b": _llama_like("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256),
        "llama-3.1-70b": _llama_like("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256),
        "llama-3.1-405b": _llama_like("llama-3.1-405b", 126, 16384, 128, 8, 53248, 128256),
        # Mistral-7B-v0.1: every layer uses the 4096-token sliding window.
        "mistral-7b": _llama_like("mistral-7b", 32, 4096, 32, 8, 14336, 32000, sliding_window=4096),
        # DeepSeek-V2: MLA, 160 routed experts (6 per token) + 2 shared, layer 0 dense.
        "deepseek-v2": ModelSpec(
            name="deepseek-v2",
            num_layers=60,
            hidden_size=5120,
            num_heads=128,
            num_kv_heads=128,
            head_dim=192,  # qk_nope_head_dim + qk_rope_head_dim
            intermediate_size=12288,
            vocab_size=102400,
            mla=MLASpec(
                kv_lora_rank=512,
                qk_rope_head_dim=64,
                qk_nope_head_dim=128,
                v_head_dim=128,
                q_lora_rank=1536,
            ),
            moe=MoESpec(
                num_experts=160,
                experts_per_token=6,
                expert_intermediate_size=1536,
                num_shared_experts=2,
                dense_layers=(0,),
            ),
        ),
    }
)
DEFAULT_MODEL = "smollm2-135m"


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset name ("default" = SmolLM2-135M), a config.json, or a directory holding one."""
    key = name_or_path.strip().lower()
    if key == "default":
        key = DEFAULT_MODEL
    if key in PRESETS:
        return PRESETS[key]
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"{name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json path"
        )
    spec = ModelSpec.from_hf_config(json.loads(path.read_text()))
    return replace(spec, name=path.parent.name or spec.name)
