"""A tensor-parallel rank that dies, at start or mid-run, ends the engine with an error naming the
rank and how it ended, never a hang: rank 0 watches its spawned ranks while it waits for them,
ranks started elsewhere get `distributed_timeout_s` to join, and spawned ranks die with the
engine's process (whichever of its threads started them).

Scripts run in a subprocess where the child's behaviour must differ from the test process's: a
spawned rank re-imports the main script, so that is the only place to change what it does. Every
test is bounded by pytest-timeout's thread method (a hang may be inside a C call, which a signal
would not interrupt), so a regression to a hang fails instead of stalling the suite.
"""

from __future__ import annotations

import asyncio
import multiprocessing.context
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from live_server import wait_until
from tiny_models import make_tiny_model

from kvflow import LLM, EngineArgs, LLMEngine, SamplingParams
from kvflow.device_faults import WorkerDiedError, is_device_fault
from kvflow.engine.async_llm import AsyncLLM, EngineDeadError
from kvflow.engine.engine_thread import RequestFailedError, build_on_fresh_thread

TIMEOUT_S = 10  # distributed_timeout_s of these engines
ENGINE = dict(dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=2, distributed_timeout_s=TIMEOUT_S,
              num_kv_blocks=64, block_size=8, disable_log_stats=True)
PROMPT = {"prompt_token_ids": [1, 2, 3, 4, 5]}
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
KILLED = r"tensor-parallel rank 1 \(kvflow-rank-1, pid \d+\) was killed by signal SIGKILL"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama-mqa")
    make_tiny_model("llama-mqa", path)
    return str(path)


def _run_script(tmp_path: Path, body: str, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=240,
                          cwd=tmp_path)


def _last_error(stderr: str) -> str:
    """The exception the script died of: the last line of its stderr that names one."""
    return [line for line in stderr.splitlines() if re.match(r"[\w.]+(Error|Exception): ", line)][-1]


# -- at start ------------------------------------------------------------------------------------
@pytest.mark.timeout(120, method="thread")
def test_a_rank_killed_as_it_starts_ends_the_engine_naming_its_signal(model_dir, monkeypatch):
    start = multiprocessing.context.SpawnProcess.start

    def start_then_kill(process):
        start(process)
        os.kill(process.pid, signal.SIGKILL)

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start_then_kill)
    with pytest.raises(WorkerDiedError, match=KILLED + " before it joined the engine"):
        LLM(model_dir, **ENGINE)


@pytest.mark.timeout(300, method="thread")
def test_a_script_without_the_main_guard_is_told_to_add_one(model_dir, tmp_path):
    done = _run_script(tmp_path, """
        import sys
        from kvflow import LLM
        llm = LLM(sys.argv[1], dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=2,
                  distributed_timeout_s=10, num_kv_blocks=64, block_size=8)
        print("built")
    """, model_dir)
    assert done.returncode != 0 and "built" not in done.stdout
    # The spawned rank, re-running the script, refuses to start ranks of its own and says why...
    assert re.search(r"RuntimeError: process kvflow-rank-1 \(pid \d+\) is re-importing the main script.*"
                     r"put the code that builds the LLM under `if __name__ == '__main__':`", done.stderr)
    # ...and rank 0 ends with an error naming the rank, its exit and the advice.
    error = _last_error(done.stderr)
    assert error.startswith("kvflow.device_faults.WorkerDiedError: tensor-parallel rank 1 (kvflow-rank-1")
    assert "exited with code 1 before it joined the engine" in error
    assert "script.py): a script that builds the LLM at its top level must do so under " \
           "`if __name__ == '__main__':`" in error


@pytest.mark.timeout(300, method="thread")
def test_a_rank_that_fails_loading_reports_its_exception_to_rank_0(model_dir, tmp_path):
    done = _run_script(tmp_path, """
        import multiprocessing
        import sys

        import kvflow.worker.worker_process

        def fail(*args, **kwargs):
            raise OSError("injected: rank 1 cannot read its weights")

        if multiprocessing.current_process().name == "kvflow-rank-1":  # the spawned rank, re-importing this script
            kvflow.worker.worker_process.load_checkpoint = fail

        if __name__ == "__main__":
            from kvflow import LLM
            LLM(sys.argv[1], dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=2,
                distributed_timeout_s=10, num_kv_blocks=64, block_size=8)
            print("built")
    """, model_dir)
    assert done.returncode != 0 and "built" not in done.stdout
    assert _last_error(done.stderr) == (
        "kvflow.device_faults.WorkerDiedError: tensor-parallel rank 1 (kvflow-rank-1, pid "
        f"{_pid_in(done.stderr)}) exited with code 1: OSError: injected: rank 1 cannot read its weights")


def _pid_in(stderr: str) -> str:
    return re.search(r"kvflow-rank-1, pid (\d+)\)", stderr).group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120, method="thread")
def test_ranks_started_elsewhere_have_the_timeout_to_join(model_dir):
    port = _free_port()  # nobody else will join there
    with pytest.raises(TimeoutError, match=rf"tensor-parallel rank\(s\) 1 of 2 did not join tcp://127.0.0.1:{port} "
                                           r"within distributed_timeout_s=1 \(--distributed-timeout-s\)"):
        LLM(model_dir, **{**ENGINE, "distributed_timeout_s": 1.0}, distributed_init_method=f"tcp://127.0.0.1:{port}")


