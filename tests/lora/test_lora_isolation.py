"""One adapter's slot never reaches another row. Whatever a slot holds (NaN, ±inf, values whose
products overflow), the rows of the base model and of the other adapters come out bit for bit as
they do when the slot holds a sane adapter, in every form a step's deltas take: per segment,
masked (one shrink and expand over the step's slot range) and the Triton kernels (interpreted on
CPU, tests/conftest.py). The slot's weights are written straight into the stacked tensors, past
the loader's checks, so this holds whatever got into a slot. The engine-level test poisons an
adapter after it was loaded and checks that the requests batched next to it do not notice."""

from __future__ import annotations

import pytest
import torch
from peft_adapters import make_adapter
from tiny_models import make_tiny_model

from kvflow import EngineArgs, LLMEngine, LoRARequest, SamplingParams
from kvflow.lora.batch import LoRABatch
from kvflow.lora.layers import LoRAContext, LoRALinear
from kvflow.model.layers.linear import QKVParallelLinear, RowParallelLinear

MAX_LORAS, MAX_RANK = 4, 16
POISONS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "huge": 3e38}
LAYERS = {
    "qkv": lambda: QKVParallelLinear(24, 8, 4, 2),  # three slices of a block-diagonal B
    "wide": lambda: RowParallelLinear(600, 24),  # the Triton shrink splits its input features
}
# (each row's slot, the slot poisoned): the poisoned slot used by rows between others, at the
# range's ends, by no row (but inside the masked form's slot range), beside base rows only.
CASES = [
    ([0, 0, 1, 1, 2, 2, -1, -1], 1),
    ([2, -1, 0, 3, 1, 1, -1, 0, 3], 0),
    ([0, 1, 1, -1, 3, 3], 3),
    ([0, 0, -1, 3, 3], 2),
    ([-1, -1, 2, -1], 2),
]


def _layer(make_layer, dtype: torch.dtype, device: torch.device) -> LoRALinear:
    """Every slot holds a random adapter of rank 8 or 16 over every slice."""
    gen = torch.Generator().manual_seed(0)
    base = make_layer().to(dtype)
    for param in base.parameters():
        param.copy_(torch.randn(param.shape, generator=gen) / 4)
    lora = LoRALinear(base.to(device), MAX_LORAS, MAX_RANK, LoRAContext(), dtype, device)
    for slot in range(MAX_LORAS):
        rank = 16 if slot % 2 == 0 else 8
        lora.set_slot(slot, {i: (torch.randn(rank, base.input_size, generator=gen).to(dtype) / 4,
                                 torch.randn(size, rank, generator=gen).to(dtype) / 4)
                             for i, size in enumerate(base.output_sizes)})
    return lora


def _forward(lora: LoRALinear, x: torch.Tensor, row_slots: list[int], form: str, monkeypatch) -> torch.Tensor:
    """The layer's output with the step's deltas in `form`: masked or per segment (torch), or triton."""
    from kvflow.lora import layers as lora_layers

    if form == "triton":
        from kvflow.lora.triton_ops import add_lora

        monkeypatch.setattr(lora_layers, "lora_kernels_for", lambda x: add_lora)
    lora.context.batch = LoRABatch.build(row_slots, x.dtype, x.device, masked=form == "masked")
    return lora(x)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _device_and_forms() -> list[tuple[str, torch.device]]:
    cuda = torch.device("cuda") if torch.cuda.is_available() else None
    forms = [("segments", torch.device("cpu")), ("masked", torch.device("cpu"))]
    if cuda is not None:
        forms += [("segments", cuda), ("masked", cuda)]
    try:
        import triton  # noqa: F401
    except ImportError:
        return forms
    return forms + [("triton", cuda or torch.device("cpu"))]


