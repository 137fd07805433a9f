"""The architecture of a decoder-only transformer, read from an HF config.json dict."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
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
    qk_norm: bool  # RMSNorm over each head of q and k before RoPE (Qwen3)
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, cfg: dict) -> ArchConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        arch = archs[0]
        heads = _get(cfg, "num_attention_heads")
        hidden = _get(cfg, "hidden_size")
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=_get(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_get(cfg, "intermediate_size"),
            num_layers=_get(cfg, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            rope_scaling=_rope_scaling(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_windows=_sliding_windows(cfg, arch),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )


def _get(cfg: dict, key: str):
    if key not in cfg:
        raise ValueError(f"config.json is missing {key!r}")
    return cfg[key]


def _rope_params(cfg: dict) -> dict:
    # transformers 5 folds rope_theta into "rope_parameters"; older configs keep them apart.
    return cfg.get("rope_parameters") or {}


def _rope_theta(cfg: dict) -> float:
    return float(_rope_params(cfg).get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _rope_scaling(cfg: dict) -> dict | None:
    scaling = cfg.get("rope_scaling") or _rope_params(cfg)
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    return None if kind == "default" else dict(scaling)


def _sliding_windows(cfg: dict, arch: str) -> tuple[int | None, ...]:
    n, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    if "layer_types" in cfg and cfg["layer_types"]:
        return tuple(window if t == "sliding_attention" else None for t in cfg["layer_types"])
    if window is None or arch == "LlamaForCausalLM":
        return (None,) * n
    if arch == "MistralForCausalLM":
        return (window,) * n
    if not cfg.get("use_sliding_window", False):
        return (None,) * n
    first = cfg.get("max_window_layers", n)
    return tuple(window if i >= first else None for i in range(n))
