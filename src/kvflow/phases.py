"""A line per phase of a start (assembling a packaged model, reading the checkpoint, loading and
quantizing the weights, calibrating, the KV pool, the warm-up), with how long it took, so a long
start is never silent: `-q awq` calibrates for minutes, a first `--model gemma3-270m` assembles its
file for half a minute. At INFO on kvflow's logger (`kvflow serve` shows them; a script sees them
with `logging.basicConfig(level=logging.INFO)`). Phases that may take long say so when they start."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("kvflow")


@contextmanager
def phase(what: str, announce: bool = False) -> Iterator[dict]:
    """Log "`what` in X s" when the block ends (and "`what`..." when it starts, with `announce`).
    The block may add words to the end line through the dict it gets (`done["detail"]`)."""
    if announce:
        logger.info("kvflow: %s...", what)
    started = time.perf_counter()
    done: dict = {}
    yield done
    detail = f" ({done['detail']})" if done.get("detail") else ""
    logger.info("kvflow: %s in %.1f s%s", what, time.perf_counter() - started, detail)
