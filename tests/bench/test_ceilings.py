"""Ceilings measurement: small sizes so the suite stays fast; values must be physical."""

from __future__ import annotations

import argparse
import functools
import json

import pytest
import torch

from kvflow.bench import ceilings
from kvflow.bench.ceilings import (
    add_ceilings_parser,
    main_ceilings,
    measure_ceilings,
    measure_memory_bandwidth,
    measure_peak_flops,
    run_ceilings,
)

SMALL = 16 * 2**20  # bigger than L2, small enough to run in milliseconds
KEYS = {"memory_bandwidth_gb_s", "peak_flops", "dtype", "device", "peak_product"}


def test_memory_bandwidth_is_plausible():
    bw = measure_memory_bandwidth("cpu", size_bytes=SMALL, repeats=3)
    # Any machine that runs this moves more than 100 MB/s and less than 20 TB/s.
    assert 1e8 < bw < 2e13


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_peak_flops_is_plausible(dtype):
    flops = measure_peak_flops(dtype, "cpu", max_n=256, repeats=2)
    # Between 10 MFLOP/s (a very slow emulated dtype) and 10 PFLOP/s.
    assert 1e7 < flops < 1e16


def test_peak_flops_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="cannot time"):
        measure_peak_flops("int3", "cpu")


def test_ceilings_json_keys():
    result = measure_ceilings(dtype="bf16", device="cpu", copy_bytes=SMALL, max_n=128)
    data = json.loads(json.dumps(result.to_json()))
    assert data.keys() == KEYS
    assert (data["dtype"], data["device"]) == ("bfloat16", "cpu")
    assert data["memory_bandwidth_gb_s"] > 0.1 and data["peak_flops"] > 1e7


@pytest.fixture
def quick_measure(monkeypatch):
    """The CLI, but measuring small sizes."""
    real = ceilings.measure_ceilings
    monkeypatch.setattr(
        ceilings,
        "measure_ceilings",
        functools.partial(real, device="cpu", copy_bytes=SMALL, max_n=128),
    )


def test_cli_json(quick_measure, capsys):
    assert main_ceilings(["--json", "--dtype", "float32"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data.keys() == KEYS
    assert data["dtype"] == "float32"


def test_cli_table_and_bad_dtype(quick_measure, capsys):
    assert main_ceilings([]) == 0
    out = capsys.readouterr().out
    assert "memory_bandwidth_gb_s" in out and "peak_flops" in out
    assert main_ceilings(["--dtype", "int3"]) == 2


def test_add_ceilings_parser_registers_subcommand():
    parser = argparse.ArgumentParser(prog="kvflow")
    bench = parser.add_subparsers(dest="command").add_parser("bench")
    add_ceilings_parser(bench.add_subparsers(dest="bench_command"))
    args = parser.parse_args(["bench", "ceilings", "--dtype", "float32", "--json"])
    assert args.func is run_ceilings and args.json and args.dtype == "float32"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_ceilings():
    result = measure_ceilings(dtype="bfloat16", device="cuda")
    assert result.memory_bandwidth_gb_s > 100 and result.peak_flops > 1e12


def test_the_peak_is_the_best_product_at_any_shape(monkeypatch):
    """The peak is the best of every product and shape tried, and says which it was."""
    def fake(m, k, n, dtype, device, repeats):
        return {"torch matmul": 1e9, "panel kernel": 3e9} if (m, k, n) == (2048, 576, 1536) else {"torch matmul": 2e9}

    monkeypatch.setattr(ceilings, "_square_size", lambda *a: 256)
    monkeypatch.setattr(ceilings, "_product_flops", fake)
    assert ceilings.measure_peak("bfloat16", "cpu") == (3e9, "panel kernel at 2048x576x1536")


def test_the_products_the_engine_runs_are_among_those_the_peak_is_the_best_of():
    """MFU above 100% would mean an engine product outran the peak: each kernel an engine's bf16
    linear runs on this CPU (oneDNN on a packed weight; the panel kernel for a few rows) is timed."""
    from kvflow.quant import panel_linear
    from kvflow.quant.packed_linear import should_pack

    x, w = torch.randn(2048, 576).bfloat16(), torch.randn(1536, 576).bfloat16()
    timed = {name for name, prepare in ceilings.PRODUCTS.items() if prepare(x, w) is not None}
    expected = {"torch matmul"} | ({"oneDNN, weight packed as the engine packs it"} if should_pack(w) else set())
    expected |= {"panel kernel"} if panel_linear.available() else set()
    assert timed == expected
    flops = ceilings._product_flops(64, 576, 1536, torch.bfloat16, "cpu", 1)
    assert flops.keys() == timed and all(f > 0 for f in flops.values())
