"""worker/host_malloc.py: with freed memory kept, a step-like churn of large tensors (an MLP's
activations at changing token counts) stops faulting pages in once the heap has grown; in a
process that never asks (glibc's defaults) freed memory goes back to the kernel and the same
rounds keep faulting pages in."""

from __future__ import annotations

import ast
import platform
import subprocess
import sys

import pytest

CHURN = r"""
import resource, sys, torch
from kvflow.worker import host_malloc
print("kept", host_malloc.keep_freed_memory() if sys.argv[1] == "keep" else False)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds = []
for r in range(12):
    before = faults()
    rows = (4096, 1024, 2048)[r % 3]
    for layer in range(6):  # gate, then up (gate freed), then down (up freed): an MLP's activations
        gate = torch.empty(rows, 1536).fill_(1.0)
        up = torch.empty(rows, 1536).fill_(1.0); del gate
        down = torch.empty(rows, 576).fill_(1.0); del up
        x = down
    del x, down
    rounds.append(faults() - before)
print("rounds", rounds)
"""


def _churn(keep: bool) -> tuple[bool, list[int]]:
    result = subprocess.run([sys.executable, "-c", CHURN, "keep" if keep else "leave"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    kept = "kept True" in result.stdout
    rounds = ast.literal_eval(result.stdout.split("rounds", 1)[1].strip())
    return kept, rounds


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's thresholds: glibc's malloc")
def test_kept_memory_serves_the_next_rounds_without_page_faults():
    """The same churn with and without the memory kept, in fresh processes. Kept, the later rounds
    fault (nearly) nothing: here 0, or one 4,096-row round of 6,144 pages now and then (the VM
    reclaims idle pages); left alone, tens of thousands of pages every three rounds."""
    kept, with_kept = _churn(keep=True)
    not_kept, alone = _churn(keep=False)
    assert kept and not not_kept
    assert with_kept[0] > 1000 and alone[0] > 1000  # the first round faults its pages in: the probe measures
    assert sum(with_kept[3:]) * 4 < sum(alone[3:]), (with_kept, alone)
