"""Shared by the disaggregated prefill/decode tests: a tiny model, a KV store of each kind (a
shared directory; a Redis server), engines and pairs joined by one, and the single-engine reference
their outputs must equal."""

from __future__ import annotations

import pytest
import torch
from redis_server import needs_redis, start_redis
from tiny_models import make_tiny_model

from kvflow import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from kvflow.engine.disaggregated import DisaggregatedPrefillDecode
from kvflow.kv_store.redis_store import RedisKVStore

B = 8
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2,
                        output_kind=RequestOutputKind.FINAL_ONLY)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama-gqa-llama3-rope", path)
    return str(path)


class Store:
    """One store of a kind, as the engines' kv_transfer_config names it, and what it holds."""

    def __init__(self, kind: str, path, max_bytes: int = 1 << 30) -> None:
        self.kind, self.path, self.server = kind, path, None
        if kind == "redis":  # Redis' bound is its own maxmemory (approximate LRU): not max_bytes
            self.server = start_redis()
            self.extra = {"kv_connector": "RedisStoreConnector",
                          "kv_connector_extra_config": {"kv_store_url": self.server.url}}
        else:
            self.extra = {"kv_connector_extra_config": {"shared_storage_path": str(path), "max_store_bytes": max_bytes}}

    def config(self, role: str) -> dict:
        return {"kv_role": role, **self.extra}

    def contents(self) -> list:
        """What the store holds (for the directory: every file, temporary ones too)."""
        if self.kind == "redis":
            return RedisKVStore(self.server.url).keys()
        return sorted(p.name for p in self.path.iterdir()) if self.path.exists() else []


def _stores(kind: str, tmp_path):
    stores = []

    def make(max_bytes: int = 1 << 30) -> Store:
        stores.append(Store(kind, tmp_path / f"kv{len(stores)}", max_bytes))
        return stores[-1]

    yield make
    for store in stores:
        if store.server is not None:
            store.server.stop()


@pytest.fixture(params=["directory", pytest.param("redis", marks=needs_redis)])
def make_store(request, tmp_path):
    yield from _stores(request.param, tmp_path)


@pytest.fixture
def make_exactly_bounded_store(tmp_path):
    """The directory store, whose `max_bytes` evicts exactly the least recently used blocks."""
    yield from _stores("directory", tmp_path)


@pytest.fixture
def store(make_store) -> Store:
    return make_store()


def make_engine(model_dir, role=None, store=None, **kw) -> LLMEngine:
    args = dict(model=model_dir, dtype="float32", skip_tokenizer_init=True, block_size=B, disable_log_stats=True,
                attention_backend="torch_reference", num_kv_blocks=256)
    if role is not None:
        args["kv_transfer_config"] = (store.config(role) if isinstance(store, Store) else
                                      {"kv_role": role, "kv_connector_extra_config": {"shared_storage_path": str(store)}})
    return LLMEngine(EngineArgs(**{**args, **kw}))


def make_pair(model_dir, store, **kw) -> DisaggregatedPrefillDecode:
    return DisaggregatedPrefillDecode(make_engine(model_dir, "kv_producer", store, **kw),
                                      make_engine(model_dir, "kv_consumer", store, **kw))


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(model_dir, prompts, params: SamplingParams = GREEDY, **kw) -> list:
    single = make_engine(model_dir, enable_prefix_caching=False, **kw)
    for i, prompt in enumerate(prompts):
        single.add_request(str(i), {"prompt_token_ids": prompt}, params)
    done = {}
    while single.has_unfinished_requests():
        done.update((o.request_id, o) for o in single.step() if o.finished)
    return [done[str(i)] for i in range(len(prompts))]


def assert_same(out, ref) -> None:
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    for got, want in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
        assert got.keys() == want.keys()
        for token, lp in got.items():
            assert lp.logprob == pytest.approx(want[token].logprob, abs=1e-4)
