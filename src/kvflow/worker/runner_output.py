"""What one model step returns to the engine: a token per sampling request, and logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PositionLogprobs:
    """Logprobs at one position: entry 0 is the token actually there (sampled or prompt),
    then the top-N alternatives; `rank` is entry 0's rank in the whole vocabulary (1 = best)."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    # request id → (position of the first prompt token covered, logprobs of each next prompt token)
    prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]] = field(default_factory=dict)
