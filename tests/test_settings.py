"""kvflow/settings.py: the three settings a user gives in the environment, read once, and nothing
else in kvflow reads the environment (the A/B switches became engine arguments or went)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.settings import ALLOW_RUNTIME_LORA_UPDATING, API_KEY, CACHE_DIR, Settings

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "kvflow"
# Files that may touch the environment, and why: the settings themselves; variables that are not
# kvflow's (triton's interpreter switch, torchrun's rank variables, PATH for the ninja binary).
ENVIRONMENT_READERS = {
    "settings.py": "kvflow's settings",
    "attention/triton_backend.py": "TRITON_INTERPRET",
    "bench/gpu_compile.py": "TRITON_INTERPRET, left out of a child's environment",
    "distributed/process_groups.py": "torchrun's MASTER_ADDR, RANK, ...",
    "cpu_extension.py": "PATH, for ninja",
}


def test_unset_variables_take_their_defaults():
    settings = Settings.from_environ({})
    assert settings.cache_dir == Path.home() / ".cache" / "kvflow"
    assert settings.api_key is None and settings.allow_runtime_lora_updating is False


def test_set_variables_are_read():
    settings = Settings.from_environ({CACHE_DIR: "/tmp/kv", API_KEY: "sekrit", ALLOW_RUNTIME_LORA_UPDATING: "True"})
    assert settings == Settings(Path("/tmp/kv"), "sekrit", True)
    assert Settings.from_environ({API_KEY: "", ALLOW_RUNTIME_LORA_UPDATING: "0"}).api_key == ""  # refused where used
    assert Settings.from_environ({CACHE_DIR: ""}).cache_dir == Path.home() / ".cache" / "kvflow"


@pytest.mark.parametrize("value", ["yes", "2", "on"])
def test_a_flag_kvflow_cannot_read_is_an_error_naming_it(value):
    with pytest.raises(ValueError, match=f"{ALLOW_RUNTIME_LORA_UPDATING} must be 1, true, 0 or false.*'{value}'"):
        Settings.from_environ({ALLOW_RUNTIME_LORA_UPDATING: value})


def test_serve_names_a_bad_variable_in_one_line():
    env = {"PATH": "/usr/bin:/bin", ALLOW_RUNTIME_LORA_UPDATING: "maybe"}
    result = subprocess.run([sys.executable, "-m", "kvflow.entrypoints.cli", "serve", "--port", "0"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(f"kvflow: error: {ALLOW_RUNTIME_LORA_UPDATING} must be")


def test_nothing_else_reads_the_environment():
    """`grep -rn 'os.environ\\|getenv' src/kvflow` shows only the settings and variables not ours."""
    readers = {}
    for path in PACKAGE.rglob("*.py"):
        hits = [n for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"os\.environ|getenv", line)]
        if hits:
            readers[path.relative_to(PACKAGE).as_posix()] = hits
    assert set(readers) <= set(ENVIRONMENT_READERS), {f: readers[f] for f in set(readers) - set(ENVIRONMENT_READERS)}
