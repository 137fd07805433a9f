"""`kvflow bench lora` end to end on a tiny model: its random adapters load, every run finishes."""

from __future__ import annotations

import json

from tiny_models import make_tiny_model

from kvflow.entrypoints.cli import main


def test_bench_lora_runs(tmp_path, capsys):
    make_tiny_model("llama-gqa-llama3-rope", tmp_path)
    assert main(["bench", "lora", "--model", str(tmp_path), "--dtype", "float32", "--skip-tokenizer-init",
                 "--num-prompts", "4", "--min-input-len", "4", "--max-input-len", "12", "--output-len", "3",
                 "--num-adapters", "1", "2", "--lora-rank", "4", "--kv-cache-memory-gb", "0.01", "--disable-log-stats",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["runs"]) == ["base", "base, LoRA enabled", "1 adapters", "2 adapters"]
    assert all(run["output_tok_s"] > 0 for run in report["runs"].values())
    assert report["load_ms"]["disk_to_host"] > 0 and report["load_ms"]["host_to_slot"] > 0
