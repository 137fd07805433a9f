"""The LoRA shrink/expand Triton kernels against the torch forms of `LoRABatch.add_lora`: fused
and single layers, adapters of ranks 8 and 16 in layers of max rank 16, rows without an adapter,
segments of odd lengths, float32 and bfloat16. Without a GPU they run under TRITON_INTERPRET=1
(tests/conftest.py); with one, on it. Sizes are tiny so the interpreter takes seconds.
"""

from __future__ import annotations

import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from peft_adapters import make_adapter  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from kvflow import EngineArgs, LLMEngine, LoRARequest, SamplingParams  # noqa: E402
from kvflow.bench.engine_shapes import Step, engine_shapes  # noqa: E402
from kvflow.bench.gpu_kernels import LORA_ADAPTERS, lora_cases  # noqa: E402
from kvflow.kernel_launch import KernelLaunch  # noqa: E402
from kvflow.lora import layers as lora_layers  # noqa: E402
from kvflow.lora.batch import LoRABatch  # noqa: E402
from kvflow.lora.layers import LoRAContext, LoRALinear  # noqa: E402
from kvflow.lora.triton_ops import add_lora, lora_expand_launch, lora_shrink_launch  # noqa: E402
from kvflow.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MAX_LORAS, MAX_RANK = 3, 16
LAYERS = {
    "qkv": lambda: QKVParallelLinear(24, 8, 4, 2),  # slices of 32, 16 and 16 columns
    "gate_up": lambda: MergedColumnParallelLinear(24, [40, 40]),
    "down": lambda: RowParallelLinear(40, 24),
    "wide": lambda: RowParallelLinear(600, 24),  # the shrink splits its 600 features 256, 256, 88
}


def _lora_layer(make_layer, dtype: torch.dtype, seed: int) -> LoRALinear:
    """Slot 0 rank 16, slot 1 rank 8 leaving slice 1 alone, slot 2 rank 8: random weights."""
    gen = torch.Generator().manual_seed(seed)
    base = make_layer().to(dtype)
    for param in base.parameters():  # created empty: whatever bits the allocator left, NaN included
        param.copy_(torch.randn(param.shape, generator=gen) / 4)
    lora = LoRALinear(base, MAX_LORAS, MAX_RANK, LoRAContext(), dtype, DEVICE)
    for slot, rank in enumerate((16, 8, 8)):
        lora.set_slot(slot, {i: (torch.randn(rank, base.input_size, generator=gen).to(dtype) / 4,
                                 torch.randn(size, rank, generator=gen).to(dtype) / 4)
                             for i, size in enumerate(base.output_sizes) if not (slot == 1 and i == 1)})
    return lora


ROW_SLOTS = [
    [0, 0, 0, 2, 2, -1, -1, 1, 1, 1, 1],  # sorted runs, odd lengths, a run without an adapter
    [2, -1, 0, 2, 1, 1, -1, 0, 0],  # interleaved: a run per row or two
    [-1] * 3 + [1] * 70,  # one long run: two row tiles of 64 in one segment
    [1],  # one decode row
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("row_slots", ROW_SLOTS)
def test_kernels_match_the_torch_forms(layer, row_slots, dtype):
    lora = _lora_layer(LAYERS[layer], dtype, seed=len(row_slots))
    x = (torch.randn(len(row_slots), lora.input_size, generator=torch.Generator().manual_seed(1))).to(dtype).to(DEVICE)
    batch = LoRABatch.build(row_slots, dtype, DEVICE, masked=False)
    y = torch.randn(len(row_slots), sum(lora.output_sizes), generator=torch.Generator().manual_seed(2)).to(dtype)
    y = y.to(DEVICE)
    expected = y.clone()
    batch.add_lora(expected, x, lora.lora_a, lora.lora_b)
    got = y.clone()
    add_lora(got, x, lora.lora_a, lora.lora_b, batch, MAX_RANK, lora.out_slices)
    plain = [r for r, s in enumerate(row_slots) if s < 0]
    assert torch.equal(got[plain], y[plain])  # rows without an adapter get exactly nothing
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:  # t and the sum are rounded to bf16 where torch rounds them; summation order differs
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-6, atol=2**-6)
        assert (got != expected).float().mean().item() < 0.05


