"""Token eviction in the paged pool: a request's KV bounded by a budget of tokens
(`kv_eviction_policy`, `kv_budget_tokens`; engine arguments, and per request in SamplingParams).

`sink_window` (StreamingLLM, Xiao et al., 2023) keeps the first tokens, the "attention sinks"
that take a large share of every query's attention whatever they say, and the most recent ones;
the tokens between them leave the pool, in whole blocks, which go back to the free list at once.

**Where eviction happens.** Only at fixed points: every `interval` positions (whole blocks), before
the tokens from that point on are computed, the request drops its oldest non-sink blocks until it
keeps at most `budget - interval` tokens; the next interval's tokens then fill it to the budget at
most. The scheduler never lets a chunk cross a point, so what a query attends to depends on its
position alone, never on the batching, the chunk sizes, or a preemption's recompute: the query at
p, in the interval that starts at b, sees positions [0, S) and [S + e(b), p], with S the sinks
rounded up to a block and e(b) = max(0, b - (budget - interval)) the tokens evicted by then
(`visible`). A prompt longer than the whole pool runs within its budget, chunk by chunk.

**Positions.** Survivors keep their original positions: keys are cached already rotated (RoPE),
and the kernels read them where they lie, so a query at p scores a key at j with the angle of
p - j as the full cache would. StreamingLLM instead renumbers positions inside the cache so a
stream may outrun the trained context; kvflow's requests never pass max_model_len (admission),
so every distance is one the model was trained on, and renumbering would need keys stored
unrotated and rotated at every read.

**The pool's view.** The surviving blocks are compacted in the block table (sinks, then the
recent blocks: every block but the last full), so the attention kernels read a short ordinary
sequence; the chunk says how many tokens it has evicted, and the runner tells the KV index of a
token (its position less that) from its rotary position.

On a model with sliding-window layers (Gemma 3) the budget bounds the full-attention layers; a
sliding layer keeps its own window, by position, as without a budget (its table is not compacted).

Speculation composes where the proposer writes no KV (n-gram): a verification never crosses a
point (the chunk limit counts its proposals), so every point is still a chunk's start, and a
rejection rolls back only tokens after it. What does not compose yet, and says so when asked for: a
model with recurrent state, a drafter that writes KV (draft_model, layer_skip: by position, into
tables eviction compacts), a KV connector (it moves blocks by position).
An evicting request skips the prefix cache (its KV after the first point is not the full
context's) and is preempted by recompute, never swapped.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("none", "sink_window")
# The seeds' dynamic policies, named so a request for one says it is not built yet.
PLANNED_POLICIES = ("h2o", "snapkv", "pyramid")
SINK_TOKENS = 4  # StreamingLLM's four sinks; a whole block is kept
# Settings eviction does not compose with yet, and why.
NOT_COMPOSED = {
    "speculative_config": "a draft model's or the skipped layers' KV is written by position, not into the tables "
                          "eviction compacts; n-gram speculation composes",
    "kv_transfer_config": "the connector moves a request's blocks by position, and an evicting request's table is "
                          "compacted",
    "recurrent_state": "a state-space layer keeps no per-position KV to evict",
}


@dataclass(frozen=True)
class KVEviction:
    """One request's eviction: the policy and its sizes in tokens, all whole blocks."""

    policy: str
    budget_tokens: int
    sink_tokens: int
    interval: int

    @classmethod
    def resolve(cls, policy: str | None, budget: int | None, block_size: int) -> KVEviction | None:
        """The eviction a request runs with (None: keeps all its KV). Raises ValueError naming
        kv_eviction_policy or kv_budget_tokens when they cannot run."""
        policy = policy or "none"
        if policy in PLANNED_POLICIES:
            raise ValueError(f"kv_eviction_policy={policy!r} is not implemented yet; "
                             f"available: {', '.join(POLICIES)}")
        if policy not in POLICIES:
            raise ValueError(f"kv_eviction_policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        if policy == "none":
            return None
        sinks = -(-SINK_TOKENS // block_size) * block_size
        smallest = sinks + 2 * block_size  # the sinks, a block kept between points, a block of new tokens
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < smallest:
            raise ValueError(f"kv_budget_tokens must be an integer >= {smallest} (the sinks' {sinks} tokens and two "
                             f"blocks of {block_size}) with kv_eviction_policy={policy!r}; got {budget!r}")
        budget -= budget % block_size
        # Points a quarter of the budget apart: the kept context stays within 3/4..1 of the budget,
        # and a prompt's chunks are at most that long.
        interval = max(block_size, budget // 4 // block_size * block_size)
        return cls(policy, budget, sinks, interval)

    def evicted_at(self, point: int) -> int:
        """Tokens evicted once the point at position `point` is passed."""
        return max(0, point - (self.budget_tokens - self.interval))

    def chunk_limit(self, num_computed: int) -> int:
        """The most tokens a chunk starting at `num_computed` may compute: up to the next point."""
        return self.interval - num_computed % self.interval

    def visible(self, position: int) -> tuple[range, range]:
        """The positions the query at `position` attends to: the sinks and the recent run."""
        evicted = self.evicted_at(position - position % self.interval)
        sinks = range(min(self.sink_tokens, position + 1))
        return sinks, range(max(len(sinks), self.sink_tokens + evicted), position + 1)
