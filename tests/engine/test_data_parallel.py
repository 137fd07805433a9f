"""Data-parallel replicas (DPAsyncLLM, `kvflow serve --data-parallel-size`): two replica processes
serve a concurrent load with the outputs of one engine (greedy, float32), a shared prefix stays on
one replica while unrelated prompts spread, a killed replica ends its requests with an error within
seconds while the other keeps serving (and /health turns 503), so does a frozen (SIGSTOPped) one
once `engine_iteration_timeout_s` passes with its requests in flight (an idle one never), and bad
sizes are refused by name."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
import torch
from live_server import start_thread, wait_until
from tiny_models import tiny_chat_model

from kvflow import LLM, EngineArgs, RequestOutputKind, SamplingParams
from kvflow.engine.async_llm import EngineDeadError
from kvflow.engine.dp_async_llm import DPAsyncLLM
from kvflow.engine.dp_watchdog import ReplicaWatchdog
from kvflow.engine.load_limits import LoadLimits
from kvflow.entrypoints.cli import main as kvflow_main
from kvflow.entrypoints.openai.api_server import build_app
from kvflow.entrypoints.openai.limits import ServerLimits

DELTA = RequestOutputKind.DELTA
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=DELTA)
ENGINE = dict(dtype="float32", max_model_len=256, num_kv_blocks=64, block_size=4, disable_log_stats=True)
TIMEOUT = 120  # seconds for any one asyncio.run: a regression fails instead of hanging


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("qwen2"), "qwen2-bias")


@pytest.fixture(scope="module")
def dp(model_dir):
    llm = DPAsyncLLM(EngineArgs(model_dir, data_parallel_size=2, **ENGINE))
    yield llm
    llm.shutdown(timeout=10)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 95, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def collect(llm, p, params: SamplingParams, request_id: str) -> list[int]:
    tokens: list[int] = []
    async for out in llm.generate(p, params, request_id):
        tokens += out.outputs[0].token_ids
    return tokens


async def outcome(stream, since: float) -> tuple[str, float]:
    """How a request's stream ended ("finished" or the error) and how long after `since`."""
    try:
        async for _ in stream:
            pass
        return "finished", time.monotonic() - since
    except EngineDeadError as e:
        return str(e), time.monotonic() - since


def idle(llm) -> bool:
    return all(r.num_in_flight == 0 and r.stats is not None and r.stats.kv_cache_usage == 0 for r in llm.replicas
               if r.alive)


def test_dp2_serves_16_concurrent_requests_like_one_engine(dp, model_dir):
    prompts = [prompt(3 + 5 * i, seed=i) for i in range(16)]
    before = [r.stats.prompt_tokens_total for r in dp.replicas]

    async def main():
        return await asyncio.gather(*(collect(dp, p, GREEDY, f"load-{i}") for i, p in enumerate(prompts)))

    got = run(main())
    reference = LLM(model_dir, **ENGINE).generate(prompts, GREEDY.clone(output_kind=RequestOutputKind.FINAL_ONLY),
                                                  use_tqdm=False)
    assert got == [r.outputs[0].token_ids for r in reference]
    assert wait_until(lambda: idle(dp), 10)
    served = [r.stats.prompt_tokens_total - b for r, b in zip(dp.replicas, before)]
    assert all(s > 0 for s in served), f"one replica did all the work: {served}"
    assert dp.get_stats().prompt_tokens_total - sum(before) == sum(map(len, prompts))


def test_requests_that_finish_in_their_first_step_are_never_left_waiting_for_their_acceptance(dp):
    """A replica may send a request's acceptance after its final output (the acceptance rides a
    done-callback one loop turn later); the server took only the acceptance as such and waited
    for it forever once the final output had retired the request."""
    one_token = SamplingParams(temperature=0, max_tokens=1, output_kind=DELTA)

    async def main():
        return await asyncio.gather(*(collect(dp, prompt(4, seed=i), one_token, f"one-{i}") for i in range(24)))

    assert all(len(tokens) == 1 for tokens in run(main()))


