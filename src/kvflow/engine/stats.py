"""Engine-wide counters and gauges, read by the stats log and the server's /metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use
    num_preemptions_total: int
    prefix_cache_queries_total: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int  # of those, tokens found cached
    prompt_tokens_total: int  # prompt tokens of admitted requests (once per request, whatever n)
    generation_tokens_total: int  # tokens sampled
