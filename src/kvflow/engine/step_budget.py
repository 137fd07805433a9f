"""A token budget that follows the machine's speed: `kvflow serve` without --max-num-batched-tokens.

The decodes batched with a step of prompt tokens wait for all of it: their next token comes that
much later. `kvflow serve`'s 1,024 tokens a step took ~0.22 s on a Xeon with AMX (a lone 1,000-token
prompt's TTFT: 217-228 ms), where 512 had lost a third of the served throughput (stop 28), and
0.55 s on an AMD EPYC without AMX (0.39 TFLOP/s bf16), where 512 tokens a step cut ITL p99 by
~40% and TTFT p50 by ~25% for 2-13% of the throughput (docs/performance-journal.md, stop 35). So the
budget is halved, down to MIN_BUDGET, until a step of it would take at most STEP_TARGET_S.

A step's time comes from the step-time model adaptive speculation fits (T(n) = a + b·n over the
recent steps, `StepTimeModel`), fed the target model's time of every step: the first steps, slowed
by what they build and by the KV pages they touch first, fade out of it. Timing one throwaway step
at start instead added 1.3 s before `/health` and read 0.87 s where the steady state takes 0.55.
"""

from __future__ import annotations

from collections.abc import Callable

from kvflow.spec_decode.adaptive import StepTimeModel

STEP_TARGET_S = 0.4
MIN_BUDGET = 256


def fitted_token_budget(budget: int, step_seconds: Callable[[int], float]) -> int:
    """`budget` halved until a step of that many tokens would take at most STEP_TARGET_S by
    `step_seconds`, but not below MIN_BUDGET."""
    fitted = budget
    while fitted // 2 >= MIN_BUDGET and step_seconds(fitted) > STEP_TARGET_S:
        fitted //= 2
    return fitted


class StepBudget:
    """The budget for the next steps, from the steps seen (at most `configured`)."""

    def __init__(self, configured: int) -> None:
        self.configured = configured
        self.step_time = StepTimeModel()

    def observe(self, num_tokens: int, seconds: float) -> int | None:
        """After a step of `num_tokens` that took `seconds`: the budget from now on, or None while
        the steps seen have not yet varied enough in size to say (or the step ran no token)."""
        if num_tokens == 0:
            return None
        self.step_time.observe(num_tokens, seconds)
        fit = self.step_time.fit()
        if fit is None:
            return None
        a, b = fit
        return fitted_token_budget(self.configured, lambda n: a + b * n)
