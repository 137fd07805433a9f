"""KV offloading (`--kv-offloading-size` and its tiers) in an engine: a prompt whose blocks left
the pool comes back from host memory, disk or a shared store with the outputs of a fresh
computation; a load runs beside the steps (the request waits in WAITING_FOR_REMOTE_KVS, the
others go on); a load that fails, hangs, or finds a malformed or foreign block makes its request
compute its prompt; preemption and abort of a waiting request cancel its load; no block leaks.

Steps are counted, never timed. A store that sleeps is a gate the test opens."""

from __future__ import annotations

import threading

import pytest
import torch
from live_server import wait_until
from redis_server import needs_redis, start_redis
from tiny_models import make_tiny_model

from kvflow import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from kvflow.core.request import RequestStatus
from kvflow.kv_store import KVBlockStore, KVStoreError

B = 8  # tokens per block
POOL = 24  # blocks: two 100-token prompts fit, a third pushes the first's blocks out
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
LOADABLE = 96  # a 100-token prompt's whole blocks before its last token


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama-gqa-llama3-rope", path)
    return str(path)


def make_engine(model_dir, **kw) -> LLMEngine:
    args = dict(model=model_dir, dtype="float32", skip_tokenizer_init=True, block_size=B, disable_log_stats=True,
                attention_backend="torch_reference", num_kv_blocks=POOL, kv_offloading_size=0.01)
    return LLMEngine(EngineArgs(**{**args, **kw}))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPT = tokens(100, 1)
OTHERS = [tokens(100, 10 + i) for i in range(3)]


@pytest.fixture(scope="module")
def reference(model_dir):
    """Each prompt's tokens from an engine that computes everything (no cache, no tiers)."""
    engine = make_engine(model_dir, enable_prefix_caching=False, kv_offloading_size=None)
    return {tuple(p): run_alone(engine, f"ref{i}", p) for i, p in enumerate([PROMPT, *OTHERS])}


