"""What one model step returns to the engine: the tokens each sampling request produced (one, or
with speculative decoding its accepted proposals and one more), their logprobs, and the tokens
proposed for the next step."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.core.kv_connector import TransferStats


@dataclass(frozen=True)
class PositionLogprobs:
    """Logprobs at one position: entry 0 is the token actually there (sampled or prompt),
    then the top-N alternatives; `rank` is entry 0's rank in the whole vocabulary (1 = best)."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)  # one per sampled token
    # request id → (position of the first prompt token covered, logprobs of each next prompt token)
    prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]] = field(default_factory=dict)
    # request id → tokens proposed to follow this step's last sampled token (speculative decoding)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # The step's time in the target model (forward and sampling), and with speculation on in the
    # proposer.
    target_seconds: float = 0.0
    proposer_seconds: float = 0.0
    # request id → KV it loaded from or saved for another engine this step
    kv_transfer: dict[str, TransferStats] = field(default_factory=dict)
    # requests whose KV the connector could not load this step: nothing above is theirs; they recompute
    kv_load_failed: set[str] = field(default_factory=set)
