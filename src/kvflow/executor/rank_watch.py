"""Rank 0's watch over the other ranks: who joined, who died, and of what.

Rank 0 never blocks on the other ranks without looking at them. While it waits for them to join
(process_groups.wait_for_joins, calling `check`) or for a collective that may legitimately take
long (`wait`: the other ranks loading their weights), it polls: a rank it spawned that has
exited is an error within a poll interval, naming the rank, its exit code or signal and the
exception the rank reported on the store when it got that far. Ranks started elsewhere (torchrun, `--node-rank`) have no process
here to watch: they have `distributed_timeout_s` to join, and once joined their death closes
their connections, which gloo reports at once.

A spawned rank that exits before it joins usually never reached kvflow's code: multiprocessing's
spawn re-imports the main script first, and a script that builds its engine at its top level,
outside `if __name__ == "__main__":`, fails there. The error says so.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import sys
import time

from kvflow.device_faults import WorkerDiedError
from kvflow.distributed.process_groups import DistributedInit, joined_ranks, reported_failure

POLL_S = 0.05  # how soon a dead spawned rank is seen while rank 0 waits
EXIT_GRACE_S = 2.0  # after a collective fails: how long a dying rank may take to be reaped


class RankWatch:
    """`processes[i]` is rank i + 1 when rank 0 spawned the ranks; empty when they were started
    elsewhere."""

    def __init__(self, init: DistributedInit, store, processes: list[mp.Process]) -> None:
        self.init = init
        self.store = store
        self.processes = processes

    def wait(self, work) -> None:
        """A collective's end (its error raised), checking the spawned ranks meanwhile."""
        while not work.is_completed():
            self.check()
            time.sleep(POLL_S)
        work.wait()

    def check(self) -> None:
        """Raise WorkerDiedError naming every spawned rank that has exited."""
        dead = self.dead_ranks()
        if dead:
            raise WorkerDiedError(dead)

    def dead_ranks(self) -> str | None:
        """Each exited spawned rank, with its cause; None while all live."""
        dead = [(rank, p) for rank, p in enumerate(self.processes, start=1) if not p.is_alive()]
        if not dead:
            return None
        joined = joined_ranks(self.store, self.init.world_size)
        return "; ".join(self._describe(rank, p, rank in joined) for rank, p in dead)

    def lost(self, error: RuntimeError) -> WorkerDiedError:
        """The WorkerDiedError for a collective that failed with `error`: naming the spawned rank
        that died, once it is reaped (it closed its connections just before it exited), else
        with gloo's words, which name the peer's address."""
        deadline = time.monotonic() + EXIT_GRACE_S
        while (dead := self.dead_ranks()) is None and self.processes and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if dead is not None:
            return WorkerDiedError(dead)
        return WorkerDiedError(f"a tensor-parallel rank is gone or was silent past distributed_timeout_s="
                               f"{self.init.timeout_s:g} (--distributed-timeout-s): {error}")

    def _describe(self, rank: int, process: mp.Process, joined: bool) -> str:
        what = f"tensor-parallel rank {rank} ({process.name}, pid {process.pid}) {_exit_cause(process.exitcode)}"
        failure = reported_failure(self.store, rank)
        if failure is not None:
            return f"{what}: {failure}"
        if joined:
            return what
        return f"{what} before it joined the engine{_reimport_advice()}"


def _exit_cause(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _reimport_advice() -> str:
    """Why a spawned rank may fail before running any of kvflow: its re-import of the main script."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if script is None:  # an interactive session or `python -c`: nothing is re-imported
        return " (its error is on stderr)"
    return (f" (its error is on stderr). A spawned rank first re-imports the main script ({script}): a script "
            "that builds the LLM at its top level must do so under `if __name__ == '__main__':`")
