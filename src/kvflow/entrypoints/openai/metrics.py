"""/metrics: Prometheus text with vLLM's metric names under the `kvflow:` prefix (DESIGN.md).

Gauges and counters are the engine's own (`EngineStats`), read at scrape time by a custom
collector, so they can never drift from the engine. Latency histograms are fed per finished
request from the engine thread. Everything lives in one registry per app: two servers in one
process (tests) never share counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvflow.engine.request_timing import FinishedRequest
from kvflow.engine.stats import EngineStats
from kvflow.spec_decode.metrics import SpecDecodingStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)

# name → help, for values read from EngineStats; names ending in _total are counters.
_ENGINE_METRICS: dict[str, tuple[str, Callable[[EngineStats], float]]] = {
    "kvflow:num_requests_running": ("Requests in the running batch.", lambda s: s.num_running),
    "kvflow:num_requests_waiting": ("Requests waiting to be scheduled.", lambda s: s.num_waiting),
    "kvflow:kv_cache_usage_perc": ("Fraction of KV cache blocks in use (1 = full).", lambda s: s.kv_cache_usage),
    "kvflow:num_preemptions_total": ("Preemptions since start.", lambda s: s.num_preemptions_total),
    "kvflow:prefix_cache_queries_total": ("Prompt tokens looked up in the prefix cache.",
                                          lambda s: s.prefix_cache_queries_total),
    "kvflow:prefix_cache_hits_total": ("Prompt tokens found in the prefix cache.", lambda s: s.prefix_cache_hits_total),
    "kvflow:prompt_tokens_total": ("Prompt tokens of admitted requests.", lambda s: s.prompt_tokens_total),
    "kvflow:generation_tokens_total": ("Tokens generated.", lambda s: s.generation_tokens_total),
    # Disaggregated prefill/decode: KV saved for (prefill) or loaded from (decode) another engine.
    "kvflow:kv_transfer_bytes_total": ("KV bytes moved to or from other engines.", lambda s: s.kv_transfer_bytes_total),
    "kvflow:kv_transfer_seconds_total": ("Time spent moving KV to or from other engines.",
                                         lambda s: s.kv_transfer_seconds_total),
}

# Speculative decoding (only with it on), as vLLM's spec-decode counters.
_SPEC_METRICS: dict[str, tuple[str, Callable[[SpecDecodingStats], float]]] = {
    "kvflow:spec_decode_num_drafts_total": ("Verifications: one request's proposals checked in one step.",
                                            lambda s: s.num_drafts),
    "kvflow:spec_decode_num_draft_tokens_total": ("Tokens proposed.", lambda s: s.num_draft_tokens),
    "kvflow:spec_decode_num_accepted_tokens_total": ("Proposed tokens accepted.", lambda s: s.num_accepted_tokens),
    "kvflow:spec_decode_proposer_seconds_total": ("Time spent proposing.", lambda s: s.proposer_seconds),
    "kvflow:spec_decode_target_seconds_total": ("Time in the target model while speculating.",
                                                lambda s: s.target_seconds),
}


def stat_values(stats: EngineStats) -> dict[str, float | None]:
    """The engine's gauges and counters by metric name without `kvflow:`, as /metrics has them;
    the speculative ones None without speculation (the live page's numbers)."""
    spec = stats.spec_decoding
    values = {name: read(stats) for name, (_, read) in _ENGINE_METRICS.items()}
    values |= {name: None if spec is None else read(spec) for name, (_, read) in _SPEC_METRICS.items()}
    return {name.removeprefix("kvflow:"): value for name, value in values.items()}


class EngineStatsCollector(Collector):
    def __init__(self, get_stats: Callable[[], EngineStats], model_name: str) -> None:
        self.get_stats = get_stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.get_stats()
        yield from self._families(_ENGINE_METRICS, stats)
        spec = stats.spec_decoding
        if spec is not None:
            yield from self._families(_SPEC_METRICS, spec)
            per_position = CounterMetricFamily("kvflow:spec_decode_num_accepted_tokens_per_pos",
                                               "Proposed tokens accepted, by position in the proposal.",
                                               labels=["model_name", "position"])
            for position, accepted in enumerate(spec.accepted_per_position):
                per_position.add_metric([self.model_name, str(position)], float(accepted))
            yield per_position

    def _families(self, metrics: dict, stats) -> Iterator[Metric]:
        for name, (doc, read) in metrics.items():
            if name.endswith("_total"):
                family = CounterMetricFamily(name.removesuffix("_total"), doc, labels=["model_name"])
            else:
                family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(read(stats)))
            yield family


class ServerMetrics:
    def __init__(self, get_stats: Callable[[], EngineStats], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(get_stats, model_name))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)
            return metric.labels(model_name)

        self.ttft = histogram("kvflow:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram("kvflow:inter_token_latency_seconds", "Time between consecutive tokens.", _ITL_BUCKETS)
        self.e2e = histogram("kvflow:e2e_request_latency_seconds", "Arrival to finish of a request.", _E2E_BUCKETS)

    def observe(self, finished: FinishedRequest) -> None:
        """Runs on the engine thread; prometheus-client metrics are thread-safe."""
        self.ttft.observe(finished.time_to_first_token)
        self.e2e.observe(finished.e2e_latency)
        for gap in finished.inter_token_latencies:
            self.itl.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
