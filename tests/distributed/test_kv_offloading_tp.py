"""KV offloading under tensor parallel: each rank saves and loads its own part of every block (its
KV heads, under its rank key, in its own tiers), and the ranks agree before a request proceeds: a
load lands when every rank has its part, and fails on every rank when any rank's part is gone."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from kvflow import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams

B = 8
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
SMALL_HOST_GIB = 4 * (2048 + 48) / (1 << 30)  # four blocks of a rank's half of the tiny model's KV


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPT = tokens(100, 1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama-gqa-llama3-rope", path)
    return str(path)


def run_alone(engine: LLMEngine, request_id: str, prompt: list[int]) -> list[int]:
    engine.add_request(request_id, {"prompt_token_ids": prompt}, GREEDY)
    done = None
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            return done
        done = next((list(o.outputs[0].token_ids) for o in engine.step() if o.finished), done)
    raise AssertionError("the request never finished")


@pytest.fixture
def tp_engine(model_dir, tmp_path):
    """Two ranks; each rank's host tier holds four blocks, the rest go to its disk directory."""
    engine = LLMEngine(EngineArgs(model=model_dir, dtype="float32", skip_tokenizer_init=True, block_size=B,
                                  disable_log_stats=True, num_kv_blocks=24, tensor_parallel_size=2,
                                  distributed_timeout_s=30, kv_offloading_size=SMALL_HOST_GIB,
                                  kv_offloading_disk_path=str(tmp_path / "disk"), kv_offloading_disk_size=0.01))
    yield engine
    engine.shutdown()


def _offload_then_evict(engine: LLMEngine) -> list[int]:
    """PROMPT's output; its blocks then left the pool and both ranks' host tiers."""
    want = run_alone(engine, "first", PROMPT)
    for i in range(3):
        run_alone(engine, f"other{i}", tokens(100, 10 + i))
    engine.model_executor.driver_worker.kv_offload.io.submit(lambda: None).result(timeout=60)
    return want


@pytest.mark.timeout(300, method="thread")
def test_every_rank_loads_its_part_and_the_request_proceeds(tp_engine):
    want = _offload_then_evict(tp_engine)
    before = tp_engine.get_stats()
    assert run_alone(tp_engine, "again", PROMPT) == want
    after = tp_engine.get_stats()
    assert after.prefix_cache_hits_total - before.prefix_cache_hits_total == 96
    assert after.kv_transfer_bytes_total > before.kv_transfer_bytes_total
    assert tp_engine.scheduler.kv_cache.pool.num_free_blocks == 24


@pytest.mark.timeout(300, method="thread")
def test_a_part_missing_on_one_rank_fails_the_load_on_every_rank(tp_engine, tmp_path):
    want = _offload_then_evict(tp_engine)
    for path in (tmp_path / "disk" / "rank1").iterdir():  # rank 0's lookup still finds its own parts
        path.unlink()
    before = tp_engine.get_stats()
    assert run_alone(tp_engine, "again", PROMPT) == want
    after = tp_engine.get_stats()
    assert after.kv_transfer_bytes_total == before.kv_transfer_bytes_total  # computed on both ranks
    assert tp_engine.scheduler.kv_cache.pool.num_free_blocks == 24
