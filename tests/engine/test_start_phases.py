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
