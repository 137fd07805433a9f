"""The serve stats line never reports a negative throughput (issue 39): the warm-up sets the
engine's counters back when it ends, so a line read during it reported the warm-up's tokens and
left the next line counting from them. The warm-up (the server's, a data-parallel replica's, a
benchmark's: `LLMEngine.warm_up`) now runs with the line paused, and the next line counts from
the counters as the warm-up left them."""

from __future__ import annotations

import logging
import re

import pytest
from tiny_models import tiny_chat_model

from kvflow import EngineArgs, LLMEngine, SamplingParams
from kvflow.engine.stats import EngineStats, StatsLogger

PROMPT_RATE = re.compile(r"prompt throughput: (-?[\d.]+) tok/s")


def stats(prompt: int, generated: int) -> EngineStats:
    return EngineStats(num_running=1, num_waiting=0, kv_cache_usage=0.5, num_preemptions_total=0,
                       prefix_cache_queries_total=0, prefix_cache_hits_total=0,
                       prompt_tokens_total=prompt, generation_tokens_total=generated)


def test_a_paused_logger_logs_nothing_and_counts_from_the_end_of_the_pause():
    logger = StatsLogger(interval=10.0)
    counters = [stats(0, 0)]
    with logger.paused(lambda: counters[-1]):
        assert logger.maybe_log(lambda: stats(512, 16), now=logger._last_time + 60) is None  # due, but paused
        counters.append(stats(0, 0))  # the warm-up sets its counters back
    line = logger.maybe_log(lambda: stats(100, 50), now=logger._last_time + 10)
    assert "prompt throughput: 10.0 tok/s, generation throughput: 5.0 tok/s" in line


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def test_the_warm_up_leaves_the_stats_line_nothing_to_count_from(model_dir, caplog):
    engine = LLMEngine(EngineArgs(model_dir, dtype="float32"))
    engine.stats_logger = StatsLogger(interval=1e-9)  # a line at every step, as after a slow start
    with caplog.at_level(logging.INFO, logger="kvflow"):
        engine.warm_up()
        during = [r.getMessage() for r in caplog.records if PROMPT_RATE.search(r.getMessage())]
        engine.add_request("r", "hello there", SamplingParams(max_tokens=3, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    lines = [r.getMessage() for r in caplog.records if PROMPT_RATE.search(r.getMessage())]
    assert during == [] and len(lines) == 3  # one line a step of the request, none of the warm-up
    rates = [float(PROMPT_RATE.search(line).group(1)) for line in lines]
    assert rates[0] > 0 and all(rate >= 0 for rate in rates), lines