def run_alone(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    return run_to_end(engine)[request_id]


def run_to_end(engine: LLMEngine, limit: int = 10_000) -> dict[str, list[int]]:
    done = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return done
        done.update((o.request_id, list(o.outputs[0].token_ids)) for o in engine.step() if o.finished)
    raise AssertionError(f"requests still unfinished after {limit} steps")


def worker(engine: LLMEngine):
    return engine.model_executor.driver_worker


def tiers(engine: LLMEngine) -> list[KVBlockStore]:
    return worker(engine).kv_offload_store.inner.tiers


def settle(engine: LLMEngine) -> None:
    """Wait until the I/O thread has written every save queued so far."""
    worker(engine).kv_offload.io.submit(lambda: None).result(timeout=60)


def offload_then_evict(engine: LLMEngine, reference) -> None:
    """PROMPT computed (and written through), then other prompts push its blocks out of the pool.
    Each request's saves are settled before the next: with a host tier of a few blocks, a save
    queued behind more than that is dropped by design, and whether one is depends on how fast the
    I/O thread runs beside the steps (a loaded machine dropped PROMPT's)."""
    assert run_alone(engine, "first", PROMPT) == reference[tuple(PROMPT)]
    settle(engine)
    for i, prompt in enumerate(OTHERS):
        assert run_alone(engine, f"other{i}", prompt) == reference[tuple(prompt)]
        settle(engine)


def loaded_bytes_and_hits(engine: LLMEngine, request_id: str, prompt: list[int]):
    """(output, KV bytes loaded, prefix-cache hit tokens) of one request run alone."""
    before = engine.get_stats()
    output = run_alone(engine, request_id, prompt)
    after = engine.get_stats()
    return (output, after.kv_transfer_bytes_total - before.kv_transfer_bytes_total,
            after.prefix_cache_hits_total - before.prefix_cache_hits_total)


def empty(store: KVBlockStore) -> None:
    if hasattr(store, "path"):  # a directory
        for path in store.path.iterdir():
            path.unlink()
    else:
        store.delete(store.keys())


@pytest.fixture
def redis_url():
    server = start_redis()
    yield server.url
    server.stop()


def gib(blocks: int) -> float:
    """The GiB of `blocks` offloaded blocks of the tiny model (4,096 bytes each, and a header)."""
    return blocks * (4096 + 48) / (1 << 30)


# The tiers above the one a block must come back from are a few blocks each: the four prompts'
# 48 blocks push PROMPT's down to it (and the test empties them, to be sure where it loads from).
TIER_SETUPS = {
    "host": lambda tmp, req: {},
    "disk": lambda tmp, req: {"kv_offloading_size": gib(4), "kv_offloading_disk_path": str(tmp / "disk"),
                              "kv_offloading_disk_size": 0.01},
    "shared directory": lambda tmp, req: {"kv_offloading_size": gib(4), "kv_offloading_disk_path": str(tmp / "disk"),
                                          "kv_offloading_disk_size": gib(4), "kv_offloading_remote_url": str(tmp / "shared")},
    "redis": lambda tmp, req: {"kv_offloading_size": gib(4), "kv_offloading_remote_url": req.getfixturevalue("redis_url")},
}


@pytest.mark.parametrize("tier", ["host", "disk", "shared directory", pytest.param("redis", marks=needs_redis)])
def test_a_prompt_whose_blocks_left_the_pool_comes_back_from_each_tier(tier, model_dir, reference, tmp_path, request):
    engine = make_engine(model_dir, **TIER_SETUPS[tier](tmp_path, request))
    offload_then_evict(engine, reference)
    stores = tiers(engine)
    for store in stores[:-1] if tier != "host" else []:
        empty(store)
    output, loaded, hits = loaded_bytes_and_hits(engine, "again", PROMPT)
    assert output == reference[tuple(PROMPT)]
    assert loaded == (LOADABLE // B) * worker(engine).kv_offload.block_bytes  # loaded, not found in the pool
    assert hits == LOADABLE
    assert engine.scheduler.kv_cache.pool.num_free_blocks == POOL


class GatedStore(KVBlockStore):
    """A store whose `get` waits for the test to open the gate (a slow tier), then answers, or
    raises (`dies`: the store went away mid-load); lookups and puts pass straight through."""

    def __init__(self, inner: KVBlockStore, dies: bool = False) -> None:
        self.inner, self.location, self.dies = inner, inner.location, dies
        self.gate = threading.Event()
        self.gets = 0

    def lookup(self, keys):
        return self.inner.lookup(keys)

    def put(self, blocks):
        return self.inner.put(blocks)

    def get(self, keys):
        self.gets += 1
        self.gate.wait()  # until the test opens it (every fixture does, at its end)
        if self.dies:
            raise KVStoreError("the store died mid-load")
        return self.inner.get(keys)

    def delete(self, keys):
        self.inner.delete(keys)


def gate(engine: LLMEngine, dies: bool = False) -> GatedStore:
    """Both connector halves share rank 0's tiers: gating them once gates both."""
    namespaced = worker(engine).kv_offload_store
    namespaced.inner = GatedStore(namespaced.inner, dies)
    return namespaced.inner


@pytest.fixture
def gated(model_dir, reference):
    """An engine whose PROMPT's blocks are in its tiers only, and whose tiers wait at the gate."""
    engines = []

    def make(dies: bool = False, **kw):
        engine = make_engine(model_dir, **kw)
        offload_then_evict(engine, reference)
        engines.append((engine, gate(engine, dies)))
        return engines[-1]

    yield make
    for _, store in engines:
        store.gate.set()  # the I/O thread's call returns


def status(engine: LLMEngine, request_id: str) -> RequestStatus:
    return engine.scheduler.requests[request_id].status


def test_a_request_waiting_for_a_slow_load_does_not_stall_another_running_request(gated, reference):
    engine, store = gated()
    engine.add_request("running", {"prompt_token_ids": tokens(20, 50)},  # in no tier: it computes
                       SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()
    engine.add_request("loading", {"prompt_token_ids": PROMPT}, GREEDY)
    engine.step()
    assert status(engine, "loading") is RequestStatus.WAITING_FOR_REMOTE_KVS
    # The I/O thread reaches the load when it has written the saves queued before it.
    assert wait_until(lambda: store.gets == 1, timeout=60)
    produced = engine.scheduler.requests["running"].num_output_tokens
    for _ in range(10):
        engine.step()
        assert status(engine, "loading") is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert engine.scheduler.requests["running"].num_output_tokens == produced + 10  # one token every step
    store.gate.set()
    before = engine.get_stats()
    done = run_to_end(engine)
    assert done["loading"] == reference[tuple(PROMPT)]
    assert engine.get_stats().kv_transfer_bytes_total > before.kv_transfer_bytes_total  # it was loaded
    assert engine.scheduler.kv_cache.pool.num_free_blocks == POOL


def test_a_store_that_dies_mid_load_makes_the_request_compute_its_prompt(gated, reference):
    engine, store = gated(dies=True)
    engine.add_request("loading", {"prompt_token_ids": PROMPT}, GREEDY)
    engine.step()
    assert status(engine, "loading") is RequestStatus.WAITING_FOR_REMOTE_KVS
    store.gate.set()
    before = engine.get_stats()
    assert run_to_end(engine)["loading"] == reference[tuple(PROMPT)]
    after = engine.get_stats()
    assert after.kv_transfer_bytes_total == before.kv_transfer_bytes_total  # nothing loaded: computed
    assert engine.scheduler.kv_cache.pool.num_free_blocks == POOL
    assert not worker(engine).kv_offload.pending


def test_a_load_that_never_answers_times_out_and_the_request_computes(gated, reference):
    engine, store = gated()  # the gate stays shut until the test ends: the store hangs
    worker(engine).kv_offload.load_timeout_s = 0.2
    engine.add_request("loading", {"prompt_token_ids": PROMPT}, GREEDY)
    before = engine.get_stats()
    assert run_to_end(engine, limit=1000)["loading"] == reference[tuple(PROMPT)]
    assert engine.get_stats().kv_transfer_bytes_total == before.kv_transfer_bytes_total  # computed, not loaded
    assert store.gets == 1
    assert engine.scheduler.kv_cache.pool.num_free_blocks == POOL
    assert not worker(engine).kv_offload.pending


def _swap_blocks(blocks):  # each key gets the next key's (well-formed) block: a foreign block
    return [(key, blocks[(i + 1) % len(blocks)][1]) for i, (key, _) in enumerate(blocks)]


CORRUPTIONS = {
    "garbage of the right size": lambda blocks: [(key, bytes(len(blob))) for key, blob in blocks],
    "truncated": lambda blocks: [(key, bytes(blob)[:-1]) for key, blob in blocks],
    "another block's": _swap_blocks,
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_malformed_or_foreign_block_is_refused_and_the_request_computes(corruption, model_dir, reference, caplog):
    engine = make_engine(model_dir)
    offload_then_evict(engine, reference)
    host = tiers(engine)[0]
    keys = host.keys()
    host.put(CORRUPTIONS[corruption](list(zip(keys, host.get(keys)))))
    output, loaded, _ = loaded_bytes_and_hits(engine, "again", PROMPT)
    assert output == reference[tuple(PROMPT)]
    assert loaded == 0
    assert "refused" in caplog.text
    assert engine.scheduler.kv_cache.pool.num_free_blocks == POOL


def test_abort_while_waiting_for_a_load_frees_everything(gated, reference):
    engine, store = gated()
    engine.add_request("loading", {"prompt_token_ids": PROMPT}, GREEDY)
    engine.step()
    assert engine.scheduler.kv_cache.pool.num_free_blocks < POOL  # its blocks are allocated
    engine.abort_request("loading")
    assert engine.scheduler.kv_cache.pool.num_free_blocks == POOL
    assert not engine.has_unfinished_requests()
    engine.step()  # the worker hears of the cancel before anything could be copied
    assert not worker(engine).kv_offload.pending
    store.gate.set()
    settle(engine)
    # The pool and the engine go on as before: the prompt loads again, landing whole.
    assert run_alone(engine, "again", PROMPT) == reference[tuple(PROMPT)]
    assert engine.scheduler.kv_cache.pool.num_free_blocks == POOL


def test_preempting_a_request_waiting_for_its_load_cancels_it_and_frees_its_blocks(gated, reference):
    engine, store = gated(scheduling_policy="priority")
    engine.add_request("loading", {"prompt_token_ids": PROMPT}, GREEDY, priority=1)
    engine.step()
    assert status(engine, "loading") is RequestStatus.WAITING_FOR_REMOTE_KVS
    # A more urgent request that needs the whole pool (its 180-token prompt: 23 blocks) takes its blocks.
    engine.add_request("urgent", {"prompt_token_ids": tokens(180, 99)}, GREEDY, priority=0)
    engine.step()
    assert status(engine, "loading") is not RequestStatus.WAITING_FOR_REMOTE_KVS
    assert engine.scheduler.num_preemptions_total == 1
    store.gate.set()
    done = run_to_end(engine)
    assert done["loading"] == reference[tuple(PROMPT)]
    assert engine.scheduler.kv_cache.pool.num_free_blocks == POOL
    assert not worker(engine).kv_offload.pending


def test_a_request_with_the_same_prefix_waits_for_the_load_instead_of_sharing_unloaded_blocks(gated, reference):
    engine, store = gated()
    engine.add_request("loading", {"prompt_token_ids": PROMPT}, GREEDY)
    engine.step()
    engine.add_request("same", {"prompt_token_ids": PROMPT}, GREEDY)
    for _ in range(3):
        engine.step()
        assert status(engine, "same") is RequestStatus.WAITING  # held back: the blocks are not there yet
    store.gate.set()
    done = run_to_end(engine)
    assert done["loading"] == done["same"] == reference[tuple(PROMPT)]
    assert engine.scheduler.kv_cache.pool.num_free_blocks == POOL


def test_output_blocks_are_offloaded_too_so_a_next_turn_loads_the_whole_conversation(model_dir, reference):
    """Multi-turn chat: the next prompt is the last prompt, its answer and a new message."""
    engine = make_engine(model_dir)
    answer = run_alone(engine, "turn1", PROMPT[:60], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                                   output_kind=RequestOutputKind.FINAL_ONLY))
    for i, prompt in enumerate(OTHERS):
        run_alone(engine, f"other{i}", prompt)
    settle(engine)
    turn2 = PROMPT[:60] + answer + tokens(20, 7)
    fresh = make_engine(model_dir, enable_prefix_caching=False, kv_offloading_size=None)
    output, loaded, hits = loaded_bytes_and_hits(engine, "turn2", turn2)
    assert output == run_alone(fresh, "turn2", turn2)
    # 60 prompt + 19 computed answer tokens (the last is sampled, never computed): 9 whole blocks.
    assert hits == 72 and loaded == 9 * worker(engine).kv_offload.block_bytes


def test_a_request_waiting_for_its_load_holds_its_sequence_slot(gated, reference):
    engine, store = gated(max_num_seqs=1)
    engine.add_request("loading", {"prompt_token_ids": PROMPT}, GREEDY)
    engine.step()
    engine.add_request("next", {"prompt_token_ids": OTHERS[1][:40]}, GREEDY)
    for _ in range(3):
        engine.step()
        assert status(engine, "next") is RequestStatus.WAITING
    store.gate.set()
    done = run_to_end(engine)
    assert done["loading"] == reference[tuple(PROMPT)]
    assert engine.scheduler.kv_cache.pool.num_free_blocks == POOL


def test_a_load_writes_only_into_its_own_fresh_blocks(gated, reference):
    """The blocks the prefix cache still holds (the last prompt's) and every other block keep their
    bytes while a load lands; the loading request's blocks change, nothing else does."""
    engine, store = gated()
    engine.add_request("loading", {"prompt_token_ids": PROMPT}, GREEDY)
    engine.step()
    own = set(engine.scheduler.kv_cache.block_ids("loading")[0])
    cached = set(engine.scheduler.kv_cache.pool.cached.values())
    pools = worker(engine).kv_offload.pools
    before = [pool.clone() for pool in pools]
    store.gate.set()
    for _ in range(100):
        engine.step()
        if status(engine, "loading") is RequestStatus.RUNNING:
            break
    assert status(engine, "loading") is RequestStatus.RUNNING  # landed; its first chunk not run yet
    changed = {b for b in range(POOL) if any(not torch.equal(p[:, b], q[:, b]) for p, q in zip(pools, before))}
    assert changed == own
    assert cached and not cached & own
    assert run_to_end(engine)["loading"] == reference[tuple(PROMPT)]
