"""AsyncLLM: one engine thread, many async streams; cancellation frees blocks at once; faults end
only the requests they touch; a dead loop says so. Tiny random model, token-id prompts."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from kvflow import LLM, EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from kvflow.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError
from live_server import wait_until
from tiny_models import make_tiny_model

DELTA = RequestOutputKind.DELTA
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, output_kind=DELTA)
LONG = GREEDY.clone(max_tokens=200)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    make_tiny_model("qwen2-bias", path)
    return str(path)


ENGINE = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=256, num_kv_blocks=64, disable_log_stats=True)


def engine_args(model_dir: str, **overrides) -> EngineArgs:
    return EngineArgs(model_dir, **{**ENGINE, **overrides})


@pytest.fixture
def make_llm(model_dir):
    """AsyncLLMs built by a test, shut down after it however it ends."""
    made = []

    def make(engine: LLMEngine | None = None, **overrides) -> AsyncLLM:
        made.append(AsyncLLM(engine or LLMEngine(engine_args(model_dir, **overrides))))
        return made[-1]

    yield make
    for llm in made:
        llm.shutdown(timeout=10)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def collect(llm: AsyncLLM, p, params: SamplingParams, request_id: str) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    async for out in llm.generate(p, params, request_id):
        for c in out.outputs:
            tokens.setdefault(c.index, []).extend(c.token_ids)
    return tokens


def idle(llm: AsyncLLM) -> bool:
    stats = llm.get_stats()
    return stats.kv_cache_usage == 0 and stats.num_running == 0 and stats.num_waiting == 0


def test_concurrent_streams_equal_llm_generate(model_dir, make_llm):
    prompts = [prompt(n, seed=n) for n in (3, 17, 40, 9)]
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=5, output_kind=DELTA)
    llm = make_llm()

    async def run():
        greedy = [collect(llm, p, GREEDY, f"g{i}") for i, p in enumerate(prompts)]
        return await asyncio.gather(*greedy, collect(llm, prompts[0], sampled, "s"))

    *streams, seeded = asyncio.run(run())
    reference = LLM(model_dir, **ENGINE)
    expected = reference.generate(prompts, GREEDY.clone(output_kind=RequestOutputKind.FINAL_ONLY), use_tqdm=False)
    assert [s[0] for s in streams] == [e.outputs[0].token_ids for e in expected]
    expected_n = reference.generate(prompts[0], sampled.clone(output_kind=RequestOutputKind.FINAL_ONLY), use_tqdm=False)[0]
    assert [seeded[i] for i in range(2)] == [c.token_ids for c in expected_n.outputs]


def test_bad_input_raises_before_any_output_and_queues_nothing(make_llm):
    llm = make_llm()

    async def run():
        for bad in ([], [1000], prompt(300)):  # empty, outside the vocabulary, over max_model_len
            with pytest.raises(ValueError):
                await llm.add_request("bad", bad, GREEDY)
        stream = await llm.add_request("dup", prompt(4), LONG)
        with pytest.raises(ValueError, match="already in use"):
            await llm.add_request("dup", prompt(4), GREEDY)
        stream.close()

    asyncio.run(run())
    assert wait_until(lambda: idle(llm), 10)
    assert llm.get_stats().prompt_tokens_total == 4  # only the accepted request counted


@pytest.mark.parametrize("how", ["cancel", "break"])
def test_leaving_a_stream_aborts_and_frees_blocks_at_once(make_llm, how):
    llm = make_llm()

    async def consume(seen: asyncio.Event):
        async for _ in llm.generate(prompt(20), LONG, "r"):
            seen.set()
            if how == "break":
                break

    async def run():
        seen = asyncio.Event()
        task = asyncio.create_task(consume(seen))
        await asyncio.wait_for(seen.wait(), 30)
        assert llm.get_stats().kv_cache_usage > 0
        if how == "cancel":
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    assert wait_until(lambda: idle(llm), 5)
    assert llm.get_stats().generation_tokens_total < 100  # stopped long before its 200 tokens


def test_failed_step_fails_its_requests_and_the_engine_goes_on(model_dir, make_llm):
    engine = LLMEngine(engine_args(model_dir, max_num_seqs=1))  # the second request has to wait
    real_step, calls = engine.step, []

    def flaky_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return real_step()

    engine.step = flaky_step
    llm = make_llm(engine)

    async def run():
        return await asyncio.gather(collect(llm, prompt(5), GREEDY, "running"),
                                    collect(llm, prompt(6, seed=1), GREEDY, "waiting"), return_exceptions=True)

    running, waiting = asyncio.run(run())
    assert isinstance(running, RequestFailedError)
    assert len(waiting[0]) == GREEDY.max_tokens  # never scheduled in the failed step: unharmed
    assert llm.is_alive() and wait_until(lambda: idle(llm), 5)
    assert len(asyncio.run(collect(llm, prompt(7), GREEDY, "after"))[0]) == GREEDY.max_tokens


def test_failed_add_fails_only_that_request(model_dir, make_llm):
    engine = LLMEngine(engine_args(model_dir))
    real_add = engine.add_request

    def picky_add(request_id, *args, **kwargs):
        if request_id == "poison":
            raise KeyError("injected fault")
        return real_add(request_id, *args, **kwargs)

    engine.add_request = picky_add
    llm = make_llm(engine)

    async def run():
        return await asyncio.gather(collect(llm, prompt(5), GREEDY, "poison"),
                                    collect(llm, prompt(5), GREEDY, "fine"), return_exceptions=True)

    poisoned, fine = asyncio.run(run())
    assert isinstance(poisoned, RequestFailedError) and len(fine[0]) == GREEDY.max_tokens


class _Fatal(BaseException):
    """Escapes the step's `except Exception`, as a fault in the loop itself would."""


