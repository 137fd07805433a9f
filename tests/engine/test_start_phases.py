"""A start is never silent: a line per phase with its time (kvflow/phases.py), the long ones
announced when they begin."""

from __future__ import annotations

import logging
import re

from tiny_models import make_tiny_model

from kvflow import LLM


def test_each_phase_of_a_start_says_what_it_did_and_how_long_it_took(tmp_path, caplog):
    make_tiny_model("llama-gqa-llama3-rope", tmp_path)
    with caplog.at_level(logging.INFO, logger="kvflow"):
        llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, quantization="int8", num_kv_blocks=32,
                  block_size=8, disable_log_stats=True)
        llm.llm_engine.warm_up()
        llm.llm_engine.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvflow: ")]
    expected = [r"read the checkpoint in \d+\.\d s", r"prepared the weights \(int8\)\.\.\.",
                r"prepared the weights \(int8\) in \d+\.\d s",
                r"loaded the model and allocated the KV cache in \d+\.\d s \(32 KV blocks of 8 tokens\)",
                r"warmed up in \d+\.\d s"]
    assert len(lines) == len(expected), lines
    for line, pattern in zip(lines, expected):
        assert re.fullmatch(f"kvflow: {pattern}", line), line


def test_long_work_inside_a_phase_reports_how_far_it_got_every_few_seconds(monkeypatch, caplog):
    from kvflow import phases

    clock = iter([0.0, 1.0, 6.0, 7.0, 12.5, 13.0])  # phase start, four progress calls, the end
    monkeypatch.setattr(phases.time, "perf_counter", lambda: next(clock))
    phases.progress(1, 4, "layers")  # outside any phase: nothing
    with caplog.at_level(logging.INFO, logger="kvflow"), phases.phase("quantized"):
        for done in (1, 2, 3, 4):
            phases.progress(done, 4, "layers")
    lines = [r.getMessage() for r in caplog.records]
    # 1 s in: too soon; 6 s: a line; 7 s: too soon after it; 12.5 s: the last, said by the end line.
    assert lines == ["kvflow: quantized: 2 of 4 layers, 6 s so far", "kvflow: quantized in 13.0 s"]
