"""The CPU decode loop (worker/cpu_decode.py) computes what the model's modules compute, bit for
bit: the same kernels on the same tensors, without the modules around them. It needs the C++
CPU kernels, which the other tests switch off (tests/conftest.py), so these turn them on."""

from __future__ import annotations

import pytest
from test_cuda_graphs import _generate
from tiny_models import make_tiny_model, write_tiny_tokenizer

from kvflow.config import EngineArgs
from kvflow.engine.llm_engine import LLMEngine
from kvflow.model.layers import cpu_ops
from kvflow.quant import int4_gemv, panel_linear
from kvflow.worker import cpu_decode
from kvflow.worker.cpu_decode import CpuDecodeLoop

PROMPTS = [[5, 17, 3, 88, 40, 2, 9, 61, 33, 12, 7, 70, 1, 4], [44, 45], [90, 3, 3, 3, 8, 11], [7] * 21, [60, 61, 62],
           [8, 9, 10, 11], [90, 1], [30, 31, 32, 33, 34, 35, 36, 37, 38]]


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


def _engine(model: str, dtype: str, loop: bool, monkeypatch, native: bool = True, **kw) -> LLMEngine:
    monkeypatch.setenv(cpu_decode.DISABLE_ENV, "1" if loop else "0")
    monkeypatch.setenv(cpu_decode.NATIVE_DISABLE_ENV, "1" if native else "0")
    engine = LLMEngine(EngineArgs(model, dtype=dtype, **{"skip_tokenizer_init": True, "num_kv_blocks": 64,
                                                         "disable_log_stats": True, **kw}))
    assert isinstance(engine.runner.decode_graphs, CpuDecodeLoop) == loop
    return engine


def _count_steps(engine: LLMEngine, steps: list[int]) -> LLMEngine:
    """Records the rows of each step the C++ step ran."""
    run = engine.runner.decode_graphs._run_native
    engine.runner.decode_graphs._run_native = lambda hidden, *a: steps.append(hidden.shape[0]) or run(hidden, *a)
    return engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_prompts", [1, 5])
def test_loop_matches_the_modules(llama_dir, dtype, num_prompts, monkeypatch):
    replayed = []
    loop_engine = _engine(llama_dir, dtype, True, monkeypatch)
    loop = loop_engine.runner.decode_graphs
    assert loop.native is None  # float projections: no few-row int4 GEMV to call from C++
    run = loop.run
    loop.run = lambda *a: replayed.append(a[2][0].num_requests) or run(*a)
    with_loop = _generate(loop_engine, PROMPTS[:num_prompts])
    without = _generate(_engine(llama_dir, dtype, False, monkeypatch), PROMPTS[:num_prompts])
    assert replayed and max(replayed) == num_prompts  # decode steps did go through the loop
    assert with_loop == without  # tokens and logprobs, bit for bit


@pytest.mark.parametrize("num_prompts", [1, 3, 5])
def test_cpp_step_matches_the_python_loop_and_the_modules(llama_dir, num_prompts, monkeypatch):
    """int4 projections in bfloat16 run as one C++ call per step up to int4_gemv.MAX_ROWS rows
    (steps of five run the Python loop)."""
    if not int4_gemv.fast():
        pytest.skip("no AVX-512 BF16 here: the few-row GEMV the C++ step calls is not used")
    steps = []
    kw = dict(quantization="int4")
    native = _generate(_count_steps(_engine(llama_dir, "bfloat16", True, monkeypatch, **kw), steps),
                       PROMPTS[:num_prompts])
    python_loop = _generate(_engine(llama_dir, "bfloat16", True, monkeypatch, native=False, **kw), PROMPTS[:num_prompts])
    modules = _generate(_engine(llama_dir, "bfloat16", False, monkeypatch, **kw), PROMPTS[:num_prompts])
    assert steps == [num_prompts] * len(steps) and bool(steps) == (num_prompts <= int4_gemv.MAX_ROWS)
    assert native == python_loop == modules


def _count_panel_steps(engine: LLMEngine, steps: list[int]) -> LLMEngine:
    """Records the rows of each step the C++ step ran on panels."""
    run = engine.runner.decode_graphs._run_panels
    engine.runner.decode_graphs._run_panels = lambda hidden, *a: steps.append(hidden.shape[0]) or run(hidden, *a)
    return engine


@pytest.mark.parametrize("quantization,num_prompts", [(None, 1), (None, 5), ("int4", 8)])
def test_cpp_step_on_panels_matches_the_python_loop_and_the_modules(llama_dir, quantization, num_prompts, monkeypatch):
    """bf16 products on the panel kernel (a bf16 model's packed weights at any row count; int4
    planes' dense copy past int4_gemv.MAX_ROWS) run as one C++ call per decode step, the first
    too: the prompts' step built the gated pairs."""
    if not panel_linear.available():
        pytest.skip("no AVX-512 BF16 here: no panel kernel")
    steps = []
    kw = dict(quantization=quantization)
    native = _generate(_count_panel_steps(_engine(llama_dir, "bfloat16", True, monkeypatch, **kw), steps),
                       PROMPTS[:num_prompts])
    python_loop = _generate(_engine(llama_dir, "bfloat16", True, monkeypatch, native=False, **kw), PROMPTS[:num_prompts])
    modules = _generate(_engine(llama_dir, "bfloat16", False, monkeypatch, **kw), PROMPTS[:num_prompts])
    decode_steps = len(next(iter(native.values()))[0]) - 1  # every token but the prompt step's
    assert steps == [num_prompts] * decode_steps
    assert native == python_loop == modules