def test_dead_loop_fails_everyone_and_says_so(model_dir, make_llm):
    engine = LLMEngine(engine_args(model_dir))
    real_step = engine.step

    def fatal_after_prefill():
        if engine.scheduler.num_running:
            raise _Fatal()
        return real_step()

    engine.step = fatal_after_prefill
    llm = make_llm(engine)
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(llm, prompt(5), GREEDY, "doomed"))
    assert wait_until(lambda: not llm.is_alive(), 5)
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(llm, prompt(5), GREEDY, "late"))


def test_shutdown_ends_in_flight_requests_as_aborted(make_llm):
    llm = make_llm()

    async def run():
        stream = await llm.add_request("r", prompt(8), LONG)
        await anext(stream)
        llm.shutdown(wait=False)
        return [out async for out in stream]

    rest = asyncio.run(run())
    assert rest[-1].finished and rest[-1].outputs[-1].finish_reason == "abort"
    assert wait_until(lambda: not llm.is_alive(), 10)
    with pytest.raises(EngineDeadError):
        asyncio.run(llm.add_request("new", prompt(3), GREEDY))


def test_requests_from_many_event_loops_and_an_abandoned_one(make_llm):
    llm = make_llm()
    results: dict[int, dict] = {}

    def worker(i: int) -> None:
        results[i] = asyncio.run(collect(llm, prompt(6, seed=i), GREEDY, f"loop{i}"))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(len(results[i][0]) == GREEDY.max_tokens for i in range(4))

    async def abandon():  # accepted, never read: its loop closes under it
        await llm.add_request("orphan", prompt(6), LONG)

    asyncio.run(abandon())
    assert wait_until(lambda: idle(llm), 10)  # the engine noticed the dead loop and aborted it
    assert llm.get_stats().generation_tokens_total < 4 * GREEDY.max_tokens + 100


def test_finished_requests_report_their_timings(make_llm):
    llm = make_llm()
    finished = []
    llm.add_finish_listener(finished.append)
    asyncio.run(collect(llm, prompt(5), GREEDY.clone(n=2, temperature=1.0, seed=3), "timed"))

    async def aborted():
        async for _ in llm.generate(prompt(5), LONG, "aborted"):
            break

    asyncio.run(aborted())
    assert wait_until(lambda: idle(llm), 5)
    assert [f.request_id for f in finished] == ["timed"]  # aborted requests are not counted
    f = finished[0]
    assert 0 <= f.time_to_first_token <= f.e2e_latency
    assert len(f.inter_token_latencies) == 2 * (GREEDY.max_tokens - 1)  # each completion's tokens after its first
    assert all(gap >= 0 for gap in f.inter_token_latencies)


def test_an_add_taken_in_the_same_batch_as_a_stop_is_refused_not_lost(model_dir, monkeypatch):
    from kvflow.engine.engine_thread import AddCommand, EngineThread, StopCommand

    loop = asyncio.new_event_loop()
    accepted = loop.create_future()
    late = AddCommand("late", prompt(3), GREEDY, 0.0, 0, None, loop, lambda item: None, accepted)
    batches = iter([[StopCommand(), late]])
    monkeypatch.setattr(EngineThread, "_take", lambda self, block: next(batches))
    thread = EngineThread(LLMEngine(engine_args(model_dir)), on_finished=lambda finished: None)
    thread.join(10)
    with pytest.raises(EngineDeadError):
        loop.run_until_complete(asyncio.wait_for(accepted, 10))
    loop.close()