@pytest.mark.timeout(180, method="thread")
def test_a_rank_started_by_hand_serves_and_its_loss_fails_the_step(model_dir):
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    rank1 = subprocess.Popen([sys.executable, "-m", "kvflow.entrypoints.cli", "generate", "unused", "--model", model_dir,
                              "--dtype", "float32", "--skip-tokenizer-init", "--tensor-parallel-size", "2",
                              "--num-kv-blocks", "64", "--block-size", "8", "--distributed-init-method", init_method,
                              "--node-rank", "1", "--distributed-timeout-s", "60"])
    try:
        llm = LLM(model_dir, **{**ENGINE, "distributed_timeout_s": 60.0}, distributed_init_method=init_method)
        try:
            assert len(llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 4
            rank1.kill()  # no process of rank 0's: its closed connections are what tell
            with pytest.raises(WorkerDiedError, match="a tensor-parallel rank is gone or was silent past "
                                                      r"distributed_timeout_s=60 \(--distributed-timeout-s\): "):
                llm.generate([PROMPT], GREEDY, use_tqdm=False)
            with pytest.raises(WorkerDiedError):
                llm.llm_engine.model_executor.check_health()
        finally:
            llm.llm_engine.shutdown()
    finally:
        rank1.kill()
        rank1.wait()


# -- mid-run -------------------------------------------------------------------------------------
@pytest.mark.timeout(180, method="thread")
def test_a_rank_killed_inside_a_step_fails_generate_naming_it(model_dir):
    llm = LLM(model_dir, **ENGINE)
    try:
        engine = llm.llm_engine
        executor = engine.model_executor
        [rank1] = executor._processes
        assert len(llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 4
        forward = executor.driver_worker.execute_model

        def killed_mid_step(sched):  # the step message is out: rank 0's forward meets a dead peer
            os.kill(rank1.pid, signal.SIGKILL)
            return forward(sched)

        executor.driver_worker.execute_model = killed_mid_step
        with pytest.raises(WorkerDiedError, match="the engine lost a worker: " + KILLED) as error:
            llm.generate([PROMPT], GREEDY, use_tqdm=False)
        assert is_device_fault(error.value)
        engine.abort_failed_step()
        engine.add_request("later", PROMPT, GREEDY)
        with pytest.raises(WorkerDiedError, match=KILLED):  # every later step, at once
            engine.step()
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.timeout(180, method="thread")
def test_a_rank_that_hangs_fails_the_step_after_the_timeout(model_dir):
    llm = LLM(model_dir, **ENGINE)
    [rank1] = llm.llm_engine.model_executor._processes
    try:
        os.kill(rank1.pid, signal.SIGSTOP)  # alive, but silent
        with pytest.raises(WorkerDiedError, match=rf"silent past distributed_timeout_s={TIMEOUT_S} .*[Tt]imed out"):
            llm.generate([PROMPT], GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()  # kills the stopped rank
    assert not rank1.is_alive()


@pytest.mark.timeout(180, method="thread")
def test_the_servers_engine_keeps_its_ranks_and_reports_a_lost_one(model_dir):
    # Built as `kvflow serve` builds it: on a thread that ends, which must not take rank 1 with it.
    engine = build_on_fresh_thread(lambda: LLMEngine(EngineArgs(model_dir, **ENGINE)))
    llm = AsyncLLM(engine)
    [rank1] = engine.model_executor._processes

    async def first_tokens() -> list[int]:
        return [out async for out in llm.generate(PROMPT, GREEDY, "first")][-1].outputs[0].token_ids

    async def killed_mid_stream() -> None:
        stream = llm.generate(PROMPT, GREEDY.clone(max_tokens=500), "doomed")
        await anext(stream)
        os.kill(rank1.pid, signal.SIGKILL)
        async for _ in stream:
            pass

    try:
        assert len(asyncio.run(first_tokens())) == 4
        with pytest.raises((RequestFailedError, EngineDeadError)):
            asyncio.run(killed_mid_stream())
        assert wait_until(lambda: not llm.is_alive(), TIMEOUT_S * 3)  # /health answers 503
        with pytest.raises(EngineDeadError):
            asyncio.run(first_tokens())
    finally:
        llm.shutdown(timeout=10)
        engine.shutdown()


@pytest.mark.timeout(120, method="thread")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_spawned_rank_dies_with_the_engines_process(model_dir, tmp_path):
    """Rank 0 killed before rank 1 reached the store: no connection tells rank 1 (its store client
    would retry for the whole, here long, distributed_timeout_s), only its watch on its parent."""
    done = _run_script(tmp_path, """
        import os
        import signal
        import sys

        import kvflow.executor.multiprocess
        from kvflow import LLM

        spawn = kvflow.executor.multiprocess._spawn_ranks

        def spawn_then_die(config, init, processes, *rest):
            spawn(config, init, processes, *rest)
            print(processes[0].pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        if __name__ == "__main__":
            kvflow.executor.multiprocess._spawn_ranks = spawn_then_die
            LLM(sys.argv[1], dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=2,
                distributed_timeout_s=300, num_kv_blocks=64, block_size=8)
    """, model_dir)
    assert done.returncode == -signal.SIGKILL
    pid = int(done.stdout)
    while _is_running(pid):  # gone within a second or two; pytest-timeout fails the test if never
        time.sleep(0.1)


def _is_running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie nobody reaped yet has died)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"
