"""A line per phase of a start (assembling a packaged model, reading the checkpoint, loading and
quantizing the weights, calibrating, the KV pool, the warm-up), with how long it took, so a long
start is never silent: `-q awq` calibrates for minutes, a first `--model gemma3-270m` assembles its
file for half a minute. At INFO on kvflow's logger (`kvflow serve` shows them; a script sees them
with `logging.basicConfig(level=logging.INFO)`). Phases that may take long say so when they start,
and the work inside them reports how far it got (`progress`), a line every few seconds at most:
lines, not a redrawn bar, so a log file or a service's journal reads the same as a terminal."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvflow.scoped import Scoped

logger = logging.getLogger("kvflow")
PROGRESS_EVERY_S = 5.0  # the most often a phase reports progress


@dataclass
class Phase:
    what: str
    started: float
    detail: str = ""  # words the block adds to its end line
    last_report: float | None = None

    def progress(self, done: int, total: int, unit: str) -> None:
        now = time.perf_counter()
        since = self.started if self.last_report is None else self.last_report
        if done >= total or now - since < PROGRESS_EVERY_S:
            return  # the end line says the rest
        self.last_report = now
        logger.info("kvflow: %s: %d of %d %s, %.0f s so far", self.what, done, total, unit, now - self.started)


_IN_SCOPE: Scoped[Phase | None] = Scoped("kvflow_phase", None)


@contextmanager
def phase(what: str, announce: bool = False) -> Iterator[Phase]:
    """Log "`what` in X s" when the block ends (and "`what`..." when it starts, with `announce`).
    The block may add words to the end line (`.detail` of what it gets)."""
    if announce:
        logger.info("kvflow: %s...", what)
    current = Phase(what, time.perf_counter())
    with _IN_SCOPE.scope(current):
        yield current
    detail = f" ({current.detail})" if current.detail else ""
    logger.info("kvflow: %s in %.1f s%s", what, time.perf_counter() - current.started, detail)


def progress(done: int, total: int, unit: str) -> None:
    """Tell the phase in scope (if any) that `done` of `total` `unit` are done."""
    current = _IN_SCOPE.current()
    if current is not None:
        current.progress(done, total, unit)