def test_no_panel_step_where_a_product_runs_elsewhere(llama_dir, monkeypatch):
    """int8 rows (`--quantization int8`) past the GEMV's rows are no panels: every step stays in
    Python, and the row count is looked at once."""
    engine = _engine(llama_dir, "bfloat16", True, monkeypatch, quantization="int8")
    steps = []
    _generate(_count_panel_steps(engine, steps), PROMPTS[:8])
    assert steps == [] and engine.runner.decode_graphs.panel_steps == {8: None}


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("num_prompts", [1, 5])
def test_one_byte_kv_runs_in_the_loop_and_the_cpp_step(llama_dir, kv_cache_dtype, num_prompts, monkeypatch):
    """An int8 / fp8 KV cache: the loop (and, up to int4_gemv.MAX_ROWS rows, the C++ step) writes
    with the quantizing op and reads the codes with the modules' kernel: their numbers, bit for bit."""
    steps = []
    kw = dict(quantization="int4", kv_cache_dtype=kv_cache_dtype)
    python_loop = _generate(_engine(llama_dir, "bfloat16", True, monkeypatch, native=False, **kw), PROMPTS[:num_prompts])
    modules = _generate(_engine(llama_dir, "bfloat16", False, monkeypatch, **kw), PROMPTS[:num_prompts])
    assert python_loop == modules
    if int4_gemv.fast():
        native = _generate(_count_steps(_engine(llama_dir, "bfloat16", True, monkeypatch, **kw), steps),
                           PROMPTS[:num_prompts])
        assert bool(steps) == (num_prompts <= int4_gemv.MAX_ROWS)
        assert native == modules


@pytest.mark.parametrize("method", ["int8", "w8a8", "fp8", "mxfp4"])
def test_every_weight_format_matches_the_modules(tmp_path, method, monkeypatch):
    """The loop takes the quantized embedding's rows as they come (w8a8's were a transposed view,
    which the loop's C++ RMSNorm refused mid-step; tests/quant/test_methods.py holds every method's
    rows contiguous)."""
    make_tiny_model("llama-gqa-llama3-rope", tmp_path)
    write_tiny_tokenizer(tmp_path)  # w8a8 calibrates on text
    kw = dict(quantization=method, skip_tokenizer_init=False)
    with_loop = _generate(_engine(str(tmp_path), "bfloat16", True, monkeypatch, **kw), PROMPTS[:3])
    assert with_loop == _generate(_engine(str(tmp_path), "bfloat16", False, monkeypatch, **kw), PROMPTS[:3])


def test_awq_is_built_after_its_calibration(tmp_path, monkeypatch):
    """The worker builds the loop once calibration has quantized the layers (before, AWQ's had no
    quantized runtime, and the loop had to call the layers themselves): it takes their GEMV form,
    and matches the modules."""
    make_tiny_model("llama-mha-tied", tmp_path)
    write_tiny_tokenizer(tmp_path)  # AWQ calibrates on text
    kw = dict(quantization="awq", skip_tokenizer_init=False)
    loop_engine = _engine(str(tmp_path), "bfloat16", True, monkeypatch, **kw)
    assert loop_engine.runner.decode_graphs.native is not None  # the int4 GEMV form of the calibrated layers
    with_loop = _generate(loop_engine, PROMPTS[:2])
    assert with_loop == _generate(_engine(str(tmp_path), "bfloat16", False, monkeypatch, **kw), PROMPTS[:2])


@pytest.mark.parametrize("num_prompts", [2, 8])
def test_default_gguf_model_matches_the_modules(num_prompts, monkeypatch):
    """The default model (Q4_1 int4 planes, bfloat16): the loop calls the planes directly, and its
    steps run as one C++ call: on the GEMV up to int4_gemv.MAX_ROWS rows, past it on the dense
    copy's panels."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300], [7, 7], [42] * 9, [11, 12, 13], [500], [64, 65], [3, 1, 4, 1, 5]]
    prompts = prompts[:num_prompts]
    steps = []
    engine = _count_steps(_engine(None, "bfloat16", True, monkeypatch, kv_cache_memory_gb=0.05), steps)
    if engine.runner.decode_graphs.panel_steps is not None:
        _count_panel_steps(engine, steps)
    native = _generate(engine, prompts)
    python_loop = _generate(_engine(None, "bfloat16", True, monkeypatch, native=False, kv_cache_memory_gb=0.05), prompts)
    modules = _generate(_engine(None, "bfloat16", False, monkeypatch, kv_cache_memory_gb=0.05), prompts)
    if int4_gemv.fast() if num_prompts <= int4_gemv.MAX_ROWS else panel_linear.available():  # its C++ step runs here
        assert steps and set(steps) == {num_prompts}
    assert native == python_loop == modules


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
