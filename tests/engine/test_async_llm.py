"""AsyncLLM: one engine thread, many async streams; cancellation frees blocks at once; faults end
only the requests they touch; a dead loop says so. Tiny random model, token-id prompts."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from live_server import wait_until
from tiny_models import make_tiny_model

from kvflow import LLM, EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from kvflow.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError

DELTA = RequestOutputKind.DELTA
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, output_kind=DELTA)
LONG = GREEDY.clone(max_tokens=200)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    make_tiny_model("qwen2-bias", path)
    return str(path)


TIMEOUT = 60  # seconds; the slowest test here needs a few
ENGINE = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=256, num_kv_blocks=64, disable_log_stats=True)


def run(coro):
    """asyncio.run with every wait inside bounded: a regression fails the test instead of hanging CI."""
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


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

    async def main():
        greedy = [collect(llm, p, GREEDY, f"g{i}") for i, p in enumerate(prompts)]
        return await asyncio.gather(*greedy, collect(llm, prompts[0], sampled, "s"))

    *streams, seeded = run(main())
    reference = LLM(model_dir, **ENGINE)
    expected = reference.generate(prompts, GREEDY.clone(output_kind=RequestOutputKind.FINAL_ONLY), use_tqdm=False)
    assert [s[0] for s in streams] == [e.outputs[0].token_ids for e in expected]
    expected_n = reference.generate(prompts[0], sampled.clone(output_kind=RequestOutputKind.FINAL_ONLY), use_tqdm=False)[0]
    assert [seeded[i] for i in range(2)] == [c.token_ids for c in expected_n.outputs]


def test_bad_input_raises_before_any_output_and_queues_nothing(make_llm):
    llm = make_llm()

    async def main():
        for bad in ([], [1000], prompt(300)):  # empty, outside the vocabulary, over max_model_len
            with pytest.raises(ValueError):
                await llm.add_request("bad", bad, GREEDY)
        stream = await llm.add_request("dup", prompt(4), LONG)
        with pytest.raises(ValueError, match="already in use"):
            await llm.add_request("dup", prompt(4), GREEDY)
        stream.close()

    run(main())
    assert wait_until(lambda: idle(llm), 10)
    assert llm.get_stats().prompt_tokens_total == 4  # only the accepted request counted


def finish_reasons(outputs: list) -> list[str]:
    return [c.finish_reason for out in outputs for c in out.outputs if c.finish_reason]


def test_a_cancelled_duplicate_add_leaves_the_original_alone(make_llm):
    llm = make_llm()

    async def main():
        original = await llm.add_request("dup", prompt(4), GREEDY)
        refused = asyncio.create_task(llm.add_request("dup", prompt(4), GREEDY))
        await asyncio.sleep(0)  # its add is sent; it is waiting for the engine's answer
        refused.cancel()
        await asyncio.gather(refused, return_exceptions=True)
        return [out async for out in original]

    assert finish_reasons(run(main())) == ["length"]


def test_closing_a_finished_stream_spares_a_new_request_with_its_id(make_llm):
    llm = make_llm()

    async def add_once_free(params: SamplingParams):
        while True:  # refused while the first "reused" is still in the engine
            try:
                return await llm.add_request("reused", prompt(5), params)
            except ValueError:
                await asyncio.sleep(0.01)

    async def main():
        first = await llm.add_request("reused", prompt(4), GREEDY.clone(max_tokens=1))
        second = await add_once_free(GREEDY.clone(max_tokens=50))
        first.close()  # never read: as far as it knows, its request is still running
        return [out async for out in second]

    assert finish_reasons(run(main())) == ["length"]


def test_an_n_request_whose_completion_ids_are_taken_is_refused_whole(make_llm):
    llm = make_llm()

    async def main():
        taken = await llm.add_request("x#1", prompt(4), LONG)  # long: still running when "x" comes
        with pytest.raises(ValueError, match="already in use"):
            await llm.add_request("x", prompt(5), GREEDY.clone(n=2))
        return [out async for out in taken]

    assert finish_reasons(run(main())) == ["length"]
    assert wait_until(lambda: idle(llm), 5)
    assert llm.get_stats().generation_tokens_total == LONG.max_tokens  # "x#0" was never queued


@pytest.mark.parametrize("how", ["cancel", "break"])
def test_leaving_a_stream_aborts_and_frees_blocks_at_once(make_llm, how):
    llm = make_llm()

    async def consume(seen: asyncio.Event):
        async for _ in llm.generate(prompt(20), LONG, "r"):
            seen.set()
            if how == "break":
                break

    async def main():
        seen = asyncio.Event()
        task = asyncio.create_task(consume(seen))
        await asyncio.wait_for(seen.wait(), 30)
        assert llm.get_stats().kv_cache_usage > 0
        if how == "cancel":
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    run(main())
    assert wait_until(lambda: idle(llm), 5)
    assert llm.get_stats().generation_tokens_total < 100  # stopped long before its 200 tokens


def test_failed_step_fails_its_requests_and_the_engine_goes_on(model_dir, make_llm):
    engine = LLMEngine(engine_args(model_dir, max_num_seqs=1))  # the second request has to wait
    real_execute, calls = engine.runner.execute, []

    def flaky_execute(sched):  # inside the step: after scheduling, before anything is updated
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return real_execute(sched)

    engine.runner.execute = flaky_execute
    llm = make_llm(engine)

    async def main():
        return await asyncio.gather(collect(llm, prompt(5), GREEDY, "running"),
                                    collect(llm, prompt(6, seed=1), GREEDY, "waiting"), return_exceptions=True)

    running, waiting = run(main())
    assert isinstance(running, RequestFailedError)
    assert len(waiting[0]) == GREEDY.max_tokens  # never scheduled in the failed step: unharmed
    assert llm.is_alive() and wait_until(lambda: idle(llm), 5)
    assert len(run(collect(llm, prompt(7), GREEDY, "after"))[0]) == GREEDY.max_tokens


def test_a_request_preempted_by_a_failed_step_fails_with_it(model_dir, make_llm):
    # Swapped out by the step that failed: its KV never reached the host, so resuming would read garbage.
    engine = LLMEngine(engine_args(model_dir, num_kv_blocks=6, preemption_mode="swap", swap_space_gb=0.01))
    real_execute, fired = engine.runner.execute, []

    def execute(sched):
        if sched.swap_out and not fired:
            fired.append(sched.swap_out)
            raise RuntimeError("injected fault")
        return real_execute(sched)

    engine.runner.execute = execute
    llm = make_llm(engine)
    params = GREEDY.clone(max_tokens=40)  # 20 + 40 tokens: 4 blocks each, 6 for both

    async def main():
        return await asyncio.gather(collect(llm, prompt(20, seed=1), params, "kept"),
                                    collect(llm, prompt(20, seed=2), params, "swapped"), return_exceptions=True)

    results = run(main())
    assert fired and all(isinstance(r, RequestFailedError) for r in results)
    assert wait_until(lambda: idle(llm), 5)
    host = engine.scheduler.host_pool
    assert host.num_free_blocks == host.num_blocks
    assert len(run(collect(llm, prompt(7), GREEDY, "after"))[0]) == GREEDY.max_tokens


def test_failed_add_fails_only_that_request_and_queues_none_of_it(model_dir, make_llm):
    engine = LLMEngine(engine_args(model_dir))
    real_add = engine.output_processor.add_request

    def picky_add(request, parent, index):
        if index == 1 and parent.request_id == "poison":  # its first completion is queued by now
            raise KeyError("injected fault")
        return real_add(request, parent, index)

    engine.output_processor.add_request = picky_add
    llm = make_llm(engine)

    async def main():
        return await asyncio.gather(collect(llm, prompt(5), GREEDY.clone(n=2), "poison"),
                                    collect(llm, prompt(5), GREEDY, "fine"), return_exceptions=True)

    poisoned, fine = run(main())
    assert isinstance(poisoned, RequestFailedError) and len(fine[0]) == GREEDY.max_tokens
    assert wait_until(lambda: idle(llm), 5)
    assert llm.get_stats().generation_tokens_total == GREEDY.max_tokens  # nothing of "poison" ran


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
        run(collect(llm, prompt(5), GREEDY, "doomed"))
    assert wait_until(lambda: not llm.is_alive(), 5)
    with pytest.raises(EngineDeadError):
        run(collect(llm, prompt(5), GREEDY, "late"))


def test_shutdown_fails_in_flight_requests_never_ends_them_as_if_finished(make_llm):
    llm = make_llm()

    async def main():
        stream = await llm.add_request("r", prompt(8), LONG)
        await anext(stream)
        llm.shutdown(wait=False, reason="going away")
        return [out async for out in stream]

    with pytest.raises(EngineDeadError, match="going away"):
        run(main())
    assert wait_until(lambda: llm.get_stats().kv_cache_usage == 0, 10)
    assert wait_until(lambda: not llm.is_alive(), 10)
    with pytest.raises(EngineDeadError):
        run(llm.add_request("new", prompt(3), GREEDY))


def test_requests_from_many_event_loops_and_an_abandoned_one(make_llm):
    llm = make_llm()
    results: dict[int, dict] = {}

    def worker(i: int) -> None:
        results[i] = run(collect(llm, prompt(6, seed=i), GREEDY, f"loop{i}"))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(len(results[i][0]) == GREEDY.max_tokens for i in range(4))

    async def abandon():  # accepted, never read: its loop closes under it
        await llm.add_request("orphan", prompt(6), LONG)

    run(abandon())
    assert wait_until(lambda: idle(llm), 10)  # the engine noticed the dead loop and aborted it
    assert llm.get_stats().generation_tokens_total < 4 * GREEDY.max_tokens + 100


def test_finished_requests_report_their_timings(make_llm):
    llm = make_llm()
    finished = []
    llm.add_finish_listener(finished.append)
    run(collect(llm, prompt(5), GREEDY.clone(n=2, temperature=1.0, seed=3), "timed"))

    async def aborted():
        async for _ in llm.generate(prompt(5), LONG, "aborted"):
            break

    run(aborted())
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
    late = AddCommand("late", prompt(3), GREEDY, 0.0, 0, None, loop, lambda item: None, accepted, owner=None)
    batches = iter([[StopCommand(), late]])
    monkeypatch.setattr(EngineThread, "_take", lambda self, block: next(batches))
    thread = EngineThread(LLMEngine(engine_args(model_dir)), on_finished=lambda finished: None)
    thread.join(10)
    with pytest.raises(EngineDeadError):
        loop.run_until_complete(asyncio.wait_for(accepted, 10))
    loop.close()
