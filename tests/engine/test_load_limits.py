"""The serving engine bounds its load (a full waiting queue refuses new requests as overloaded;
a burst is admitted a few per step, so running streams keep moving) and does not pretend to live
on after repeated step failures or a device fault: it dies, and says so to every caller."""

from __future__ import annotations

import asyncio

import pytest
import torch
from live_server import wait_until
from tiny_models import make_tiny_model

from kvflow import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from kvflow.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError, LoadLimits, RequestFailedError

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
LONG = GREEDY.clone(max_tokens=200)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama-mqa", path)
    return str(path)


@pytest.fixture
def make_llm(model_dir):
    made = []

    def make(limits: LoadLimits = LoadLimits(), **engine_args) -> AsyncLLM:
        engine = LLMEngine(EngineArgs(model_dir, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
                                      disable_log_stats=True, **engine_args))
        made.append(AsyncLLM(engine, limits))
        return made[-1]

    yield make
    for llm in made:
        llm.shutdown(timeout=10)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def prompt(seed: int) -> list[int]:
    return torch.randint(0, 97, (6,), generator=torch.Generator().manual_seed(seed)).tolist()


async def finish(llm: AsyncLLM, request_id: str, params: SamplingParams = GREEDY) -> list[int]:
    return [t async for out in llm.generate(prompt(len(request_id)), params, request_id) for t in out.outputs[0].token_ids]


def test_a_burst_is_admitted_a_few_requests_per_step(make_llm):
    llm = make_llm(LoadLimits(max_admissions_per_step=4))
    engine = llm._thread.engine
    events = []
    real_add, real_step = engine.add_request, engine.step
    engine.add_request = lambda *a, **k: events.append("add") or real_add(*a, **k)
    engine.step = lambda: events.append("step") or real_step()

    async def burst():
        return await asyncio.gather(*(finish(llm, f"r{i}") for i in range(20)))

    assert all(len(tokens) == 4 for tokens in run(burst()))
    runs = "".join("a" if e == "add" else "." for e in events).split(".")
    assert events.count("add") == 20 and max(len(r) for r in runs) <= 4


def test_a_full_waiting_queue_refuses_new_requests_as_overloaded(make_llm):
    llm = make_llm(LoadLimits(max_waiting_seqs=4), max_num_seqs=1)

    async def main():
        running = await llm.add_request("running", prompt(0), LONG)
        await anext(running)  # it holds the one slot: everything else waits
        waiting = [await llm.add_request(f"w{i}", prompt(i), GREEDY.clone(n=2)) for i in range(2)]
        with pytest.raises(EngineOverloadedError, match="4 completions are waiting"):
            await llm.add_request("one-too-many", prompt(9), GREEDY)
        for stream in [running, *waiting]:
            stream.close()

    run(main())
    assert wait_until(lambda: llm.get_stats().num_waiting == 0 and llm.get_stats().num_running == 0, 10)
    big = run(finish(llm, "big", GREEDY.clone(n=8)))  # an empty queue takes any request
    assert len(big) == 8 * 4  # every completion ran


def test_repeated_step_failures_kill_the_engine_and_a_success_resets_the_count(make_llm):
    llm = make_llm(LoadLimits(max_consecutive_step_failures=2))
    engine = llm._thread.engine
    real_step, faults = engine.step, []

    def step():
        outputs = real_step()
        if faults and faults.pop(0):  # after the work, e.g. while making outputs
            raise RuntimeError("injected step fault")
        return outputs

    engine.step = step
    for plan in ([True], [False], [True], [False]):  # never two failures in a row
        faults[:] = plan + [False] * 10
        if plan[0]:
            with pytest.raises(RequestFailedError):
                run(finish(llm, "x"))
        else:
            assert len(run(finish(llm, "x"))) == 4
    assert llm.is_alive()
    faults[:] = [True, True]
    with pytest.raises(RequestFailedError):
        run(finish(llm, "y"))
    with pytest.raises(RequestFailedError):
        run(finish(llm, "z"))
    assert wait_until(lambda: not llm.is_alive(), 10)
    with pytest.raises(EngineDeadError, match="2 engine steps failed in a row"):
        run(finish(llm, "late"))


@pytest.mark.parametrize("fault", [torch.AcceleratorError("CUDA error: device-side assert triggered"),
                                   RuntimeError("CUDA error: an illegal memory access was encountered")])
def test_a_device_fault_kills_the_engine_at_once(make_llm, fault):
    llm = make_llm()
    engine = llm._thread.engine
    real_step = engine.step

    def step():
        if engine.scheduler.num_running:
            raise fault
        return real_step()

    engine.step = step

    async def main():
        bystander = await llm.add_request("bystander", prompt(1), LONG)
        await anext(bystander)  # running when the fault strikes
        return await asyncio.gather(finish(llm, "victim"), anext(bystander), return_exceptions=True)

    assert all(isinstance(e, (RequestFailedError, EngineDeadError)) for e in run(main()))
    assert wait_until(lambda: not llm.is_alive(), 10)
    with pytest.raises(EngineDeadError, match="device reported a fault"):
        run(finish(llm, "late"))


def test_out_of_memory_is_not_a_device_fault():
    from kvflow.device_faults import is_device_fault

    assert not is_device_fault(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_device_fault(ValueError("CUDA error"))


def test_requests_cancelled_while_in_the_backlog_never_run(make_llm):
    llm = make_llm(LoadLimits(max_admissions_per_step=1))

    async def main():
        adds = [asyncio.ensure_future(llm.add_request(f"r{i}", prompt(i), LONG)) for i in range(30)]
        await asyncio.sleep(0)  # all submitted; a few admitted at most
        for task in adds:
            task.cancel()
        await asyncio.gather(*adds, return_exceptions=True)

    run(main())
    assert wait_until(lambda: llm.get_stats().num_running == 0 and llm.get_stats().num_waiting == 0, 10)
    assert llm.get_stats().generation_tokens_total < 30 * LONG.max_tokens // 10


def test_a_request_that_can_never_start_fails_alone_instead_of_hanging(make_llm):
    llm = make_llm()
    kv = llm._thread.engine.scheduler.kv_cache
    allocate = kv.allocate_slots
    kv.allocate_slots = lambda request, *a, **k: request.request_id != "stuck" and allocate(request, *a, **k)
    with pytest.raises(RequestFailedError):
        run(finish(llm, "stuck"))  # nothing runs and it cannot start: reported, not retried forever
    assert len(run(finish(llm, "next"))) == 4 and llm.is_alive()
    assert wait_until(lambda: llm.get_stats().num_waiting == 0 and llm.get_stats().kv_cache_usage == 0, 10)
