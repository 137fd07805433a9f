"""kvflow/cpu_extension.py: a build that was killed midway (Ctrl-C on a first start) leaves
torch's `lock` file in the build directory, and torch waits on it forever; the next build must
see it is a leftover (nobody holds the build's flock), remove it and build."""

from __future__ import annotations

import os
import subprocess
import sys

SOURCE = r"""
#include <torch/library.h>
int64_t twice(int64_t x) { return 2 * x; }
TORCH_LIBRARY(kvflow_test_ext, m) { m.def("twice(int x) -> int"); }
TORCH_LIBRARY_IMPL(kvflow_test_ext, CompositeExplicitAutograd, m) { m.impl("twice", &twice); }
"""

SCRIPT = r"""
import sys, torch
from pathlib import Path
from kvflow import cpu_extension
source = Path(sys.argv[1])
name = cpu_extension.build_name("kvflow_test_ext", source)
directory = cpu_extension.build_dir(name)
directory.mkdir(parents=True)
(directory / "lock").write_text("")  # what a killed build leaves
print("built", cpu_extension.load_library("kvflow_test_ext", source, "a test kernel"))
print("twice", torch.ops.kvflow_test_ext.twice(21))
"""


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_one(tmp_path):
    source = tmp_path / "ext.cpp"
    source.write_text(SOURCE)
    env = dict(os.environ, KVFLOW_CACHE_DIR=str(tmp_path / "cache"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(source)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "built True" in result.stdout and "twice 42" in result.stdout
    assert "left by a build of a test kernel that did not finish" in result.stderr


def test_a_change_to_a_shared_header_names_new_builds(tmp_path, monkeypatch):
    from kvflow import cpu_extension

    source = tmp_path / "ext.cpp"
    source.write_text(SOURCE)
    headers = tmp_path / "csrc"
    headers.mkdir()
    monkeypatch.setattr(cpu_extension, "SHARED_HEADERS", headers)
    (headers / "shared.h").write_text("inline int one() { return 1; }\n")
    before = cpu_extension.build_name("kvflow_test_ext", source)
    assert cpu_extension.build_name("kvflow_test_ext", source) == before  # stable
    (headers / "shared.h").write_text("inline int one() { return 2 - 1; }\n")
    assert cpu_extension.build_name("kvflow_test_ext", source) != before

