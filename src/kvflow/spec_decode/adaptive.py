"""How many tokens to propose, per request and step: as many as pay, and none when none do.

With per-proposal acceptance α, k proposals yield E(α, k) = 1 + α + … + α^k tokens per step (each
proposal is kept only if all before it were). They cost k more rows in the target's forward pass
and k proposals. The target's step time is measured as T(n) ≈ a + b·n for n tokens; a request's
share of a plain decode step in a batch of B is a/B + b, so relative to it each proposal costs
c = b / (a/B + b) to verify and r = (proposer seconds per token) / (a/B + b) to make, and

    speedup(k) = E(α, k) / (1 + k·(c + r)).

At batch 1 a memory-bound step has a ≫ b, c is small and speculation pays; as the batch grows,
a/B shrinks, c tends to 1 and no k pays any more — speculation switches itself off once the batch
is compute-bound. k is the best of 0..num_speculative_tokens, 0 unless it gains at least 5%.
(This is the seeds' (kα + 1)/(1 + k·r) with the verification's own cost and acceptance as a chain.)

T(n) is fitted to decode steps only (every chunk a decode or a verification: n counts their rows,
sampling included); a prompt chunk's tokens cost differently. Until those steps have varied in
size the fit cannot tell a from b, so every other step then speculates and the rest do not.

α is each request's own: a decayed count of accepted proposals over proposals tried (a rejection
ends a chain, so it counts once). A request that stopped speculating drifts back to the prior and
so tries again later.
"""

from __future__ import annotations

from kvflow.spec_decode.config import SpeculativeConfig
from kvflow.spec_decode.metrics import SpecDecodingStats

PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 2.0  # proposals' worth of belief in the prior
DECAY = 0.8  # per verification: the last ~5 matter
MIN_GAIN = 1.05


def expected_tokens(alpha: float, k: int) -> float:
    """E(α, k): tokens per step from k proposals, each accepted with probability α given the last was."""
    return sum(alpha**i for i in range(k + 1))


def best_k(alpha: float, max_k: int, verify_cost: float, draft_cost: float) -> int:
    gains = [expected_tokens(alpha, k) / (1 + k * (verify_cost + draft_cost)) for k in range(max_k + 1)]
    k = max(range(max_k + 1), key=gains.__getitem__)
    return k if gains[k] >= MIN_GAIN else 0


class StepTimeModel:
    """T(n) = a + b·n fitted to (tokens, seconds) of recent steps by exponentially weighted least
    squares; None until the steps have varied in size.

    `skip_first_of_each_size`: leave a size's first step out. It pays one-off costs (the CPU decode
    step lays out its kernels' plans for a new row count; allocations grow), several times a steady
    step. Fitted into speculation's model, one such verification made b look like a whole decode
    step a token, so speculation switched itself off at batch 1 and, taking only one-token steps
    from then on, never saw otherwise. (The step budget's prompt steps are of ever new sizes: it
    lets its first steps fade out instead, engine/step_budget.py.)"""

    def __init__(self, decay: float = 0.98, skip_first_of_each_size: bool = False) -> None:
        self.decay = decay
        self._sums = [0.0] * 5  # Σw, Σw·n, Σw·n², Σw·t, Σw·n·t
        self._sizes_seen: set[int] | None = set() if skip_first_of_each_size else None

    def observe(self, tokens: int, seconds: float) -> None:
        if self._sizes_seen is not None and tokens not in self._sizes_seen:
            self._sizes_seen.add(tokens)
            return
        self._sums = [s * self.decay for s in self._sums]
        for i, value in enumerate((1.0, tokens, tokens * tokens, seconds, tokens * seconds)):
            self._sums[i] += value

    def fit(self) -> tuple[float, float] | None:
        w, n, nn, t, nt = self._sums
        if w == 0:
            return None
        spread = w * nn - n * n
        if spread <= 0.01 * w * nn:  # sizes within ~10% of each other
            return None
        b = max((w * nt - n * t) / spread, 0.0)
        return max((t - b * n) / w, 0.0), b


class AdaptiveSpeculation:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_k = config.num_speculative_tokens
        self.reserves_kv_slots = config.writes_kv
        self.adaptive = config.adaptive
        self.disable_by_batch_size = config.disable_by_batch_size
        self.stats = SpecDecodingStats(self.max_k)
        self.step_time = StepTimeModel(skip_first_of_each_size=True)
        self._proposer = [0.0, 0.0]  # decayed Σ seconds, Σ tokens proposed
        self._acceptance: dict[str, list[float]] = {}  # request → decayed [accepted, tried]
        self._steps = 0

    # -- the scheduler's questions ---------------------------------------------------------
    def num_lookahead_tokens(self, request_id: str, batch_size: int) -> int:
        if self.disable_by_batch_size is not None and batch_size >= self.disable_by_batch_size:
            return 0
        if not self.adaptive:
            return self.max_k
        costs = self.relative_costs(batch_size)
        if costs is None:  # the fit needs steps of both sizes
            return self.max_k if self._steps % 2 else 0
        verify_cost, draft_cost = costs
        k = best_k(self.acceptance(request_id), self.max_k, verify_cost, draft_cost)
        if k == 0 and request_id in self._acceptance:  # drift back toward the prior, to try again
            counts = self._acceptance[request_id]
            counts[0], counts[1] = counts[0] * 0.9, counts[1] * 0.9
        return k

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        self.stats.observe(num_drafted, num_accepted)
        counts = self._acceptance.setdefault(request_id, [0.0, 0.0])
        tried = num_accepted + (num_accepted < num_drafted)
        counts[0], counts[1] = counts[0] * DECAY + num_accepted, counts[1] * DECAY + tried

    def forget(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)

    # -- what the engine measured ----------------------------------------------------------
    def observe_step(self, num_tokens: int, target_seconds: float, num_proposed: int, proposer_seconds: float,
                     decode_only: bool) -> None:
        """`decode_only`: every chunk was a decode or a verification (no prompt tokens)."""
        self._steps += 1
        self.stats.target_seconds += target_seconds
        self.stats.proposer_seconds += proposer_seconds
        if num_tokens and decode_only:
            self.step_time.observe(num_tokens, target_seconds)
        if num_proposed:
            self._proposer = [self._proposer[0] * DECAY + proposer_seconds, self._proposer[1] * DECAY + num_proposed]

    def acceptance(self, request_id: str) -> float:
        accepted, tried = self._acceptance.get(request_id, (0.0, 0.0))
        return (accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (tried + PRIOR_WEIGHT)

    def relative_costs(self, batch_size: int) -> tuple[float, float] | None:
        """(c, r): a proposal's cost to verify and to make, relative to a request's share of a
        plain decode step at this batch size; None before the step time can be fitted."""
        fit = self.step_time.fit()
        if fit is None:
            return None
        a, b = fit
        share = a / max(batch_size, 1) + b
        if share <= 0:
            return 0.0, 0.0
        seconds, tokens = self._proposer
        per_token = seconds / tokens if tokens else 0.0
        return b / share, per_token / share
