"""Decode steps through DecodeGraphs' static, padded buffers.

On CPU the triton kernels run interpreted and nothing is captured: `DecodeGraphs.run` then runs
the very computation a graph records (inputs copied into the static buffers, the batch padded up
to its bucket) eagerly, so padding and buffer reuse are checked here; the capture itself is
checked only where CUDA exists.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from kvflow import SamplingParams
from kvflow.attention.metadata import AttentionMetadata
from kvflow.config import EngineArgs
from kvflow.engine.llm_engine import LLMEngine
from kvflow.worker.cuda_graphs import DecodeGraphs, decode_buckets

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 17, 3, 88, 40, 2, 9, 61, 33, 12, 7, 70, 1, 4], [44, 45], [90, 3, 3, 3, 8, 11], [7] * 21, [60, 61, 62]]


def test_buckets_cover_every_batch_size():
    assert decode_buckets(1) == [1]
    assert decode_buckets(2) == [1, 2]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert decode_buckets(128)[-3:] == [112, 120, 128]
    graphs_for_20 = decode_buckets(20)
    assert all(any(b >= n for b in graphs_for_20) for n in range(1, 21))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model("qwen2-hybrid-window", path)  # GQA, one windowed layer, two full ones
    return str(path)


def _engine(model_dir: str, **kw) -> LLMEngine:
    args = EngineArgs(model_dir, attention_backend="triton", dtype="float32", skip_tokenizer_init=True,
                      device=DEVICE, num_kv_blocks=64, disable_log_stats=True, **kw)
    return LLMEngine(args)


def _with_uncaptured_graphs(engine: LLMEngine, max_num_seqs: int) -> list[int]:
    """Route the engine's decode steps through DecodeGraphs without capturing; returns a list
    that records each replayed batch size."""
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, max_num_seqs,
                          engine.config.model.max_model_len, runner.device, len(engine.arch.kv_layout.groups))
    sizes: list[int] = []
    run = graphs.run

    def counting_run(input_ids, positions, meta):
        sizes.append(meta[0].num_requests)
        return run(input_ids, positions, meta)

    graphs.run = counting_run
    runner.decode_graphs = graphs
    return sizes


def _generate(engine: LLMEngine, prompts) -> dict[str, tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                results[out.request_id] = (c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
    return results


@pytest.mark.parametrize("num_prompts", [1, 3, 5])
def test_padded_decode_matches_eager(model_dir, num_prompts):
    prompts = PROMPTS[:num_prompts]
    eager = _generate(_engine(model_dir, enforce_eager=True), prompts)
    engine = _engine(model_dir, enforce_eager=True)
    replayed_sizes = _with_uncaptured_graphs(engine, max_num_seqs=8)
    padded = _generate(engine, prompts)
    assert replayed_sizes and max(replayed_sizes) == num_prompts  # 3 → bucket 4, 5 → bucket 8: padded
    for rid, (tokens, logprobs) in eager.items():
        assert padded[rid][0] == tokens
        torch.testing.assert_close(torch.tensor(padded[rid][1]), torch.tensor(logprobs), atol=1e-5, rtol=0)


def test_padding_rows_write_no_kv(model_dir):
    engine = _engine(model_dir, enforce_eager=True)
    runner, groups = engine.runner, len(engine.arch.kv_layout.groups)
    caches = [torch.zeros_like(c) for c in runner.kv_caches]
    graphs = DecodeGraphs(runner.model, caches, 16, max_num_seqs=4, max_model_len=512, device=runner.device,
                          num_kv_groups=groups)
    slots = torch.tensor([3 * 16 + 4, 7 * 16 + 0, 9 * 16 + 15], device=runner.device)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(4, device=runner.device), seq_lens=torch.tensor([5, 1, 16], device=runner.device),
        block_tables=torch.tensor([[3], [7], [9]], device=runner.device), slot_mapping=slots, block_size=16,
        query_lens_cpu=[1, 1, 1], seq_lens_cpu=[5, 1, 16],
    )
    hidden = graphs.run(torch.tensor([1, 2, 3], device=runner.device), meta.seq_lens - 1, (meta,) * groups)
    assert hidden.shape[0] == 3 and torch.isfinite(hidden).all()
    for cache in caches:  # 3 requests in bucket 4: the padded row must not have written anywhere
        for slot in slots.tolist():
            block, offset = divmod(slot, 16)
            assert torch.count_nonzero(cache[:, block, :, offset]) > 0
            cache[:, block, :, offset] = 0
        assert torch.count_nonzero(cache) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_captured_graphs_match_eager(model_dir):
    eager = _generate(_engine(model_dir, enforce_eager=True), PROMPTS)
    engine = _engine(model_dir, max_num_seqs=8)
    assert engine.runner.decode_graphs is not None and len(engine.runner.decode_graphs.graphs) == 4  # 1, 2, 4, 8
    replayed = _generate(engine, PROMPTS)
    for rid, (tokens, logprobs) in eager.items():
        assert replayed[rid][0] == tokens
        torch.testing.assert_close(torch.tensor(replayed[rid][1]), torch.tensor(logprobs), atol=1e-4, rtol=0)


def test_whole_gpu_path_matches_the_oracle(model_dir, monkeypatch):
    """Everything a GPU decode step runs except the capture: triton attention, the fused layer
    kernels (forced on for CPU tensors) and the padded static buffers, against the float32 torch
    reference with plain torch layers."""
    from kvflow.model.layers import activation, norm, rotary, triton_ops

    oracle = _generate(LLMEngine(EngineArgs(model_dir, attention_backend="torch_reference", dtype="float32",
                                            skip_tokenizer_init=True, device="cpu", disable_log_stats=True)), PROMPTS)
    kernels = triton_ops._load()
    for module in (activation, norm, rotary):
        monkeypatch.setattr(module, "kernels_for", lambda x: kernels)
    engine = _engine(model_dir, enforce_eager=True)
    replayed_sizes = _with_uncaptured_graphs(engine, max_num_seqs=8)
    gpu_path = _generate(engine, PROMPTS)
    assert max(replayed_sizes) == len(PROMPTS)
    for rid, (tokens, logprobs) in oracle.items():
        assert gpu_path[rid][0] == tokens
        torch.testing.assert_close(torch.tensor(gpu_path[rid][1]), torch.tensor(logprobs), atol=1e-4, rtol=0)
