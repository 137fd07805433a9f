"""SamplingParams: how one request picks its tokens, with vLLM's names and defaults.

Every field is checked on construction; a bad value raises ValueError naming the field and the
allowed range, so bad input is refused before it reaches the engine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from kvflow.structured_output.params import StructuredOutputsParams

GREEDY_TEMPERATURE = 1e-5  # below this temperature, sampling is argmax
_INT64 = 2**63  # top_k and seed become int64 tensors and generator seeds


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all text so far
    DELTA = 1  # every output carries only what is new (streaming)
    FINAL_ONLY = 2  # one output when the request finishes (LLM.generate)


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # a JSON schema, regex, choice or grammar
    # token id → a number added to its logit before sampling (OpenAI's logit_bias: -100 bans the
    # token, +100 all but forces it); the logprobs reported are the model's, before it.
    logit_bias: dict[int, float] | None = None
    # A KV budget for this request (kvflow.core.kv_eviction); None: the engine's
    # kv_eviction_policy / kv_budget_tokens.
    kv_eviction_policy: str | None = None
    kv_budget_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def clone(self, **changes) -> SamplingParams:
        return replace(self, **changes)

    def _validate(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", "an integer >= 1 (or None)", self.max_tokens)
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "an integer >= 0", self.min_tokens)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               "min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        _check(_is_num(self.temperature) and 0.0 <= self.temperature <= 100.0,
               "temperature", "a number in [0, 100]", self.temperature)
        _check(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "a number in (0, 1]", self.top_p)
        _check(_is_int(self.top_k) and 0 <= self.top_k < _INT64, "top_k", "an integer in [1, 2^63), or 0 / -1 to disable",
               self.top_k)
        _check(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "a number in [0, 1]", self.min_p)
        _check(_is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 100.0,
               "repetition_penalty", "a number in (0, 100]", self.repetition_penalty)
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(_is_num(value) and -2.0 <= value <= 2.0, name, "a number in [-2, 2]", value)
        _check(self.seed is None or (_is_int(self.seed) and -_INT64 <= self.seed < _INT64),
               "seed", "an integer in [-2^63, 2^63) (or None)", self.seed)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "a list of non-empty strings", self.stop)
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "a list of token ids >= 0", self.stop_token_ids)
        for name in ("logprobs", "prompt_logprobs"):  # the upper bound is the engine's max_logprobs
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and value >= 0), name, "an integer >= 0 (or None)", value)
        _check(self.logit_bias is None or (isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS
                                            and all(_is_int(t) and t >= 0 and _is_num(b) and -100.0 <= b <= 100.0
                                                    for t, b in self.logit_bias.items())),
               "logit_bias", f"a map of at most {MAX_LOGIT_BIAS} token ids >= 0 to numbers in [-100, 100]",
               self.logit_bias)
        _check(self.kv_eviction_policy is None or isinstance(self.kv_eviction_policy, str),
               "kv_eviction_policy", "a policy name (or None)", self.kv_eviction_policy)
        _check(self.kv_budget_tokens is None or (_is_int(self.kv_budget_tokens) and self.kv_budget_tokens >= 1),
               "kv_budget_tokens", "an integer >= 1 (or None)", self.kv_budget_tokens)
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", "a StructuredOutputsParams (or None)", self.structured_outputs)


MAX_LOGIT_BIAS = 1024  # entries in one request's logit_bias (OpenAI takes 300)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # not NaN


def _check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}; got {value!r}")
