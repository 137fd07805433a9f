"""How much work the serving engine takes on, and when it stops trying.

The offline `LLM` runs whatever it is given; a server shares one engine among strangers, so its
engine thread bounds three things: the requests waiting for a slot (beyond that a new request is
refused as overloaded, and the client may retry), the requests it admits per iteration (so a burst
of thousands cannot stall the running streams for the time it takes to queue them all), and the
consecutive failed steps it tolerates before it declares itself dead. Data-parallel replicas, being
processes the server can kill, are also bounded in time: one with requests in flight that finishes
no engine iteration for `engine_iteration_timeout_s` is declared hung (engine/dp_watchdog.py).
"""

from __future__ import annotations

from dataclasses import dataclass


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full: try again later."""


@dataclass(frozen=True)
class LoadLimits:
    # Completions (an n > 1 request counts n) that may wait for a slot; 0: no bound.
    max_waiting_seqs: int = 4096
    # New requests the engine thread queues between two steps; the rest wait for the next.
    max_admissions_per_step: int = 64
    # Steps in a row that may fail before the engine is declared dead (a device fault ends it at once).
    max_consecutive_step_failures: int = 3
    # Seconds a data-parallel replica with requests in flight may finish no engine iteration before
    # it is killed and its requests fail (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S, also 60 s).
    engine_iteration_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_waiting_seqs", "max_admissions_per_step", "max_consecutive_step_failures"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "max_waiting_seqs" else 1):
                raise ValueError(f"{name} must be an integer >= {0 if name == 'max_waiting_seqs' else 1}; got {value!r}")
        timeout = self.engine_iteration_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"engine_iteration_timeout_s must be a number > 0; got {timeout!r}")

    def overloaded(self, num_waiting: int, num_new: int) -> bool:
        """Whether `num_new` more waiting completions would overflow the queue. A request is always
        admitted into an empty queue, however large, so none waits forever."""
        return bool(self.max_waiting_seqs) and num_waiting > 0 and num_waiting + num_new > self.max_waiting_seqs
