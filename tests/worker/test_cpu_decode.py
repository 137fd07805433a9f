"""The CPU decode loop (worker/cpu_decode.py) computes what the model's modules compute, bit for
bit: the same kernels on the same tensors, without the modules around them. An engine with the
loop is held to one built with `enforce_eager=True` (decodes through the modules), and the C++
step to the loop's Python form (`CpuDecodeLoop(..., native=False)`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_cuda_graphs import _generate
from tiny_models import make_tiny_model, write_tiny_tokenizer

from kvflow.config import EngineArgs
from kvflow.engine.llm_engine import LLMEngine
from kvflow.model.layers import cpu_ops
from kvflow.quant import int4_gemv, panel_linear, registry
from kvflow.quant.base import QuantizationConfig, QuantMethod, set_weight_attrs
from kvflow.quant.kernel_plan import PanelPlan
from kvflow.worker.cpu_decode import CpuDecodeLoop

PROMPTS = [[5, 17, 3, 88, 40, 2, 9, 61, 33, 12, 7, 70, 1, 4], [44, 45], [90, 3, 3, 3, 8, 11], [7] * 21, [60, 61, 62],
           [8, 9, 10, 11], [90, 1], [30, 31, 32, 33, 34, 35, 36, 37, 38]]


@pytest.fixture(autouse=True)
def kernels_built():
    if cpu_ops.load() is None:
        pytest.skip("the C++ CPU kernels cannot be built here")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama-gqa-llama3-rope", path)
    return str(path)


def _engine(model: str, dtype: str, loop: bool, native: bool = True, **kw) -> LLMEngine:
    """An engine with the decode loop (`native=False`: always in Python), or decoding through the
    modules (`enforce_eager`)."""
    engine = LLMEngine(EngineArgs(model, dtype=dtype, enforce_eager=not loop,
                                  **{"skip_tokenizer_init": True, "num_kv_blocks": 64, "disable_log_stats": True, **kw}))
    runner = engine.runner
    assert isinstance(runner.decode_graphs, CpuDecodeLoop) == loop
    if loop and not native:
        runner.decode_graphs = CpuDecodeLoop.build(runner.model, runner.kv_caches, native=False)
    return engine


def _count_steps(engine: LLMEngine, steps: list[int]) -> LLMEngine:
    """Records the rows of each step the C++ step ran."""
    run = engine.runner.decode_graphs._run_native
    engine.runner.decode_graphs._run_native = lambda hidden, *a: steps.append(hidden.shape[0]) or run(hidden, *a)
    return engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_prompts", [1, 5])
def test_loop_matches_the_modules(llama_dir, dtype, num_prompts):
    replayed, native = [], []
    loop_engine = _count_steps(_engine(llama_dir, dtype, True), native)
    loop = loop_engine.runner.decode_graphs
    run = loop.run
    loop.run = lambda *a: replayed.append(a[2][0].num_requests) or run(*a)
    with_loop = _generate(loop_engine, PROMPTS[:num_prompts])
    without = _generate(_engine(llama_dir, dtype, False), PROMPTS[:num_prompts])
    assert replayed and max(replayed) == num_prompts  # decode steps did go through the loop
    # float32 weights multiply by their own call (no plan the C++ step runs); bf16 ones on panels
    assert bool(native) == (dtype == "bfloat16" and panel_linear.available())
    assert with_loop == without  # tokens and logprobs, bit for bit


@pytest.mark.parametrize("num_prompts", [1, 3, 5])
def test_cpp_step_matches_the_python_loop_and_the_modules(llama_dir, num_prompts):
    """int4 projections in bfloat16 run as one C++ call per step up to int4_gemv.MAX_ROWS rows
    (steps of five run the Python loop)."""
    if not int4_gemv.fast():
        pytest.skip("no AVX-512 BF16 here: the few-row GEMV the C++ step calls is not used")
    steps = []
    kw = dict(quantization="int4")
    native = _generate(_count_steps(_engine(llama_dir, "bfloat16", True, **kw), steps),
                       PROMPTS[:num_prompts])
    python_loop = _generate(_engine(llama_dir, "bfloat16", True, native=False, **kw), PROMPTS[:num_prompts])
    modules = _generate(_engine(llama_dir, "bfloat16", False, **kw), PROMPTS[:num_prompts])
    assert steps == [num_prompts] * len(steps) and bool(steps) == (num_prompts <= int4_gemv.MAX_ROWS)
    assert native == python_loop == modules


@pytest.mark.parametrize("quantization,num_prompts", [(None, 1), (None, 5), ("int4", 8)])
def test_cpp_step_on_panels_matches_the_python_loop_and_the_modules(llama_dir, quantization, num_prompts):
    """bf16 products on the panel kernel (a bf16 model's packed weights at any row count; int4
    planes' dense copy past int4_gemv.MAX_ROWS) run as one C++ call per decode step, the first
    too."""
    if not panel_linear.available():
        pytest.skip("no AVX-512 BF16 here: no panel kernel")
    steps = []
    kw = dict(quantization=quantization)
    native = _generate(_count_steps(_engine(llama_dir, "bfloat16", True, **kw), steps),
                       PROMPTS[:num_prompts])
    python_loop = _generate(_engine(llama_dir, "bfloat16", True, native=False, **kw), PROMPTS[:num_prompts])
    modules = _generate(_engine(llama_dir, "bfloat16", False, **kw), PROMPTS[:num_prompts])
    decode_steps = len(next(iter(native.values()))[0]) - 1  # every token but the prompt step's
    assert steps == [num_prompts] * decode_steps
    assert native == python_loop == modules


@pytest.mark.parametrize("quantization,num_prompts", [("int4", 1), (None, 3)])
def test_speculative_verifications_run_in_the_loop_and_match_the_modules(llama_dir, quantization, num_prompts):
    """A verification's k + 1 rows per request are attended in place by the paged kernel in the
    modules too (cpu_paged.takes): the loop takes those steps (the C++ step where its products
    can: int4's GEMV up to 8 rows, bf16 panels at any), with the same numbers. Prompts that repeat
    themselves, so that n-gram lookups propose on most steps."""
    if not panel_linear.available():
        pytest.skip("no AVX-512 BF16 here: the C++ step's bf16 products are not used")
    prompts = [[3, 4, 5, 6, 7] * 4, [9, 8, 7] * 5, [20, 21, 22, 23] * 4][:num_prompts]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False, "prompt_lookup_min": 1}
    kw = dict(quantization=quantization, speculative_config=spec)
    steps, loop_rows = [], []
    loop_engine = _count_steps(_engine(llama_dir, "bfloat16", True, **kw), steps)
    loop = loop_engine.runner.decode_graphs
    run = loop.run
    loop.run = lambda ids, *a: loop_rows.append(ids.shape[0]) or run(ids, *a)
    native = _generate(loop_engine, prompts)
    python_loop = _generate(_engine(llama_dir, "bfloat16", True, native=False, **kw), prompts)
    modules = _generate(_engine(llama_dir, "bfloat16", False, **kw), prompts)
    assert any(rows > num_prompts for rows in loop_rows)  # verifications (k + 1 rows a request) took the loop
    assert steps and max(steps) > num_prompts  # ...and the C++ step
    assert native == python_loop == modules  # tokens and logprobs, bit for bit


def test_no_cpp_step_where_a_product_runs_elsewhere(llama_dir):
    """int8 rows (`--quantization int8`) past the GEMV's rows publish "call me" plans: every step
    stays in Python, and the row count is planned once."""
    engine = _engine(llama_dir, "bfloat16", True, quantization="int8")
    steps = []
    _generate(_count_steps(engine, steps), PROMPTS[:8])
    loop = engine.runner.decode_graphs
    assert steps == [] and list(loop.steps) == [8] and loop.steps[8].native is None


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("num_prompts", [1, 5])
def test_one_byte_kv_runs_in_the_loop_and_the_cpp_step(llama_dir, kv_cache_dtype, num_prompts):
    """An int8 / fp8 KV cache: the loop (and, up to int4_gemv.MAX_ROWS rows, the C++ step) writes
    with the quantizing op and reads the codes with the modules' kernel: their numbers, bit for bit."""
    steps = []
    kw = dict(quantization="int4", kv_cache_dtype=kv_cache_dtype)
    python_loop = _generate(_engine(llama_dir, "bfloat16", True, native=False, **kw), PROMPTS[:num_prompts])
    modules = _generate(_engine(llama_dir, "bfloat16", False, **kw), PROMPTS[:num_prompts])
    assert python_loop == modules
    if int4_gemv.fast():
        native = _generate(_count_steps(_engine(llama_dir, "bfloat16", True, **kw), steps),
                           PROMPTS[:num_prompts])
        assert bool(steps) == (num_prompts <= int4_gemv.MAX_ROWS)
        assert native == modules


@pytest.mark.parametrize("method", ["int8", "w8a8", "fp8", "mxfp4"])
def test_every_weight_format_matches_the_modules(tmp_path, method):
    """The loop takes the quantized embedding's rows as they come (w8a8's were a transposed view,
    which the loop's C++ RMSNorm refused mid-step; tests/quant/test_methods.py holds every method's
    rows contiguous)."""
    make_tiny_model("llama-gqa-llama3-rope", tmp_path)
    write_tiny_tokenizer(tmp_path)  # w8a8 calibrates on text
    kw = dict(quantization=method, skip_tokenizer_init=False)
    with_loop = _generate(_engine(str(tmp_path), "bfloat16", True, **kw), PROMPTS[:3])
    assert with_loop == _generate(_engine(str(tmp_path), "bfloat16", False, **kw), PROMPTS[:3])


def test_awq_is_built_after_its_calibration(tmp_path):
    """The worker builds the loop once calibration has quantized the layers (before, AWQ's had no
    quantized runtime, and the loop had to call the layers themselves): it takes their GEMV form,
    and matches the modules."""
    make_tiny_model("llama-mha-tied", tmp_path)
    write_tiny_tokenizer(tmp_path)  # AWQ calibrates on text
    kw = dict(quantization="awq", skip_tokenizer_init=False)
    steps = []
    loop_engine = _count_steps(_engine(str(tmp_path), "bfloat16", True, **kw), steps)
    with_loop = _generate(loop_engine, PROMPTS[:2])
    assert steps or not int4_gemv.fast()  # the int4 GEMV form of the calibrated layers, in C++
    assert with_loop == _generate(_engine(str(tmp_path), "bfloat16", False, **kw), PROMPTS[:2])


@pytest.mark.parametrize("num_prompts", [2, 8])
def test_default_gguf_model_matches_the_modules(num_prompts):
    """The default model (Q4_1 int4 planes, bfloat16): the loop calls the planes directly, and its
    steps run as one C++ call: on the GEMV up to int4_gemv.MAX_ROWS rows, past it on the dense
    copy's panels."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300], [7, 7], [42] * 9, [11, 12, 13], [500], [64, 65], [3, 1, 4, 1, 5]]
    prompts = prompts[:num_prompts]
    steps = []
    engine = _count_steps(_engine(None, "bfloat16", True, kv_cache_memory_gb=0.05), steps)
    native = _generate(engine, prompts)
    python_loop = _generate(_engine(None, "bfloat16", True, native=False, kv_cache_memory_gb=0.05), prompts)
    modules = _generate(_engine(None, "bfloat16", False, kv_cache_memory_gb=0.05), prompts)
    if int4_gemv.fast() if num_prompts <= int4_gemv.MAX_ROWS else panel_linear.available():  # its C++ step runs here
        assert steps and set(steps) == {num_prompts}
    assert native == python_loop == modules


@pytest.mark.parametrize("name", ["mistral-window", "qwen2-bias", "qwen3-qknorm"])
def test_models_it_does_not_take_run_through_the_modules(tmp_path, name):
    make_tiny_model(name, tmp_path)
    engine = LLMEngine(EngineArgs(str(tmp_path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
                                  disable_log_stats=True))
    assert engine.runner.decode_graphs is None
    assert len(_generate(engine, PROMPTS[:2])) == 2


@pytest.mark.parametrize("args", [dict(custom_ops="none"), dict(enforce_eager=True)])
def test_not_with_the_kernels_off_nor_eager(llama_dir, args):
    """`custom_ops="none"` (the torch code, which the loop's kernels are not) and `enforce_eager`
    (decode through the modules) build no loop."""
    engine = LLMEngine(EngineArgs(llama_dir, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
                                  disable_log_stats=True, **args))
    assert engine.runner.decode_graphs is None


class _PanelsEverywhere(QuantMethod):
    """A stand-in quant method the decode step was never told about: bf16 weights laid out as
    panels once, every product on the panel kernel, published as its kernel plan."""

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        weight = torch.nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype), requires_grad=False)
        layer.register_parameter("weight", set_weight_attrs(weight, output_dim=0, input_dim=1,
                                                            weight_loader=layer.weight_loader))

    def process_weights_after_loading(self, layer):
        layer.panels = panel_linear.pack(layer.weight)

    def apply(self, layer, x, bias=None):
        rows = x.reshape(-1, x.shape[-1])
        if x.dtype != torch.bfloat16 or not panel_linear.takes(rows.shape[0], layer.weight.shape):
            return F.linear(x, layer.weight, bias)
        y = panel_linear.linear(rows.contiguous(), layer.panels, bias)
        return y.view(*x.shape[:-1], y.shape[-1])

    def kernel_plan(self, layer, rows, dtype):
        if dtype != torch.bfloat16 or not panel_linear.takes(rows, layer.weight.shape):
            return super().kernel_plan(layer, rows, dtype)
        return PanelPlan(layer.panels, False, panel_linear.has_tiles())


class _PanelsEverywhereConfig(QuantizationConfig):
    name = "panels-everywhere"

    def __init__(self, group_size=None, from_saved=False):
        pass

    def get_quant_method(self, kind, prefix):
        return _PanelsEverywhere() if kind == "linear" else None


@pytest.mark.parametrize("num_prompts", [1, 5])
def test_a_quant_method_publishing_its_plan_is_taken_by_the_cpp_step(llama_dir, num_prompts, monkeypatch):
    """A quant method cpu_decode.py has never heard of runs in the C++ step through the plan it
    publishes (quant/kernel_plan.py), and matches its own modules bit for bit."""
    if not panel_linear.available():
        pytest.skip("no AVX-512 BF16 here: no panel kernel")
    online = registry._online_configs
    monkeypatch.setattr(registry, "_online_configs", lambda: {**online(), "panels-everywhere": _PanelsEverywhereConfig})
    steps = []
    kw = dict(quantization="panels-everywhere")
    native = _generate(_count_steps(_engine(llama_dir, "bfloat16", True, **kw), steps), PROMPTS[:num_prompts])
    modules = _generate(_engine(llama_dir, "bfloat16", False, **kw), PROMPTS[:num_prompts])
    decode_steps = len(next(iter(native.values()))[0]) - 1
    assert steps == [num_prompts] * decode_steps
    assert native == modules


def test_the_step_lays_out_only_what_it_runs(llama_dir):
    """A bf16 model's MLPs decode on their gated pairs' panels: asking gate_up for its plans must
    not lay out the plain product's panels too (a second copy of the weight nothing multiplies)."""
    if not panel_linear.available():
        pytest.skip("no AVX-512 BF16 here: no panel kernel")
    engine = _engine(llama_dir, "bfloat16", True)
    _generate(engine, PROMPTS[:5])
    gate_ups = [layer.mlp.gate_up_proj for layer in engine.runner.model.model.layers]
    assert all(layer.gated is not None and layer.packed_weight.panels is None for layer in gate_ups)
    assert all(layer.mlp.down_proj.packed_weight.panels is not None for layer in engine.runner.model.model.layers)
