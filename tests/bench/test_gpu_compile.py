"""The GPU path checked without a GPU: every triton kernel kvflow launches is compiled for H100
(sm_90) and A100 (sm_80), at the configurations the engine would choose for the default model
and for Llama-3.1-8B, and must neither spill registers nor need more shared memory than its
target has, and the two tools reading each cubin must agree with the installed triton (3.6 here;
run this file under another release to verify it: a release changes how triton assembles). A
registry of deliberately broken kernels proves the check fails when it should, and one assembled
with a ptxas option of its own that the check reports the binary triton made.

All compiles happen once, in one child process (tests run triton interpreted, which cannot
compile), and the reports are shared by the tests below.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from tiny_models import make_tiny_model  # noqa: E402

from kvflow import SamplingParams  # noqa: E402
from kvflow.attention.triton_kernels.paged_prefill import prefill_config  # noqa: E402
from kvflow.bench import gpu_compile  # noqa: E402
from kvflow.bench.engine_shapes import Step, engine_shapes  # noqa: E402
from kvflow.bench.gpu_compile import CompileRequest, compile_reports  # noqa: E402
from kvflow.bench.gpu_compile_report import format_report  # noqa: E402
from kvflow.bench.gpu_kernels import attention_cases  # noqa: E402
from kvflow.bench.gpu_targets import TARGETS, occupancy  # noqa: E402
from kvflow.bench.kernel_compile import _same_cubin  # noqa: E402
from kvflow.config import EngineArgs  # noqa: E402
from kvflow.engine.llm_engine import LLMEngine  # noqa: E402
from kvflow.entrypoints.cli import main  # noqa: E402
from kvflow.kernel_launch import KernelLaunch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LLAMA = str(ROOT / "benchmarks" / "configs" / "llama-3.1-8b" / "config.json")
ARCHS = ("sm_90", "sm_80")


@pytest.fixture(scope="session")
def reports() -> dict[str, dict]:
    archs = ",".join(ARCHS)
    default, llama, broken, ptxas_option = compile_reports([
        CompileRequest(None, archs), CompileRequest(LLAMA, archs),
        CompileRequest(LLAMA, archs, registry="broken_kernels"),
        CompileRequest(LLAMA, archs, registry="ptxas_option_kernels"),
    ])
    return {"default": default, "llama-3.1-8b": llama, "broken": broken, "ptxas option": ptxas_option}


@pytest.mark.parametrize("model", ["default", "llama-3.1-8b"])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_without_spills_within_shared_memory(reports, model, arch):
    target = TARGETS[arch]
    rows = [k for k in reports[model]["kernels"] if k["arch"] == arch]
    assert rows
    for k in rows:
        assert k["problems"] == [], (k["kernel"], k["steps"], k["problems"])
        assert k["spill_store_bytes"] == k["spill_load_bytes"] == 0
        assert k["registers"] <= target.max_registers_per_thread
        assert k["shared_bytes"] <= target.smem_per_block
        assert k["blocks_per_sm"] >= 1 and k["cubin_bytes"] > 0
        assert k["cross_check"] == []  # cuobjdump and ptxas -v agree


def test_every_triton_kernel_in_kvflow_is_compiled(reports):
    compiled = {k["kernel"] for r in (reports["default"], reports["llama-3.1-8b"]) for k in r["kernels"]}
    assert _triton_kernels_in(ROOT / "src" / "kvflow") <= compiled


def _triton_kernels_in(package: Path) -> set[str]:
    """Names of the @triton.jit functions named *_kernel in the package's source."""
    names = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(
                    "triton.jit" in ast.unparse(d) for d in node.decorator_list):
                names.add(node.name)
    assert "_paged_prefill_kernel" in names  # the scan finds kernels at all
    return names


def test_each_step_compiles_the_configuration_it_launches(reports):
    sm90 = [k for k in reports["llama-3.1-8b"]["kernels"] if k["arch"] == "sm_90"]
    [prefill] = [k for k in sm90 if k["kernel"] == "_paged_prefill_kernel"]
    config = prefill_config(128, torch.bfloat16)
    assert (prefill["num_warps"], prefill["num_stages"]) == (config.num_warps, config.num_stages)
    assert prefill["constexprs"]["BLOCK_N"] == config.block_n and prefill["constexprs"]["GROUP"] == 4
    assert prefill["steps"] == ["prefill", "mixed"]
    assert prefill["constexprs"]["stride_qd"] == 1  # folded into a constant, as a GPU launch folds it
    # Graph-replayed decodes split the context (bounded by max_model_len) and merge; the eager
    # mixed step's short contexts take one split and no merge.
    splits = {k["constexprs"]["SINGLE_SPLIT"]: k["steps"] for k in sm90 if k["kernel"] == "_decode_segment_kernel"}
    assert splits == {False: ["decode", "decode b=1"], True: ["mixed"]}
    [merge] = [k for k in sm90 if k["kernel"] == "_merge_segments_kernel"]
    assert merge["constexprs"]["SPLITS_PAD"] == 16 and merge["steps"] == ["decode", "decode b=1"]


def test_broken_kernels_fail_the_check_and_their_twins_pass(reports):
    report = reports["broken"]
    assert not report["ok"]
    by_config = {(k["kernel"], k["arch"], k["num_stages"], k["registers"] <= 32): k for k in report["kernels"]}
    for arch in ARCHS:
        limit = TARGETS[arch].smem_per_block
        deep = by_config["_staged_matmul_kernel", arch, 4, False]
        assert deep["shared_bytes"] > limit
        assert deep["problems"] == [f"needs {deep['shared_bytes']} B of shared memory per block; "
                                    f"{TARGETS[arch].gpu} allows {limit}"]
        assert by_config["_staged_matmul_kernel", arch, 2, False]["problems"] == []
        capped = by_config["_register_hog_kernel", arch, 1, True]
        assert capped["spill_store_bytes"] > 0 and capped["problems"][0].startswith("spills registers")
        assert by_config["_register_hog_kernel", arch, 1, False]["problems"] == []


