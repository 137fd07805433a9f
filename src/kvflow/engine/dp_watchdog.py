"""ReplicaWatchdog: tells when a data-parallel replica that is still alive has stopped working.

A replica that dies closes its pipe and is found at once (dp_client.py). One that hangs keeps its
pipe open and would hold its requests forever: a step that never returns (a stuck kernel, a
deadlock), or a whole process stopped (SIGSTOP, a debugger, a frozen container). So the server
watches progress rather than liveness. Every batch a replica sends says whether its engine
finished an iteration since the batch before; a replica with requests in flight that finishes
none for `engine_iteration_timeout_s` is declared hung. The replica's heartbeat alone would not
do: it comes from the replica's event loop, which keeps beating while its engine thread is stuck
in a step. A stopped process sends nothing at all, which reads the same: no progress.

Only busy time counts. The clock restarts whenever the replica is seen with nothing in flight, so
a replica idle for hours is never flagged and its next request gets the whole timeout. While busy
the engine iterates without pause (every iteration is a step), so a healthy replica reports
progress every step; the timeout only has to exceed the longest step (one prefill chunk, say).
vLLM bounds an engine iteration the same way (VLLM_ENGINE_ITERATION_TIMEOUT_S, 60 s by default),
and the flag is named after it: `kvflow serve --engine-iteration-timeout-s`.
"""

from __future__ import annotations

# The reader wakes at least this often (seconds) to look at the clock when the replica is silent.
MAX_POLL_SECONDS = 0.5


class ReplicaWatchdog:
    def __init__(self, timeout_s: float, now: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"engine_iteration_timeout_s must be a number > 0; got {timeout_s!r}")
        self.timeout_s = timeout_s
        self.poll_s = min(MAX_POLL_SECONDS, timeout_s / 4)  # a silent replica is found within 1.25 timeouts
        self._since = now  # the replica's last progress, or the last moment it was seen idle

    def restart(self, now: float) -> None:
        """A request arrives at an idle replica: it has the whole timeout from now."""
        self._since = now

    def observe(self, now: float, num_in_flight: int, progressed: bool) -> float | None:
        """What the reader just saw (a batch, or silence). Returns how many seconds the replica
        has been stalled when that is past the timeout, else None."""
        if progressed or num_in_flight == 0:
            self._since = now
            return None
        stalled = now - self._since
        return stalled if stalled > self.timeout_s else None
