"""A token budget that follows the machine's speed: `kvflow serve` without --max-num-batched-tokens.

The decodes batched with a step of prompt tokens wait for all of it: their next token comes that
much later. `kvflow serve`'s 1,024 tokens a step took ~0.22 s on a Xeon with AMX (a lone 1,000-token
prompt's TTFT: 217-228 ms), where 512 had lost a third of the served throughput (stop 28), and
0.55 s on an AMD EPYC without AMX (0.39 TFLOP/s bf16), where 512 tokens a step cut ITL p99 by
~40% and TTFT p50 by ~25% for 2-13% of the throughput (docs/performance.md, stop 35). So the
budget is halved, down to MIN_BUDGET, until a step of it would take at most STEP_TARGET_S.

A step's time is taken in proportion to its tokens (a prompt's products are compute-bound), from
the fastest per-token time of any step of at least MIN_MEASURED_TOKENS tokens seen so far: the
first steps, which build what runs lazily, and steps slowed by a busy machine only ever make it
look slower than it is, and the budget goes back up as faster steps are seen. Timing at start
instead took a throwaway step (+1.3 s to `/health`) that touched the KV pool's pages for the first
time and read 0.87 s where the steady state takes 0.55.
"""

from __future__ import annotations

import math

STEP_TARGET_S = 0.4
MIN_BUDGET = 256
MIN_MEASURED_TOKENS = 256  # fewer: per-step costs, not the products, would set the time


def fitted_token_budget(budget: int, full_step_s: float) -> int:
    """`budget` halved until a step of it would take at most STEP_TARGET_S, but not below
    MIN_BUDGET; `full_step_s`: what a step of `budget` tokens takes."""
    fitted = budget
    while fitted // 2 >= MIN_BUDGET and full_step_s * fitted / budget > STEP_TARGET_S:
        fitted //= 2
    return fitted


class StepBudget:
    """The budget for the next steps, from the steps seen (at most `configured`)."""

    def __init__(self, configured: int) -> None:
        self.configured = configured
        self.fastest_token_s = math.inf

    def observe(self, num_tokens: int, seconds: float) -> int | None:
        """After a step of `num_tokens` that took `seconds`: the budget from now on, or None where
        the step says nothing new."""
        if num_tokens < MIN_MEASURED_TOKENS or seconds / num_tokens >= self.fastest_token_s:
            return None
        self.fastest_token_s = seconds / num_tokens
        return fitted_token_budget(self.configured, self.fastest_token_s * self.configured)