def test_a_shared_prefix_goes_to_one_replica_and_hits_its_cache(dp):
    system = prompt(40, seed=100)  # 10 full blocks
    prompt_tokens = [r.stats.prompt_tokens_total for r in dp.replicas]
    hits_before = [r.stats.prefix_cache_hits_total for r in dp.replicas]

    async def main():
        await collect(dp, system + [1, 2], GREEDY, "conv-1")
        assert wait_until(lambda: idle(dp), 10)
        owner = next(i for i, r in enumerate(dp.replicas) if r.stats.prompt_tokens_total - prompt_tokens[i] == 42)
        # Busy the owner (bypassing the router), so that balancing alone would pick the other replica.
        long = GREEDY.clone(max_tokens=240)
        busy = [await dp.replicas[owner].add_request(f"busy-{i}", prompt(5, seed=i), long, 0, None, None)
                for i in range(2)]
        unrelated = await dp.add_request("unrelated", prompt(42, seed=1008), GREEDY)  # balancing: the other one
        await collect(dp, system + [3, 4, 5], GREEDY, "conv-2")  # affinity: the owner, busier as it is
        for stream in busy:
            stream.close()
        async for _ in unrelated:
            pass
        return owner

    owner = run(main())
    assert wait_until(lambda: idle(dp), 10)
    gained = [r.stats.prefix_cache_hits_total - h for r, h in zip(dp.replicas, hits_before)]
    assert gained[owner] >= 40 and gained[1 - owner] == 0, f"prefix hits per replica: {gained}"
    served = [r.stats.prompt_tokens_total - t for r, t in zip(dp.replicas, prompt_tokens)]
    assert served[owner] == 42 + 2 * 5 + 43 and served[1 - owner] == 42, served


def test_a_duplicate_id_and_bad_input_are_refused_and_harm_nothing(dp):
    async def main():
        stream = await dp.add_request("dup", prompt(4, seed=1), GREEDY.clone(max_tokens=100))
        with pytest.raises(ValueError, match="already in use"):
            await dp.add_request("dup", prompt(4, seed=2), GREEDY)
        for bad in ([], [1000], "x" * 300, {"nope": 1}):
            with pytest.raises(ValueError):
                await dp.add_request("bad", bad, GREEDY)
        stream.close()
        return await collect(dp, prompt(4, seed=3), GREEDY, "after")

    assert len(run(main())) == 8
    assert wait_until(lambda: idle(dp), 10)


@pytest.mark.parametrize("value", [0, -1])
def test_bad_data_parallel_size_is_refused_naming_the_field(model_dir, value):
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1"):
        DPAsyncLLM(EngineArgs(model_dir, data_parallel_size=value, **ENGINE))
    with pytest.raises(ValueError, match="data_parallel_size=2: an LLMEngine .* is one replica"):
        LLM(model_dir, data_parallel_size=2, **ENGINE)


def test_serve_with_a_bad_data_parallel_size_exits_with_its_name(model_dir, capsys):
    assert kvflow_main(["serve", "--model", model_dir, "--data-parallel-size", "0"]) == 1
    assert "data_parallel_size must be an integer >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: not an integer
        kvflow_main(["serve", "--model", model_dir, "-dp", "two"])
    assert "--data-parallel-size" in capsys.readouterr().err