def test_a_segment_without_an_adapter_adds_nothing():
    """A segment table may carry slot -1 runs: their programs write nothing, neither t nor y."""
    lora = _lora_layer(LAYERS["qkv"], torch.float32, seed=0)
    x = torch.randn(5, lora.input_size, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    batch = LoRABatch.build([0, 0, 0, 1, 1], device=DEVICE, masked=False)
    with_gap = LoRABatch([(0, 0, 2), (-1, 2, 3), (1, 3, 5)], 5, None,
                         torch.tensor([[0, 0, 2], [-1, 2, 3], [1, 3, 5]], dtype=torch.int32, device=DEVICE))
    y, got = torch.zeros(5, 64, device=DEVICE), torch.zeros(5, 64, device=DEVICE)
    batch.add_lora(y, x, lora.lora_a, lora.lora_b)
    add_lora(got, x, lora.lora_a, lora.lora_b, with_gap, MAX_RANK, lora.out_slices)
    assert torch.equal(got[2], torch.zeros(64, device=DEVICE))
    torch.testing.assert_close(got[[0, 1, 3, 4]], y[[0, 1, 3, 4]], rtol=1e-5, atol=1e-5)


def test_launch_shapes_follow_the_segments():
    """Decode segments take one 16-row tile and split a wide input over programs; a long segment
    takes tiles of 64 rows; ranks pad to tl.dot's 16."""
    meta = dict(device="meta")
    decode = LoRABatch.build([0, 1, 1, 2], **meta, masked=False)
    shrink, part = lora_shrink_launch(torch.empty(4, 24, **meta), torch.empty(MAX_LORAS, 3 * 8, 24, **meta), decode)
    assert shrink.grid == (3, 1, 1) and shrink.constexprs["BLOCK_M"] == 16 and shrink.constexprs["BLOCK_R"] == 32
    assert part.shape == (1, 4, 24) and part.dtype == torch.float32
    shrink, part = lora_shrink_launch(torch.empty(4, 4096, **meta), torch.empty(MAX_LORAS, 16, 4096, **meta), decode)
    assert shrink.grid == (3, 1, 16) and part.shape == (16, 4, 16)  # 16 slices of 256 features
    prefill = LoRABatch.build([0] * 70, **meta, masked=False)
    expand = lora_expand_launch(torch.empty(70, 100, **meta), torch.empty(2, 70, 8, **meta),
                                torch.empty(MAX_LORAS, 8, 100, **meta), prefill)
    assert expand.grid == (1, 2, 2) and expand.constexprs["BLOCK_M"] == 64 and expand.constexprs["BLOCK_R"] == 16


def test_wrong_row_count_is_an_error():
    lora = _lora_layer(LAYERS["down"], torch.float32, seed=0)
    batch = LoRABatch.build([0, 1], device=DEVICE, masked=False)
    with pytest.raises(RuntimeError, match="got 3 rows in a step of 2 tokens"):
        add_lora(torch.zeros(3, 24), torch.zeros(3, 40), lora.lora_a, lora.lora_b, batch, MAX_RANK, lora.out_slices)


def test_layer_takes_the_kernels_only_on_cuda(monkeypatch):
    assert lora_layers.lora_kernels_for(torch.zeros(1)) is None
    lora = _lora_layer(LAYERS["gate_up"], torch.float32, seed=3)
    row_slots = [0, 0, 1, -1, 2]
    x = torch.randn(5, lora.input_size, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    lora.context.batch = LoRABatch.build(row_slots, device=DEVICE, masked=False)
    expected = lora(x) if DEVICE.type == "cpu" else None
    calls = []
    monkeypatch.setattr(lora_layers, "lora_kernels_for", lambda x: lambda *a: (calls.append(a), add_lora(*a)))
    got = lora(x)
    assert len(calls) == 1
    if expected is not None:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_missing_triton_falls_back_to_torch(monkeypatch):
    lora_layers._load_kernels.cache_clear()
    monkeypatch.setattr(lora_layers, "triton_installed", lambda: False)
    monkeypatch.setitem(sys.modules, "triton", None)
    try:
        assert lora_layers._load_kernels() is None
    finally:
        lora_layers._load_kernels.cache_clear()


def test_engine_steps_launch_what_the_gpu_registry_compiles(tmp_path, monkeypatch):
    """A LoRA engine with the kernels forced on (interpreted on CPU) generates what the torch
    forms generate, and each step's launches equal, in all a compile sees, those that
    `kvflow bench gpu-compile` builds from shapes for the same step (bench/gpu_kernels.py)."""
    hf = make_tiny_model("llama-gqa-llama3-rope", tmp_path / "base")
    make_adapter(hf, tmp_path / "adapter", seed=2, r=8, lora_alpha=16)
    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    args = EngineArgs(str(tmp_path / "base"), dtype="float32", device=DEVICE.type, skip_tokenizer_init=True,
                      num_kv_blocks=32, disable_log_stats=True, enable_lora=True, max_loras=LORA_ADAPTERS,
                      enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=0, ignore_eos=True)
    prompt = list(range(3, 23))
    torch_form = LLMEngine(args)
    torch_form.add_request("0", prompt, params, lora_request=lora)
    expected = _run_to_end(torch_form)
    monkeypatch.setattr(lora_layers, "lora_kernels_for", lambda x: add_lora)
    recorded: list[KernelLaunch] = []
    run = KernelLaunch.__call__
    monkeypatch.setattr(KernelLaunch, "__call__", lambda launch: (recorded.append(launch), run(launch))[1])
    engine = LLMEngine(args)
    engine.add_request("0", prompt, params, lora_request=lora)
    shapes = engine_shapes(str(tmp_path / "base"), args, torch.float32)
    for step in (Step("prefill", (20,), (20,), graph=False), Step("decode", (1,), (21,), graph=False)):
        recorded.clear()
        engine.step()
        built = lora_cases(shapes, step)
        assert len(recorded) == len(built) * shapes.arch.num_layers
        assert {_compiled_view(x) for x in recorded} == {_compiled_view(c.launch) for c in built}
    got = _run_to_end(engine)
    assert got.token_ids == expected.token_ids
    torch.testing.assert_close([lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)],
                               [lp[t].logprob for lp, t in zip(expected.logprobs, expected.token_ids)],
                               rtol=1e-4, atol=1e-4)


def _run_to_end(engine: LLMEngine):
    while engine.has_unfinished_requests():
        finished = [o for o in engine.step() if o.finished]
    return finished[0].outputs[0]


def _compiled_view(launch: KernelLaunch) -> tuple:
    """What an ahead-of-time compile of the launch depends on (plus its grid)."""
    args = tuple((str(a.dtype), tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a for a in launch.args)
    return launch.name, launch.grid, args, tuple(sorted(launch.constexprs.items())), launch.num_warps
