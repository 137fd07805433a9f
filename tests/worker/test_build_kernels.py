"""scripts/setup.sh builds every CPU kernel library (`kvflow.worker.build_kernels`), so no start
builds one: every library kvflow loads anywhere is one the build loads."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import kvflow
from kvflow.worker import build_kernels

PACKAGE = Path(kvflow.__file__).resolve().parent
# A fresh process (no loader has run and cached its answer yet) that records what the build loads.
RECORD = """
import json
from kvflow import cpu_extension
loaded, load = [], cpu_extension.load_library
cpu_extension.load_library = lambda prefix, *a, **k: loaded.append(prefix) or load(prefix, *a, **k)
from kvflow.worker import build_kernels
print(json.dumps({"loaded": loaded, "statuses": build_kernels.build_all()}))
"""


def test_every_library_kvflow_loads_is_built_by_setup():
    anywhere = {m.group(1) for path in PACKAGE.rglob("*.py")
                for m in re.finditer(r'load_library\(\s*"(kvflow_\w+)"', path.read_text())}
    run = subprocess.run([sys.executable, "-c", RECORD], capture_output=True, text=True, timeout=600, check=True)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert anywhere and anywhere <= set(result["loaded"]), f"built at first use: {sorted(anywhere - set(result['loaded']))}"
    assert set(result["statuses"]) == set(build_kernels.KERNELS)  # a status line for each (ready or why not)