def test_a_killed_replica_fails_its_requests_fast_and_the_other_serves(model_dir):
    llm = DPAsyncLLM(EngineArgs(model_dir, data_parallel_size=2, **ENGINE))
    server = start_thread(build_app(llm, "tiny"))
    try:
        assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
        long = GREEDY.clone(max_tokens=240)

        async def main():
            streams = [await llm.add_request(f"long-{i}", prompt(8, seed=i), long) for i in range(4)]
            victim = llm.replicas[0]
            assert victim.num_in_flight == 2 and llm.replicas[1].num_in_flight == 2
            os.kill(victim.process.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            results = await asyncio.gather(*(outcome(s, killed_at) for s in streams))
            after = await collect(llm, prompt(6, seed=9), GREEDY, "after-the-death")
            return results, after

        results, after = run(main())
        died = [(why, t) for why, t in results if why != "finished"]
        assert len(died) == 2 and all("data-parallel replica 0" in why and "died" in why for why, _ in died)
        assert all(t < 10 for _, t in died), died  # at once in practice; slack for a loaded machine
        assert sum(why == "finished" for why, _ in results) == 2  # the survivor's requests ran to the end
        assert len(after) == 8
        assert not llm.is_alive() and httpx.get(f"{server.url}/health", timeout=60).status_code == 503
        reply = httpx.post(f"{server.url}/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"]
    finally:
        server.stop()
        llm.shutdown(timeout=10)


def test_a_frozen_replica_is_killed_after_the_iteration_timeout_and_an_idle_one_never_is(model_dir):
    # 4 s: a healthy replica's slowest iteration on a loaded 2-core machine must stay under it (at
    # 2 s this test failed once in a slow full-suite run, 2026-11-26, and passed alone).
    timeout = 4.0
    llm = DPAsyncLLM(EngineArgs(model_dir, data_parallel_size=2, **ENGINE), LoadLimits(engine_iteration_timeout_s=timeout))
    server = start_thread(build_app(llm, "tiny"))
    try:
        time.sleep(2.5 * timeout)  # idle, well past the timeout: heartbeats only, no progress
        assert llm.is_alive() and httpx.get(f"{server.url}/health", timeout=60).status_code == 200
        long = GREEDY.clone(max_tokens=240)

        async def main():
            assert len(await collect(llm, prompt(6, seed=8), GREEDY, "after-idling")) == 8  # the timeout restarted
            streams = [await llm.add_request(f"long-{i}", prompt(8, seed=i), long) for i in range(4)]
            victim = llm.replicas[0]
            assert victim.num_in_flight == 2 and llm.replicas[1].num_in_flight == 2
            os.kill(victim.process.pid, signal.SIGSTOP)  # alive, pipe open, silent: only the watchdog can tell
            stopped_at = time.monotonic()
            results = await asyncio.gather(*(outcome(s, stopped_at) for s in streams))
            return results, await collect(llm, prompt(6, seed=9), GREEDY, "after-the-hang")

        results, after = run(main())
        hung = [(why, t) for why, t in results if why != "finished"]
        assert len(hung) == 2 and all("data-parallel replica 0" in why and "hung" in why for why, _ in hung), results
        assert all(t < timeout + 10 for _, t in hung), hung  # the timeout, plus slack for a loaded machine
        assert sum(why == "finished" for why, _ in results) == 2  # the other replica's requests ran to the end
        assert len(after) == 8
        assert llm.replicas[0].process.exitcode == -signal.SIGKILL  # killed, not left frozen
        assert not llm.is_alive() and httpx.get(f"{server.url}/health", timeout=60).status_code == 503
    finally:
        server.stop()
        llm.shutdown(timeout=10)


def test_a_reply_the_server_cannot_read_kills_its_replica_instead_of_leaving_requests_waiting(model_dir):
    llm = DPAsyncLLM(EngineArgs(model_dir, data_parallel_size=2, **ENGINE))
    try:
        def unreadable(message):
            raise KeyError(message[0])

        llm.replicas[0]._dispatch = unreadable  # the reader's own fault, at the request's acceptance

        async def main():
            with pytest.raises(EngineDeadError, match="data-parallel replica 0 .* could not read its messages"):
                await llm.replicas[0].add_request("lost", prompt(6, seed=3), GREEDY, 0, None, None)
            return await collect(llm, prompt(6, seed=4), GREEDY, "served")

        assert len(run(main())) == 8  # the other replica goes on
        assert llm.replicas[0].process.exitcode == -signal.SIGKILL and not llm.is_alive()
    finally:
        llm.shutdown(timeout=10)


def test_the_watchdog_counts_only_busy_time_without_progress():
    dog = ReplicaWatchdog(timeout_s=10, now=0)
    assert dog.observe(100, num_in_flight=0, progressed=False) is None  # idle for 100 s: never flagged
    dog.restart(105)  # a request arrives: it gets the whole timeout
    assert dog.observe(114, num_in_flight=1, progressed=False) is None
    assert dog.observe(114.5, num_in_flight=1, progressed=True) is None  # a step finished
    assert dog.observe(124, num_in_flight=1, progressed=False) is None  # heartbeats alone are no progress...
    assert dog.observe(125, num_in_flight=1, progressed=False) == pytest.approx(10.5)  # ...past it: hung
    assert dog.poll_s == 0.5 and ReplicaWatchdog(1.0, 0).poll_s == 0.25
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="engine_iteration_timeout_s must be a number > 0"):
            LoadLimits(engine_iteration_timeout_s=bad)
    with pytest.raises(ValueError, match="--engine-iteration-timeout-s must be a number > 0"):
        ServerLimits(engine_iteration_timeout_s=0)
