"""Seeded synthetic workloads, shared by kvflow's benchmarks and the peer scripts so every engine
sees exactly the same token ids."""

from __future__ import annotations

import random


def random_token_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """`n` random token ids, avoiding the lowest 1000 ids where tokenizers keep their special tokens."""
    low = min(1000, vocab_size // 2)
    return [rng.randrange(low, vocab_size) for _ in range(n)]


def random_prompts(num_prompts: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Prompts of uniform random length in [min_len, max_len] made of random token ids."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_input_len <= max_input_len; got {min_len}, {max_len}")
    rng = random.Random(seed)
    return [random_token_ids(rng, rng.randint(min_len, max_len), vocab_size) for _ in range(num_prompts)]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
