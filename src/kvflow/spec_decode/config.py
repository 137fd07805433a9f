"""`speculative_config`: the dict (or JSON text, on the command line) that turns speculation on,
spelled as vLLM spells it: {"method": "ngram", "num_speculative_tokens": 4, ...}."""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.json_config import config_dict

METHODS = ("ngram", "draft_model", "layer_skip", "eagle", "eagle3")
# The methods whose drafter is a checkpoint of its own (`model`).
MODEL_METHODS = ("draft_model", "eagle", "eagle3")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" | "draft_model" | "layer_skip" | "eagle" | "eagle3"
    num_speculative_tokens: int  # k: the most tokens proposed per request and step
    prompt_lookup_min: int = 2  # ngram: shortest suffix to look up
    prompt_lookup_max: int = 4  # ngram: longest suffix to look up (tried first)
    # draft_model: a checkpoint sharing the target's tokenizer; eagle / eagle3: the head's checkpoint
    model: str | None = None
    num_draft_layers: int | None = None  # layer_skip: how many of the target's first layers propose
    # Speculate only while fewer requests run (None: decided by measured cost alone).
    disable_by_batch_size: int | None = None
    # Choose k per request and step from its recent acceptance and the measured costs; False:
    # always num_speculative_tokens (measurements of a fixed k).
    adaptive: bool = True

    @property
    def writes_kv(self) -> bool:
        """Its proposer runs a model, whose KV slots the scheduler must reserve."""
        return self.method != "ngram"

    @classmethod
    def parse(cls, value: dict | str | None) -> SpeculativeConfig | None:
        """From the user's dict or JSON text; a bad one raises ValueError naming the key."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = config_dict(value, "speculative_config", cls)
        if "method" not in value:
            raise ValueError(f"speculative_config needs 'method': one of {', '.join(METHODS)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs 'num_speculative_tokens' (k >= 1)")
        config = cls(**value)
        config._validate()
        return config

    def _validate(self) -> None:
        _require(self.method in METHODS, "method", f"one of {', '.join(METHODS)}", self.method)
        _require(_is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= 32,
                 "num_speculative_tokens", "an integer in [1, 32]", self.num_speculative_tokens)
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            _require(_is_int(getattr(self, name)) and getattr(self, name) >= 1, name, "an integer >= 1", getattr(self, name))
        _require(self.prompt_lookup_min <= self.prompt_lookup_max, "prompt_lookup_min",
                 f"<= prompt_lookup_max ({self.prompt_lookup_max})", self.prompt_lookup_min)
        _require((self.model is not None) == (self.method in MODEL_METHODS), "model",
                 f"a checkpoint path for methods {', '.join(MODEL_METHODS)}, and only for them", self.model)
        _require(self.model is None or (isinstance(self.model, str) and self.model), "model", "a path", self.model)
        _require((self.num_draft_layers is not None) == (self.method == "layer_skip"), "num_draft_layers",
                 "given for method layer_skip, and only for it", self.num_draft_layers)
        _require(self.num_draft_layers is None or (_is_int(self.num_draft_layers) and self.num_draft_layers >= 1),
                 "num_draft_layers", "an integer >= 1", self.num_draft_layers)
        _require(self.disable_by_batch_size is None or (_is_int(self.disable_by_batch_size) and self.disable_by_batch_size >= 1),
                 "disable_by_batch_size", "an integer >= 1", self.disable_by_batch_size)
        _require(isinstance(self.adaptive, bool), "adaptive", "true or false", self.adaptive)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"speculative_config: {name} must be {allowed}; got {value!r}")
