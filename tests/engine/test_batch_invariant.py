"""`batch_invariant=True`: a bfloat16 request's tokens and logprobs are bit for bit the same alone,
beside other requests, with its prompt cut into other chunks, and through speculative steps."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from kvflow import LLM, EngineArgs, SamplingParams
from kvflow.attention import cpu_paged
from kvflow.model.layers import cpu_ops
from kvflow.model.layers.batch_invariant import ROW_TILE, RowTiledMethod
from kvflow.quant.int4pack import Int4Planes, planes_from_affine
from kvflow.quant.unquantized import UnquantizedMethod
from kvflow.worker.cpu_decode import CpuDecodeLoop

GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-wide")
    make_tiny_model("llama-wide", path)
    return str(path)


def _llm(model_dir, **kw) -> LLM:
    return LLM(model_dir, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=512, num_kv_blocks=128,
               batch_invariant=True, **kw)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _tokens_and_logprobs(output) -> list:
    c = output.outputs[0]
    return [(t, sorted((k, lp.logprob) for k, lp in step.items())) for t, step in zip(c.token_ids, c.logprobs)]


# int4: without the mode, its own kernel up to 4 rows and a dense copy above (both tests fail with
# the mode switched off in worker.load_model). int8 / fp8 (E4M3, E5M2) KV: the paged kernel reads the
# codes in place, each position's codes and scale fixed by its own K and V (these fail without the
# mode too).
@pytest.mark.parametrize("quantization, kv_cache_dtype", [(None, "auto"), ("int4", "auto"), (None, "int8"),
                                                          (None, "fp8"), (None, "fp8_e5m2")])
def test_a_request_is_bit_identical_alone_batched_and_chunked(model_dir, quantization, kv_cache_dtype, monkeypatch):
    # Paged attention takes bf16 scores on AMX tiles only for calls of enough keys: between this
    # request's keys alone (<= 164 per KV head pair) and the busy batch's, so that outside the mode
    # the two would run different score paths.
    monkeypatch.setattr(cpu_paged, "TILES_MIN_KEYS", 300)
    target = _prompt(70, seed=1)
    others = [_prompt(n, seed=n) for n in (3, 130, 17, 45)]
    kw = dict(quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    alone = _llm(model_dir, **kw).generate([target], GREEDY, use_tqdm=False)[0]
    # Small token budget: the prompts are cut into different chunks and run beside other decodes.
    chunked = _llm(model_dir, max_num_batched_tokens=24, **kw)
    busy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    mixed = chunked.generate(others[:2] + [target] + others[2:], [busy, busy, GREEDY, busy, busy], use_tqdm=False)[2]
    assert _tokens_and_logprobs(mixed) == _tokens_and_logprobs(alone)


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_decode_steps_are_bit_identical_alone_and_beside_others(model_dir, quantization, monkeypatch):
    # All prompts prefill in one step, then every step is decodes only: the C++/Python decode loop
    # (worker/cpu_decode.py) runs them. Its attention must not take the AMX scores for the busy
    # batch (enough keys) and the multiply-adds alone (too few).
    monkeypatch.setattr(cpu_paged, "TILES_MIN_KEYS", 300)
    if cpu_ops.load() is None:
        pytest.skip("the C++ CPU kernels cannot be built here")
    target = _prompt(70, seed=1)
    others = [_prompt(n, seed=n) for n in (90, 110, 60)]
    alone = _llm(model_dir, quantization=quantization).generate([target], GREEDY, use_tqdm=False)[0]
    llm = _llm(model_dir, quantization=quantization)
    assert isinstance(llm.llm_engine.runner.decode_graphs, CpuDecodeLoop)
    mixed = llm.generate([target] + others, GREEDY, use_tqdm=False)[0]
    assert _tokens_and_logprobs(mixed) == _tokens_and_logprobs(alone)


def test_speculative_steps_give_the_same_tokens_and_logprobs(model_dir):
    # The target as its own draft: every proposal is accepted, so each token after the first is
    # computed in a 6-query verification step instead of a 1-query decode (int4 weights: the
    # two run different matmul kernels).
    prompt = _prompt(40, seed=3)
    plain = _llm(model_dir, quantization="int4").generate([prompt], GREEDY, use_tqdm=False)[0]
    spec = _llm(model_dir, quantization="int4", speculative_config={
        "method": "draft_model", "model": model_dir, "num_speculative_tokens": 5, "adaptive": False})
    out = spec.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert spec.llm_engine.get_stats().spec_decoding.num_accepted_tokens > 0
    assert _tokens_and_logprobs(out) == _tokens_and_logprobs(plain)


def test_row_tiles_give_each_row_the_same_bits_whatever_the_batch():
    layer = torch.nn.Linear(256, 300, bias=True).to(torch.bfloat16)
    method = RowTiledMethod(UnquantizedMethod())
    x = torch.randn(2 * ROW_TILE + 5, 256, dtype=torch.bfloat16)
    full = method.apply(layer, x, layer.bias)
    assert full.shape == (2 * ROW_TILE + 5, 300)
    torch.testing.assert_close(full, torch.nn.functional.linear(x, layer.weight, layer.bias))
    for rows in (slice(0, 1), slice(7, 9), slice(ROW_TILE - 1, 2 * ROW_TILE + 5)):
        assert torch.equal(method.apply(layer, x[rows], layer.bias), full[rows])


def test_int4_planes_give_each_row_the_same_bits_at_any_row_count():
    # What the mode relies on to run int4 layers untiled: aten's int4 kernel never mixes rows, and
    # the layer no longer switches to its dense copy above KERNEL_MAX_ROWS.
    gen = torch.Generator().manual_seed(0)
    n, k, group = 96, 128, 32
    u = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) / 8
    planes = Int4Planes(planes_from_affine(u, scale, -8 * scale, 4), group, torch.bfloat16, "test")
    planes.use_kernel_at_any_rows()
    assert planes.dense is None
    x = torch.randn(70, k, generator=gen).to(torch.bfloat16)
    full = planes(x)
    for rows in (slice(0, 1), slice(3, 5), slice(10, 70)):
        assert torch.equal(planes(x[rows]), full[rows])
    reference = x.float() @ planes.dequantize(torch.float32).t()
    torch.testing.assert_close(full.float(), reference, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("field, value", [("attention_backend", "torch_reference"), ("tensor_parallel_size", 2)])
def test_what_the_mode_does_not_cover_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        EngineArgs(batch_invariant=True, **{field: value}).create_config(512)


def test_a_mixture_of_experts_is_refused(tmp_path):
    make_tiny_model("mixtral", tmp_path)
    with pytest.raises(ValueError, match="batch_invariant"):
        _llm(str(tmp_path))
