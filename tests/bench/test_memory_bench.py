"""`kvflow bench memory` (bench/memory.py): every resident copy of the weights by layout, the KV
pool and the process's RSS, as the layers report them (quant/layouts.py)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import make_tiny_model

from kvflow.bench.memory import KV_POOL, OTHER, measure_memory, resident_bytes
from kvflow.config import EngineArgs
from kvflow.engine.llm_engine import LLMEngine
from kvflow.entrypoints.cli import main
from kvflow.quant import int4_gemv, layouts
from kvflow.worker.kv_cache import zeros_untouched


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama-gqa-llama3-rope", path)
    return str(path)


def _engine(model: str, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model, dtype="bfloat16", quantization="int4", skip_tokenizer_init=True,
                                num_kv_blocks=64, disable_log_stats=True, **kw))


def test_resident_bytes_count_the_pages_in_ram():
    pool = zeros_untouched((4, 1024, 1024), torch.bfloat16, "cpu")  # 8 MiB, never written
    assert resident_bytes(pool) == 0
    pool[1].fill_(1.0)
    assert 2 * 2**20 <= resident_bytes(pool) < 4 * 2**20 + 2**21  # one 2 MiB plane (and a huge page around it)


def test_int4_layers_report_planes_codes_and_the_dense_copy_that_compact_leaves_out(llama_dir):
    fast = measure_memory(_engine(llama_dir).runner.model, [])["layouts"]
    compact = measure_memory(_engine(llama_dir, cpu_weight_layouts="compact").runner.model, [])["layouts"]
    assert fast[layouts.PLANES]["allocated"] > 0 and fast[layouts.PLANES] == compact[layouts.PLANES]
    assert (fast[layouts.GEMV]["allocated"] > 0) == int4_gemv.fast()
    assert fast[layouts.DENSE]["allocated"] > 0 and compact[layouts.DENSE]["allocated"] == 0
    assert fast[layouts.WEIGHTS]["allocated"] > 0  # norms, the float embedding of int4's head


def test_the_command_reports_every_layout_the_kv_pool_and_the_rss(llama_dir, capsys):
    assert main(["bench", "memory", "--model", llama_dir, "--dtype", "bfloat16", "--quantization", "int4",
                 "--skip-tokenizer-init", "--num-kv-blocks", "64", "--prompt-len", "40", "--batch", "3",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["layouts"]) == {*layouts.LAYOUTS, KV_POOL, OTHER}
    assert report["layouts"][KV_POOL]["allocated"] > 0 and report["layouts"][OTHER]["anonymous"] > 0
    assert report["rss"]["VmRSS"] >= report["rss"]["RssAnon"] > 0
    counted = sum(sizes["anonymous"] for sizes in report["layouts"].values())
    assert counted <= report["rss"]["RssAnon"]