@pytest.mark.parametrize("form,device", _device_and_forms(), ids=lambda v: str(v))
@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("poison", list(POISONS))
def test_a_poisoned_slot_changes_no_other_row(form, device, layer, dtype, poison, monkeypatch):
    lora = _layer(LAYERS[layer], dtype, device)
    x = torch.randn(9, lora.input_size, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    for row_slots, bad in CASES:
        rows = x[:len(row_slots)]
        clean = _forward(lora, rows, row_slots, form, monkeypatch)
        saved = lora.lora_a[bad].clone(), lora.lora_b[bad].clone()
        for tensor in ("lora_a", "lora_b", "both"):
            if tensor in ("lora_a", "both"):
                lora.lora_a[bad].fill_(POISONS[poison])
            if tensor in ("lora_b", "both"):
                lora.lora_b[bad].fill_(POISONS[poison])
            poisoned = _forward(lora, rows, row_slots, form, monkeypatch)
            others = [r for r, s in enumerate(row_slots) if s != bad]
            assert torch.equal(_bits(poisoned[others]), _bits(clean[others])), (row_slots, bad, tensor)
            lora.lora_a[bad].copy_(saved[0])
            lora.lora_b[bad].copy_(saved[1])


def test_the_slot_range_of_the_masked_form_spans_an_idle_poisoned_slot(monkeypatch):
    """The masked form's shrink multiplies every row by the A of every slot in [lo, hi), and its
    batched expand runs every slot of the range: a slot in it that no row uses (here slot 1,
    between 0 and 2) is still read, and must add nothing; base rows (-1) are not even written."""
    lora = _layer(LAYERS["qkv"], torch.float32, torch.device("cpu"))
    lora.lora_a[1].fill_(float("nan"))
    lora.lora_b[1].fill_(float("inf"))
    x = torch.randn(4, lora.input_size, generator=torch.Generator().manual_seed(2))
    got = _forward(lora, x, [0, -1, 2, 2], "masked", monkeypatch)
    assert LoRABatch.build([0, -1, 2, 2], masked=True).masked.first_slot == 0  # slot 1 is inside the range
    assert bool(got.isfinite().all())
    assert torch.equal(_bits(got[1]), _bits(lora.base_layer(x)[1]))


PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_a_poisoned_adapter_leaves_the_requests_batched_with_it_alone(tmp_path):
    """A request with a good adapter and a base request, each batched with a request of an adapter
    whose weights turned NaN after it was loaded, give the tokens they give alone."""
    hf = make_tiny_model("llama-gqa-llama3-rope", tmp_path / "base")
    good, bad = (LoRARequest(name, i, str(tmp_path / name)) for i, name in enumerate(("good", "bad"), start=1))
    make_adapter(hf, tmp_path / "good", seed=1)
    make_adapter(hf, tmp_path / "bad", seed=2)
    args = EngineArgs(str(tmp_path / "base"), dtype="float32", skip_tokenizer_init=True, enable_lora=True,
                      max_loras=2, max_lora_rank=8, disable_log_stats=True, enable_prefix_caching=False)
    prompts = {"good": list(range(3, 20)), "base": list(range(40, 52)), "bad": list(range(60, 75))}
    loras = {"good": good, "base": None, "bad": bad}
    alone = {}
    for name in ("good", "base"):
        engine = LLMEngine(args)
        engine.add_request(name, prompts[name], PARAMS, lora_request=loras[name])
        alone[name] = _run(engine)[name]
    engine = LLMEngine(args)
    for a, b in engine.runner.lora.load(bad).weights.values():  # host copy: what a slot is filled from
        a.fill_(float("nan"))
        b.fill_(float("nan"))
    steps = []
    execute = engine.runner.execute
    engine.runner.execute = lambda sched: steps.append({c.request_id for c in sched.chunks}) or execute(sched)
    for name in ("bad", "good", "base"):
        engine.add_request(name, prompts[name], PARAMS, lora_request=loras[name])
    got = _run(engine)
    assert all(len(step) == 3 for step in steps)  # the three shared every step
    assert got["good"] == alone["good"] and got["base"] == alone["base"]
    assert engine.kv_cache_usage == 0


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return finished