def test_ptxas_numbers_describe_the_cubin_triton_made(reports):
    """Triton's ptxas command is its own (3.9 assembles sm_90 with CUDA 13's ptxas and
    `--regAllocOptLevel=2`, which moved two kernels' registers), and a launch or a knob can add to
    it: here `--opt-level=0`. ptxas -v's numbers must be those of the binary that runs, so the
    check reruns triton's own cubin stage and requires the very same bytes."""
    for arch in ARCHS:
        # The registry's launches in its order: the default assembly, then the one with the option.
        default, optioned = [k for k in reports["ptxas option"]["kernels"] if k["arch"] == arch]
        assert default["cross_check"] == optioned["cross_check"] == []  # same cubin; cuobjdump and ptxas -v agree
        assert optioned["registers"] != default["registers"]  # the option did change the binary


def test_a_rerun_that_made_another_cubin_is_a_disagreement():
    assert _same_cubin(b"\x7fELF same", b"\x7fELF same") == []
    assert _same_cubin(b"\x7fELF compiled", b"\x7fELF rerun") == [
        "ptxas -v's run made a different cubin (10 B) than the compile (13 B)"]


def test_occupancy_follows_the_scarcest_resource():
    h100, a100 = TARGETS["sm_90"], TARGETS["sm_80"]
    # 48 registers x 32 threads = 1536 per warp: 42 warps' worth, 10 blocks of 4 warps.
    assert occupancy(h100, num_warps=4, registers=48, shared_bytes=0).describe == "10 (registers)"
    assert occupancy(h100, num_warps=4, registers=16, shared_bytes=0).describe == "16 (warps)"
    assert occupancy(h100, num_warps=1, registers=16, shared_bytes=0).describe == "32 (blocks)"
    # 100 KiB + the 1 KiB the runtime reserves: two blocks in 228 KiB, one in 164 KiB.
    assert occupancy(h100, num_warps=4, registers=32, shared_bytes=100 * 1024).describe == "2 (shared memory)"
    assert occupancy(a100, num_warps=4, registers=32, shared_bytes=100 * 1024).describe == "1 (shared memory)"
    assert occupancy(a100, num_warps=4, registers=32, shared_bytes=a100.smem_per_block + 1).blocks_per_sm == 0


def test_launches_built_from_shapes_match_a_real_engine_step(monkeypatch, tmp_path):
    """The meta-tensor launches that are compiled equal, in everything a compile sees, the
    launches a real engine makes (its triton attention, interpreted here) for the same step."""
    # On a GPU RoPE is Triton's, which returns new q and k; the CPU's fused RoPE rotates them in
    # place as strided views of the qkv output, which would change the strides the KV store sees:
    # the torch code here (custom_ops="none").
    make_tiny_model("qwen2-hybrid-window", tmp_path)  # GQA, one windowed layer, two full ones
    args = EngineArgs(str(tmp_path), attention_backend="triton", dtype="float32", skip_tokenizer_init=True,
                      device="cpu", num_kv_blocks=64, disable_log_stats=True, custom_ops="none")
    engine = LLMEngine(args)
    recorded: list[KernelLaunch] = []
    run = KernelLaunch.__call__
    monkeypatch.setattr(KernelLaunch, "__call__", lambda launch: (recorded.append(launch), run(launch))[1])
    engine.add_request("0", list(range(3, 23)), SamplingParams(max_tokens=2, ignore_eos=True))
    shapes = engine_shapes(str(tmp_path), args, torch.float32)
    for step in (Step("prefill", (20,), (20,), graph=False), Step("decode", (1,), (21,), graph=False)):
        recorded.clear()
        engine.step()
        assert recorded
        built = attention_cases(shapes, step)
        assert {_compiled_view(x) for x in recorded} == {_compiled_view(c.launch) for c in built}


def _compiled_view(launch: KernelLaunch) -> tuple:
    """What an ahead-of-time compile of the launch depends on (plus its grid)."""
    args = tuple((str(a.dtype), tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a for a in launch.args)
    return (launch.name, launch.grid, args, tuple(sorted(launch.constexprs.items())), launch.num_warps,
            launch.num_stages, tuple(sorted(launch.options.items())))


def test_report_and_cli(reports, monkeypatch, capsys):
    text = format_report(reports["llama-3.1-8b"])
    assert "sm_90 = H100 SXM" in text and "sm_80 = A100 SXM" in text and "| sm_80 regs |" in text
    assert f"compiled by triton {triton.__version__}." in text  # the numbers are its release's
    assert "| _paged_prefill_kernel | prefill, mixed |" in text and "No kernel spills" in text
    # one request x 8 KV heads x 16 splits
    assert "| decode b=1 | _decode_segment_kernel | full attention | 128 |" in text
    broken = format_report(reports["broken"])
    assert "Problems:" in broken and "spills registers" in broken
    # The command prints the report and exits 1 when a kernel fails the check.
    for name, code in (("llama-3.1-8b", 0), ("broken", 1)):
        monkeypatch.setattr(gpu_compile, "compile_reports", lambda requests, r=reports[name]: [r])
        assert main(["bench", "gpu-compile", "--model", LLAMA, "--json"]) == code
        assert json.loads(capsys.readouterr().out)["ok"] == (code == 0)
    monkeypatch.undo()
    assert main(["bench", "gpu-compile", "--arch", "sm_70"]) == 1
    assert "unknown target 'sm_70'" in capsys.readouterr().err
