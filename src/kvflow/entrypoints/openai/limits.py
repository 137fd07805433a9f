"""The server's limits on what one client may ask for, each with a default and a flag.

docs/limits.md explains each number. A request over a per-request limit gets a 400 naming the
limit and its flag before any work is done; a full waiting queue gets a 503 with Retry-After.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from kvflow.engine.load_limits import LoadLimits

MIB = 1024 * 1024
_POSITIVE = ("body_read_timeout", "engine_iteration_timeout_s")  # seconds that must be > 0 (not >= 1)


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 2 * MIB  # larger bodies get 413 before more is read
    body_read_timeout: float = 30.0  # seconds to send the whole body; then 408
    max_prompts_per_request: int = 256  # entries of a completions `prompt` list
    max_seqs_per_request: int = 1024  # prompts × n: completions one request may start
    max_logprob_entries: int = 500_000  # logprobs one request may make (tokens × alternatives)
    tokenizer_workers: int = 2  # threads that tokenize and render chat templates
    shutdown_timeout: float = 20.0  # seconds in-flight requests get to finish on SIGTERM / SIGINT
    max_served_loras: int = 256  # LoRA adapters served by name at once (--lora-modules and runtime loads)
    # Stop strings of one request: each is matched against every new piece of text. OpenAI takes
    # 4; lm-eval's code tasks send 6.
    max_stop_sequences: int = 16
    # The engine thread's own bounds (LoadLimits).
    max_waiting_seqs: int = LoadLimits.max_waiting_seqs
    max_admissions_per_step: int = LoadLimits.max_admissions_per_step
    max_consecutive_step_failures: int = LoadLimits.max_consecutive_step_failures
    engine_iteration_timeout_s: float = LoadLimits.engine_iteration_timeout_s  # data-parallel replicas

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            minimum = 0 if f.name in ("shutdown_timeout", "max_waiting_seqs") else 1
            if f.name in _POSITIVE:
                ok = isinstance(value, (int, float)) and value > 0
            else:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= minimum
            if not ok:
                allowed = "> 0" if f.name in _POSITIVE else f">= {minimum}"
                raise ValueError(f"--{f.name.replace('_', '-')} must be a number {allowed}; got {value!r}")

    def load_limits(self) -> LoadLimits:
        return LoadLimits(self.max_waiting_seqs, self.max_admissions_per_step, self.max_consecutive_step_failures,
                          self.engine_iteration_timeout_s)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        d = ServerLimits()
        g = parser.add_argument_group("limits (see docs/limits.md)")
        g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="larger request bodies get 413")
        g.add_argument("--body-read-timeout", type=float, default=d.body_read_timeout,
                       help="seconds a client has to send its whole body (then 408)")
        g.add_argument("--max-prompts-per-request", type=int, default=d.max_prompts_per_request)
        g.add_argument("--max-seqs-per-request", type=int, default=d.max_seqs_per_request,
                       help="prompts x n of one request")
        g.add_argument("--max-logprob-entries", type=int, default=d.max_logprob_entries,
                       help="logprobs one request may produce: completions x tokens x (top_logprobs + 1)")
        g.add_argument("--tokenizer-workers", type=int, default=d.tokenizer_workers)
        g.add_argument("--max-served-loras", type=int, default=d.max_served_loras,
                       help="LoRA adapters served by name at once; a runtime load beyond it gets 409")
        g.add_argument("--max-stop-sequences", type=int, default=d.max_stop_sequences,
                       help="stop strings one request may give (OpenAI's limit is 4)")
        g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                       help="seconds in-flight requests may still run after SIGTERM; the rest get 503")
        g.add_argument("--max-waiting-seqs", type=int, default=d.max_waiting_seqs,
                       help="completions that may wait for a slot before new requests get 503 (0: no bound)")
        g.add_argument("--max-admissions-per-step", type=int, default=d.max_admissions_per_step)
        g.add_argument("--max-consecutive-step-failures", type=int, default=d.max_consecutive_step_failures,
                       help="failed engine steps in a row before the engine is declared dead")
        g.add_argument("--engine-iteration-timeout-s", type=float, default=d.engine_iteration_timeout_s,
                       help="with --data-parallel-size: seconds a replica with requests in flight may finish no "
                            "engine step before it is killed and its requests fail")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerLimits:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
