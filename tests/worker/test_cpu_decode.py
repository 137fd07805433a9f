"""The CPU decode loop (worker/cpu_decode.py) computes what the model's modules compute, bit for
bit: the same kernels on the same tensors, without the modules around them. It needs the C++
CPU kernels, which the other tests switch off (tests/conftest.py), so these turn them on."""

from __future__ import annotations

import pytest
import torch

from kvflow.config import EngineArgs
from kvflow.engine.llm_engine import LLMEngine
from kvflow.model.layers import cpu_ops
from kvflow.worker import cpu_decode
from kvflow.worker.cpu_decode import CpuDecodeLoop
from test_cuda_graphs import _generate
from tiny_models import make_tiny_model

PROMPTS = [[5, 17, 3, 88, 40, 2, 9, 61, 33, 12, 7, 70, 1, 4], [44, 45], [90, 3, 3, 3, 8, 11], [7] * 21, [60, 61, 62]]


@pytest.fixture(autouse=True)
def kernels_on(monkeypatch):
    monkeypatch.setenv(cpu_ops.DISABLE_ENV, "1")
    if cpu_ops.load() is None:
        pytest.skip("the C++ CPU kernels cannot be built here")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama-gqa-llama3-rope", path)
    return str(path)


def _engine(model: str, dtype: str, loop: bool, monkeypatch, **kw) -> LLMEngine:
    monkeypatch.setenv(cpu_decode.DISABLE_ENV, "1" if loop else "0")
    engine = LLMEngine(EngineArgs(model, dtype=dtype, skip_tokenizer_init=True, num_kv_blocks=64,
                                  disable_log_stats=True, **kw))
    assert isinstance(engine.runner.decode_graphs, CpuDecodeLoop) == loop
    return engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_prompts", [1, 5])
def test_loop_matches_the_modules(llama_dir, dtype, num_prompts, monkeypatch):
    replayed = []
    loop_engine = _engine(llama_dir, dtype, True, monkeypatch)
    loop = loop_engine.runner.decode_graphs
    run = loop.run
    loop.run = lambda *a: replayed.append(a[2][0].num_requests) or run(*a)
    with_loop = _generate(loop_engine, PROMPTS[:num_prompts])
    without = _generate(_engine(llama_dir, dtype, False, monkeypatch), PROMPTS[:num_prompts])
    assert replayed and max(replayed) == num_prompts  # decode steps did go through the loop
    assert with_loop == without  # tokens and logprobs, bit for bit


def test_default_gguf_model_matches_the_modules(monkeypatch):
    """The default model (Q4_1 int4 planes, bfloat16): the loop calls the planes directly."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300]]
    with_loop = _generate(_engine(None, "bfloat16", True, monkeypatch, kv_cache_memory_gb=0.05), prompts)
    without = _generate(_engine(None, "bfloat16", False, monkeypatch, kv_cache_memory_gb=0.05), prompts)
    assert with_loop == without


@pytest.mark.parametrize("name", ["mistral-window", "qwen2-bias", "qwen3-qknorm"])
def test_models_it_does_not_take_run_through_the_modules(tmp_path, name, monkeypatch):
    make_tiny_model(name, tmp_path)
    monkeypatch.setenv(cpu_decode.DISABLE_ENV, "1")
    engine = LLMEngine(EngineArgs(str(tmp_path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
                                  disable_log_stats=True))
    assert engine.runner.decode_graphs is None
    assert len(_generate(engine, PROMPTS[:2])) == 2


def test_not_with_the_kernels_off(llama_dir, monkeypatch):
    monkeypatch.setenv(cpu_ops.DISABLE_ENV, "0")
    monkeypatch.setenv(cpu_decode.DISABLE_ENV, "1")
    engine = LLMEngine(EngineArgs(llama_dir, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
                                  disable_log_stats=True))
    assert engine.runner.decode_graphs is None
