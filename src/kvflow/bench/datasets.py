"""Request sets for `kvflow bench serve`: random lengths, shared prefixes, or a text file.

Everything is drawn from one seeded `random.Random`, so the same flags give the same requests
against every server. Random prompts are token-id lists (the OpenAI completions API accepts
them), which keeps their lengths exact whatever the server's tokenizer does with text.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

from kvflow.bench.workloads import random_token_ids

LENGTH_KINDS = ("fixed", "uniform", "normal", "exponential")
DEFAULT_VOCAB_SIZE = 49152  # SmolLM2's, kvflow's default model


@dataclass(frozen=True)
class LengthDist:
    """Token counts around `mean`.

    fixed: always mean; uniform: in mean·[1 − spread, 1 + spread]; normal: σ = spread·mean;
    exponential: mean `mean` (spread unused). Every draw is at least 1.
    """

    kind: str
    mean: int
    spread: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"length distribution must be one of {', '.join(LENGTH_KINDS)}; got {self.kind!r}")
        if self.mean < 1:
            raise ValueError(f"mean length must be >= 1; got {self.mean}")
        # A uniform spread above 1 would draw negative lengths; others only need spread >= 0.
        if self.spread < 0 or (self.kind == "uniform" and self.spread > 1):
            raise ValueError(f"spread must be >= 0 (and <= 1 for uniform); got {self.spread}")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.mean
        if self.kind == "uniform":
            lo, hi = self.mean * (1 - self.spread), self.mean * (1 + self.spread)
            return max(1, rng.randint(math.floor(lo), math.ceil(hi)))
        if self.kind == "normal":
            return max(1, round(rng.gauss(self.mean, self.spread * self.mean)))
        return max(1, round(rng.expovariate(1.0 / self.mean)))


def parse_length_dist(text: str, mean: int) -> LengthDist:
    """'KIND' or 'KIND:SPREAD', e.g. 'uniform:0.5', around `mean` tokens."""
    kind, _, spread = text.partition(":")
    try:
        return LengthDist(kind, mean, float(spread) if spread else 0.0)
    except ValueError as err:
        raise ValueError(f"bad length distribution {text!r}: {err}") from None


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]
    output_len: int
    prompt_len: int | None  # None for text prompts: only the server's tokenizer knows


@dataclass(frozen=True)
class DatasetConfig:
    """`name` is "random", "shared-prefix", or the path of a text file (one prompt per line)."""

    name: str
    num_prompts: int
    input_len: LengthDist
    output_len: LengthDist
    prefix_len: int = 256
    num_prefixes: int = 4
    vocab_size: int = DEFAULT_VOCAB_SIZE
    seed: int = 0


def build_dataset(cfg: DatasetConfig) -> list[SampleRequest]:
    if cfg.num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1; got {cfg.num_prompts}")
    rng = random.Random(cfg.seed)
    if cfg.name == "random":
        return [_random_request(cfg, rng, []) for _ in range(cfg.num_prompts)]
    if cfg.name == "shared-prefix":
        return _shared_prefix(cfg, rng)
    return _from_file(cfg, rng)


def _tokens(cfg: DatasetConfig, rng: random.Random, n: int) -> list[int]:
    return random_token_ids(rng, n, cfg.vocab_size)


def _random_request(cfg: DatasetConfig, rng: random.Random, prefix: list[int]) -> SampleRequest:
    prompt = prefix + _tokens(cfg, rng, cfg.input_len.sample(rng))
    return SampleRequest(prompt, cfg.output_len.sample(rng), len(prompt))


def _shared_prefix(cfg: DatasetConfig, rng: random.Random) -> list[SampleRequest]:
    """`num_prefixes` system prompts of `prefix_len` tokens, each request one of them (round
    robin) plus its own random suffix drawn from the input-length distribution."""
    if cfg.prefix_len < 1 or cfg.num_prefixes < 1:
        raise ValueError("shared-prefix needs prefix_len >= 1 and num_prefixes >= 1")
    prefixes = [_tokens(cfg, rng, cfg.prefix_len) for _ in range(cfg.num_prefixes)]
    return [_random_request(cfg, rng, prefixes[i % cfg.num_prefixes]) for i in range(cfg.num_prompts)]


def _from_file(cfg: DatasetConfig, rng: random.Random) -> list[SampleRequest]:
    path = Path(cfg.name)
    if not path.is_file():
        raise ValueError(f"dataset {cfg.name!r} is neither 'random', 'shared-prefix' nor a text file")
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path} holds no non-empty line to use as a prompt")
    # Lines in file order, repeated when there are fewer lines than requests.
    return [SampleRequest(lines[i % len(lines)], cfg.output_len.sample(rng), None) for i in range(cfg.num_prompts)]
