"""The architecture of a decoder-only transformer, read from an HF config.json dict.

This is the one parser: the engine builds models from it, the worker sizes the KV pool from its
`kv_cache_specs()`, and the planner (`kvflow plan`) turns it into its `ModelSpec`. Values a
family's config.json may leave out (Gemma 3's layer pattern and local RoPE base, which its GGUF
does not carry either) come from `FAMILY_DEFAULTS`, the defaults of that architecture's HF config.
Torch-free, so the planner can read it without loading torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType

from kvflow.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheSpec,
    KVLayout,
    MambaStateSpec,
    MLAAttentionSpec,
    RecurrentStateSpec,
    SharedKVSpec,
    ShortConvStateSpec,
    SlidingWindowSpec,
    kv_layout,
)

# model_type → config fields its HF config class fills in when config.json omits them.
FAMILY_DEFAULTS: Mapping[str, Mapping] = MappingProxyType({
    "gemma3_text": MappingProxyType(dict(  # Gemma3TextConfig's defaults
        vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072,
        rms_norm_eps=1e-6, sliding_window=4096, sliding_window_pattern=6, rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0, query_pre_attn_scalar=256, tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh")),
    "mixtral": MappingProxyType(dict(norm_topk_prob=True)),  # Mixtral always renormalises its top-k
    "deepseek_v2": MappingProxyType(dict(scoring_func="softmax", topk_method="greedy")),
    "deepseek_v3": MappingProxyType(dict(scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True)),
    "mamba2": MappingProxyType(dict(  # Mamba2Config's defaults
        head_dim=64, state_size=128, n_groups=8, conv_kernel=4, chunk_size=256, expand=2, layer_norm_epsilon=1e-5,
        use_bias=False, use_conv_bias=True, hidden_act="silu", time_step_limit=(0.0, math.inf))),
    "bamba": MappingProxyType(dict(  # BambaConfig's defaults for what its mixers read
        mamba_n_heads=128, mamba_d_head="auto", mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False, hidden_act="silu", rms_norm_eps=1e-5,
        time_step_limit=(0.0, math.inf), max_position_embeddings=262_144, attn_layer_indices=())),
    "lfm2": MappingProxyType(dict(  # Lfm2Config's defaults
        vocab_size=65_536, hidden_size=2560, intermediate_size=12_288, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=128_000, norm_eps=1e-5, rope_theta=1_000_000.0,
        tie_word_embeddings=True, conv_bias=False, conv_L_cache=3, block_multiple_of=256,
        block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True)),
})
# A state-space model has no positions: its state is one size however long the request. The engine
# still bounds a request (prompt + max_tokens) by max_model_len, this by default.
STATE_MODEL_CONTEXT = 1 << 20


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3)."""

    q_lora_rank: int | None  # None: q is one projection of the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the checkpoint's RoPE dims are (x0, x1), (x2, x3), ... pairs


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    renormalize: bool  # top-k weights rescaled to sum to 1
    scoring: str  # "softmax" | "sigmoid"
    topk_method: str  # "greedy" | "group_limited_greedy" | "noaux_tc"
    routed_scaling_factor: float
    num_groups: int  # expert groups for group-limited routing (1: none)
    topk_groups: int
    num_shared_experts: int  # always-on experts of expert_intermediate_size each
    dense_layers: tuple[int, ...]  # layers that keep a dense MLP


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2)
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    num_kv_shared_layers: int = 0  # the last n layers read an earlier layer's KV (cross-layer sharing)
    recurrent_state: RecurrentStateSpec | None = None  # a state layer's state (Mamba-2, LFM2's short convolutions)
    # With a recurrent state, the layers that attend instead (a hybrid: Bamba, LFM2); the others keep the state.
    attention_layers: tuple[int, ...] = ()
    # The engine's context when a model is built for one (`worker.rank_model`): the length that
    # longrope and dynamic RoPE scale for (`kvflow.model.layers.rotary`). None: max_position_embeddings.
    max_model_len: int | None = field(default=None, compare=False)
    # The config dict with the family's defaults: where a family file reads its own knobs.
    hf: Mapping = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(cls, config: Mapping) -> ArchConfig:
        if config.get("model_type") == "idefics3":  # the language model's shape; `hf` keeps the vision tower's
            text = {**(config.get("text_config") or {}), "architectures": config.get("architectures"),
                    "tie_word_embeddings": bool(config.get("tie_word_embeddings", False))}
            return replace(cls.from_hf(text), hf=MappingProxyType(dict(config)))
        cfg = _with_defaults(config)
        arch = (cfg.get("architectures") or [""])[0]  # "": the planner may read such a config, the engine not
        if cfg.get("model_type") == "mamba2":
            return cls._from_mamba2(cfg, arch)
        if cfg.get("model_type") == "bamba":
            return cls._from_bamba(cfg)
        if cfg.get("model_type") == "lfm2":
            return cls._from_lfm2(cfg)
        heads = _get(cfg, "num_attention_heads")
        hidden = _get(cfg, "hidden_size")
        layers = _get(cfg, "num_hidden_layers")
        eos = cfg.get("eos_token_id")
        shared = int(cfg.get("num_kv_shared_layers") or 0)
        scaling = _rope_scaling(cfg)
        if not 0 <= shared < layers:
            raise ValueError(f"num_kv_shared_layers must be in [0, num_hidden_layers); got {shared}")
        return cls(
            architecture=arch,
            model_type=str(cfg.get("model_type", "")),
            vocab_size=_get(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_get(cfg, "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            rope_scaling=scaling,
            max_position_embeddings=_context_length(cfg, scaling),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", cfg.get("model_type") in ("qwen2", "qwen2_moe")),
            sliding_windows=_sliding_windows(cfg, arch, layers),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_ids(eos),
            mla=_mla(cfg),
            moe=_moe(cfg, layers),
            num_kv_shared_layers=shared,
            hf=MappingProxyType(cfg),
        )

    @classmethod
    def _from_mamba2(cls, cfg: Mapping, arch: str) -> ArchConfig:
        """Mamba-2: no attention; each layer keeps a state (the sizes kvflow.model.layers.mamba2_mixer
        reads from the same dict)."""
        spec = mamba_state_spec(cfg)
        heads, head_dim = spec.num_heads, spec.head_dim
        inner = heads * head_dim
        layers = int(_get(cfg, "num_hidden_layers"))
        return cls(architecture=arch, model_type="mamba2", vocab_size=_get(cfg, "vocab_size"),
                   hidden_size=_get(cfg, "hidden_size"), intermediate_size=inner, num_layers=layers, num_heads=heads,
                   num_kv_heads=heads, head_dim=head_dim, rms_norm_eps=cfg["layer_norm_epsilon"], rope_theta=0.0,
                   rope_scaling=None, max_position_embeddings=STATE_MODEL_CONTEXT,
                   tie_word_embeddings=cfg.get("tie_word_embeddings", False), attention_bias=False,
                   sliding_windows=(None,) * layers, bos_token_id=cfg.get("bos_token_id"),
                   eos_token_ids=_eos_ids(cfg.get("eos_token_id")), recurrent_state=spec, hf=MappingProxyType(cfg))

    @classmethod
    def _from_bamba(cls, cfg: Mapping) -> ArchConfig:
        """Bamba: a Llama decoder whose layers but `attn_layer_indices` run a Mamba-2 mixer instead of
        attention (the mixer reads `bamba_mixer_config`, Mamba-2's names for its fields)."""
        layers = int(_get(cfg, "num_hidden_layers"))
        attention = tuple(sorted(int(i) for i in cfg["attn_layer_indices"] or ()))
        if any(not 0 <= i < layers for i in attention):
            raise ValueError(f"attn_layer_indices must lie in [0, num_hidden_layers={layers}); got {list(attention)}")
        plain = cls.from_hf({k: v for k, v in cfg.items() if k != "model_type"})
        return replace(plain, model_type="bamba", recurrent_state=mamba_state_spec(bamba_mixer_config(cfg)),
                       attention_layers=attention, hf=MappingProxyType(cfg))

    @classmethod
    def _from_lfm2(cls, cfg: Mapping) -> ArchConfig:
        """LFM2: a decoder whose layers attend where `layer_types` says "full_attention" (older
        configs name them in `full_attn_idxs`, every layer by default) and run a gated
        short convolution elsewhere; its knobs under Llama's names (norm_eps, the MLP's size from
        the block_* fields, the older tie_embedding and block_ff_dim)."""
        layers = int(_get(cfg, "num_hidden_layers"))
        types = cfg.get("layer_types")
        if types is None:
            full = cfg.get("full_attn_idxs")
            types = ["full_attention" if full is None or i in full else "conv" for i in range(layers)]
        if len(types) != layers:
            raise ValueError(f"layer_types names {len(types)} layers; num_hidden_layers is {layers}")
        if unknown := sorted(set(types) - {"conv", "full_attention"}):
            raise ValueError(f"layer_types may hold 'conv' and 'full_attention' only; got {unknown}")
        attention = tuple(i for i, kind in enumerate(types) if kind == "full_attention")
        renamed = {**cfg, "rms_norm_eps": cfg["norm_eps"], "intermediate_size": lfm2_mlp_size(cfg),
                   "tie_word_embeddings": cfg.get("tie_embedding", cfg["tie_word_embeddings"])}
        plain = cls.from_hf({k: v for k, v in renamed.items() if k not in ("model_type", "layer_types")})
        kernel = int(cfg["conv_L_cache"])
        if kernel < 2:
            raise ValueError(f"conv_L_cache must be at least 2 (a convolution over past inputs); got {kernel}")
        return replace(plain, model_type="lfm2", recurrent_state=ShortConvStateSpec(plain.hidden_size, kernel),
                       attention_layers=attention, hf=MappingProxyType(cfg))

    @property
    def rope_serve_len(self) -> int:
        return self.max_model_len or self.max_position_embeddings

    @cached_property
    def kv_layout(self) -> KVLayout:
        """The KV groups and each layer's place in the pool."""
        return kv_layout(self.kv_cache_specs())

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """What each layer keeps in the KV cache. With `num_kv_shared_layers` = n the last n
        layers read the KV of the last earlier layer of the same kind (Gemma 3n's rule)."""
        if self.recurrent_state is not None:
            attention = FullAttentionSpec(self.num_kv_heads, self.head_dim)
            return [attention if i in self.attention_layers else self.recurrent_state for i in range(self.num_layers)]
        if self.mla is not None:
            specs: list[KVCacheSpec] = [MLAAttentionSpec(self.mla.kv_lora_rank, self.mla.qk_rope_head_dim)] * self.num_layers
        else:
            specs = [FullAttentionSpec(self.num_kv_heads, self.head_dim) if w is None
                     else SlidingWindowSpec(self.num_kv_heads, self.head_dim, w) for w in self.sliding_windows]
        first_shared = self.num_layers - self.num_kv_shared_layers
        for i in range(first_shared, self.num_layers):
            same_kind = [j for j in range(first_shared) if specs[j] == specs[i]]
            if not same_kind:
                raise ValueError(f"layer {i} shares KV, but no earlier layer has its kind of attention")
            specs[i] = SharedKVSpec(same_kind[-1])
        return specs


def mamba_state_spec(cfg: Mapping) -> MambaStateSpec:
    """A Mamba-2 mixer's state, from its fields under Mamba-2's names (a config with its defaults)."""
    heads, head_dim, state = int(_get(cfg, "num_heads")), int(cfg["head_dim"]), int(cfg["state_size"])
    conv_dim = heads * head_dim + 2 * int(cfg["n_groups"]) * state
    return MambaStateSpec(conv_dim, int(cfg["conv_kernel"]), heads, head_dim, state)


def lfm2_mlp_size(cfg: Mapping) -> int:
    """LFM2's MLP width as Lfm2MLP derives it: intermediate_size (or the older block_ff_dim), cut to
    2/3 when block_auto_adjust_ff_dim, then scaled by block_ffn_dim_multiplier and rounded up to
    a multiple of block_multiple_of."""
    size = int(cfg.get("block_ff_dim", _get(cfg, "intermediate_size")))
    if not cfg["block_auto_adjust_ff_dim"]:
        return size
    size = int(2 * size / 3)
    size, multiple = int(cfg["block_ffn_dim_multiplier"] * size), int(cfg["block_multiple_of"])
    if multiple < 1:
        raise ValueError(f"block_multiple_of must be at least 1; got {multiple}")
    return multiple * -(-size // multiple)


def bamba_mixer_config(cfg: Mapping) -> dict:
    """A Bamba config's mixer fields under Mamba-2's names (what MixerConfig.from_hf reads); `mamba_d_head`
    "auto" is expand x hidden_size / heads, as BambaConfig resolves it."""
    hidden, heads, expand = int(_get(cfg, "hidden_size")), int(cfg["mamba_n_heads"]), int(cfg["mamba_expand"])
    head_dim = cfg["mamba_d_head"]
    return dict(hidden_size=hidden, num_heads=heads, head_dim=expand * hidden // heads if head_dim == "auto" else int(head_dim),
                state_size=cfg["mamba_d_state"], n_groups=cfg["mamba_n_groups"], conv_kernel=cfg["mamba_d_conv"],
                chunk_size=cfg["mamba_chunk_size"], expand=expand, layer_norm_epsilon=cfg["rms_norm_eps"],
                use_bias=cfg["mamba_proj_bias"], use_conv_bias=cfg["mamba_conv_bias"], hidden_act=cfg["hidden_act"],
                time_step_limit=cfg["time_step_limit"])


def _with_defaults(config: Mapping) -> dict:
    """A multimodal wrapper's text_config merged over its top level, then the family's defaults
    under what the file says."""
    cfg = {**config, **(config.get("text_config") or {})}
    model_type = str(cfg.get("model_type", ""))
    defaults = FAMILY_DEFAULTS.get("gemma3_text" if model_type == "gemma3" else model_type, {})
    return {**defaults, **{k: v for k, v in cfg.items() if v is not None}}


def _eos_ids(eos) -> tuple[int, ...]:
    return tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])


def _get(cfg: Mapping, key: str):
    if key not in cfg:
        raise ValueError(f"config.json is missing {key!r}")
    return cfg[key]


def _rope_params(cfg: Mapping) -> dict:
    # transformers 5 folds rope_theta into "rope_parameters"; Gemma 3 keeps one set per layer type.
    params = cfg.get("rope_parameters") or {}
    return params.get("full_attention", params)


def _rope_theta(cfg: Mapping) -> float:
    return float(_rope_params(cfg).get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _rope_scaling(cfg: Mapping) -> dict | None:
    """The scaling with the lengths it reads resolved as HF resolves them; None for plain RoPE."""
    scaling = cfg.get("rope_scaling") or _rope_params(cfg)
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return None
    scaling = {**scaling, "rope_type": kind}
    max_len = cfg.get("max_position_embeddings", 2048)
    if kind in ("llama3", "yarn", "longrope"):
        # Phi-3 keeps the pretraining length at the top level, and there it wins (as in HF).
        original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = int(original or max_len)
        if scaling.get("factor") is None:  # the stretch the two lengths imply
            scaling["factor"] = max_len / scaling["original_max_position_embeddings"]
    if kind == "dynamic":  # NTK scales from the checkpoint's own context, the one it declares
        scaling["original_max_position_embeddings"] = int(max_len)
    return scaling


def _context_length(cfg: Mapping, scaling: dict | None) -> int:
    """The positions the model serves: yarn's stretched context (original x factor) and dynamic
    NTK's (max_position_embeddings x factor) where longer than the declared one, as vLLM derives it."""
    max_len = int(cfg.get("max_position_embeddings", 2048))
    if scaling is not None and scaling["rope_type"] in ("yarn", "dynamic"):
        return max(max_len, int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    return max_len


def _sliding_windows(cfg: Mapping, arch: str, n: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if cfg.get("layer_types"):
        return tuple(window if t == "sliding_attention" else None for t in cfg["layer_types"])
    if window is None or arch == "LlamaForCausalLM":
        return (None,) * n
    if pattern := cfg.get("sliding_window_pattern"):  # Gemma 3: every pattern-th layer is global
        return tuple(None if (i + 1) % pattern == 0 else window for i in range(n))
    if "use_sliding_window" not in cfg:  # Mistral: every layer
        return (window,) * n
    if not cfg["use_sliding_window"]:
        return (None,) * n
    first = cfg.get("max_window_layers", 28)  # Qwen2: layers below it stay global (HF's default, 28)
    return tuple(window if i >= first else None for i in range(n))


def _mla(cfg: Mapping) -> MLAConfig | None:
    if not cfg.get("kv_lora_rank"):
        return None
    return MLAConfig(
        q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(_get(cfg, "qk_nope_head_dim")),
        qk_rope_head_dim=int(_get(cfg, "qk_rope_head_dim")),
        v_head_dim=int(_get(cfg, "v_head_dim")),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )


def _moe(cfg: Mapping, n: int) -> MoEConfig | None:
    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts")
    if not experts:
        return None
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    every = int(cfg.get("moe_layer_freq") or cfg.get("decoder_sparse_step") or 1)
    only_mlp = set(cfg.get("mlp_only_layers") or ())
    if "decoder_sparse_step" in cfg:  # Qwen-MoE counts from 1
        dense = tuple(i for i in range(n) if i in only_mlp or (i + 1) % every != 0)
    else:  # DeepSeek: the first k layers, then all but every moe_layer_freq-th
        dense = tuple(i for i in range(n) if i < first_dense or i % every != 0)
    return MoEConfig(
        num_experts=int(experts),
        experts_per_token=int(_get(cfg, "num_experts_per_tok")),
        expert_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        renormalize=bool(cfg.get("norm_topk_prob", False)),
        scoring=str(cfg.get("scoring_func", "softmax")),
        topk_method=str(cfg.get("topk_method", "greedy")),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        num_groups=int(cfg.get("n_group") or 1),
        topk_groups=int(cfg.get("topk_group") or 1),
        num_shared_experts=int(cfg.get("n_shared_experts") or 0),
        dense_layers=dense,
    )
