from __future__ import annotations

from kvflow.engine.stats import EngineStats, StatsLogger


def _stats(prompt: int, generated: int, queries: int = 0, hits: int = 0) -> EngineStats:
    return EngineStats(num_running=3, num_waiting=1, kv_cache_usage=0.25, num_preemptions_total=2,
                       prefix_cache_queries_total=queries, prefix_cache_hits_total=hits,
                       prompt_tokens_total=prompt, generation_tokens_total=generated)


def test_logs_one_line_per_interval_with_rates_since_the_last_line():
    logger = StatsLogger(interval=10.0)
    start = logger._last_time
    reads = []

    def read(stats):
        return lambda: reads.append(stats) or stats

    assert logger.maybe_log(read(_stats(0, 0)), now=start + 5) is None
    assert reads == []  # not due: the stats were not even read
    line = logger.maybe_log(read(_stats(400, 100, queries=400, hits=100)), now=start + 10)
    assert "running: 3, waiting: 1, KV cache usage: 25.0%, prefix cache hit rate: 25.0%" in line
    assert "prompt throughput: 40.0 tok/s, generation throughput: 10.0 tok/s, preemptions: 2" in line
    line = logger.maybe_log(read(_stats(400, 300, queries=400, hits=100)), now=start + 30)
    assert "prompt throughput: 0.0 tok/s, generation throughput: 10.0 tok/s" in line
