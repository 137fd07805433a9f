"""Engine-wide counters and gauges, read by the stats log and the server's /metrics."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvflow.spec_decode.metrics import SpecDecodingStats

logger = logging.getLogger("kvflow")


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
    spec_decoding: SpecDecodingStats | None = None  # with speculative decoding on
    kv_transfer_bytes_total: int = 0  # KV saved for or loaded from other engines
    kv_transfer_seconds_total: float = 0.0


class StatsLogger:
    """Logs one line every `interval` seconds while the engine is busy: the gauges, the prefix
    cache hit rate so far, and prompt / generation throughput since the previous line.

    The rates are differences from the counters the previous line read, so that reading must be
    one the counters still go on from. Work that sets the counters back afterwards (the engine's
    warm-up, which leaves no trace) runs `paused()`: a line read inside it would report the
    warm-up's tokens, and the next line's differences would go negative."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._last_time = time.monotonic()
        self._last: EngineStats | None = None
        self._paused = False

    @contextlib.contextmanager
    def paused(self, read_stats: Callable[[], EngineStats]) -> Iterator[None]:
        """No line inside; the next one counts from the counters as they are when the pause ends."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False
            self._last_time, self._last = time.monotonic(), read_stats()

    def maybe_log(self, read_stats: Callable[[], EngineStats], now: float | None = None) -> str | None:
        """Called every step; reads the stats only when a line is due."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._last_time
        if elapsed < self.interval or self._paused:
            return None
        stats, last = read_stats(), self._last
        prompt_rate = (stats.prompt_tokens_total - (last.prompt_tokens_total if last else 0)) / elapsed
        gen_rate = (stats.generation_tokens_total - (last.generation_tokens_total if last else 0)) / elapsed
        hit_rate = stats.prefix_cache_hits_total / stats.prefix_cache_queries_total if stats.prefix_cache_queries_total else 0.0
        line = (f"running: {stats.num_running}, waiting: {stats.num_waiting}, "
                f"KV cache usage: {stats.kv_cache_usage:.1%}, prefix cache hit rate: {hit_rate:.1%}, "
                f"prompt throughput: {prompt_rate:.1f} tok/s, generation throughput: {gen_rate:.1f} tok/s, "
                f"preemptions: {stats.num_preemptions_total}")
        if stats.spec_decoding is not None:
            line += "; " + stats.spec_decoding.describe()
        logger.info(line)
        self._last_time, self._last = now, stats
        return line
