"""`kvflow bench gpu-compile`: every registered GPU kernel compiled for H100 and A100 on this
machine, at the launch configurations the engine would choose for a model, with each compiled
kernel's registers, spills, shared memory, cubin size and occupancy, and a roofline estimate of
each launch's time.

    kvflow bench gpu-compile [--arch sm_90,sm_80] [--model llama-3.1-8b|<config.json>] [--json]

The exit status is 1 when a kernel spills registers, needs more shared memory than its
target has, or the two tools reading its cubin disagree. Triton's interpreter mode cannot compile
(see kernel_compile), so under TRITON_INTERPRET=1 the work runs in a child process without it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from kvflow.config import EngineArgs

REGISTRY_MODULE = "kvflow.bench.gpu_kernels"
_BAD_REQUEST = 3  # the child's exit status for a ValueError (its message on stdout)
_ENGINE_FIELDS = ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_gb")


@dataclass(frozen=True)
class CompileRequest:
    model: str | None = None  # see engine_shapes()
    archs: str = "sm_90,sm_80"
    dtype: str = "bfloat16"
    context_len: int | None = None
    engine: dict[str, Any] = field(default_factory=dict)  # EngineArgs fields that shape kernels
    registry: str = REGISTRY_MODULE  # the module whose REGISTRY lists the kernels

    def check(self) -> None:
        """The errors that need no model: raised before any child process starts."""
        from kvflow.bench.ceilings import torch_dtype
        from kvflow.bench.gpu_targets import parse_targets

        parse_targets(self.archs)
        torch_dtype(self.dtype)
        unknown = set(self.engine) - set(_ENGINE_FIELDS)
        if unknown:
            raise ValueError(f"engine settings {sorted(unknown)} do not shape kernels; "
                             f"known: {', '.join(_ENGINE_FIELDS)}")


def compile_reports(requests: list[CompileRequest]) -> list[dict[str, Any]]:
    """One JSON-ready report per request; a kernel variant two requests share compiles once."""
    for request in requests:
        request.check()
    if _compilable_here():
        cache: dict = {}
        return [_report(request, cache) for request in requests]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the same kvflow and registry modules
    done = subprocess.run([sys.executable, "-m", __name__, json.dumps([asdict(r) for r in requests])], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode == _BAD_REQUEST:
        raise ValueError(done.stdout.strip())
    if done.returncode != 0:
        raise RuntimeError("the ahead-of-time compile (a child process without TRITON_INTERPRET) failed:\n"
                           + done.stderr)
    return json.loads(done.stdout)


def _compilable_here() -> bool:
    """False when triton was imported in interpreter mode: its own library is then interpreted."""
    try:
        from triton.language import standard
        from triton.runtime.jit import JITFunction
    except ImportError:
        raise ValueError("compiling GPU kernels needs triton: pip install 'kvflow[gpu]'") from None

    return isinstance(standard.cdiv, JITFunction)


def _report(request: CompileRequest, cache: dict) -> dict[str, Any]:
    import triton

    from kvflow.analysis.hardware import get_hardware
    from kvflow.analysis.planner import roofline
    from kvflow.bench.ceilings import torch_dtype
    from kvflow.bench.engine_shapes import DEFAULT_CONTEXT_LEN, engine_shapes
    from kvflow.bench.gpu_kernels import per_head_qk_norm
    from kvflow.bench.gpu_targets import parse_targets
    from kvflow.bench.kernel_compile import compile_launch

    targets = parse_targets(request.archs)
    shapes = engine_shapes(request.model, EngineArgs(**request.engine), torch_dtype(request.dtype),
                           request.context_len or DEFAULT_CONTEXT_LEN)
    registry = importlib.import_module(request.registry).REGISTRY
    cases = [case for step in shapes.steps() for entry in registry for case in entry.build(shapes, step)]
    variants: dict[tuple, dict[str, Any]] = {}  # one row per compiled kernel, in first-use order
    estimates: dict[tuple, dict[str, Any]] = {}
    for case in cases:
        for target in targets:
            compiled = compile_launch(case.launch, target, cache)
            row = variants.setdefault(id(compiled), {**compiled.to_json(), "steps": [],
                                                     "problems": compiled.problems(target)})
            if case.step not in row["steps"]:
                row["steps"].append(case.step)
        key = (case.launch.name, case.step, case.role)
        estimate = estimates.setdefault(key, {
            "kernel": case.launch.name, "step": case.step, "role": case.role, "programs": math.prod(case.launch.grid),
            "bytes": case.bytes_moved, "flops": case.flops, "per_forward": case.per_forward, "time": {}})
        for target in targets:
            seconds, bound = roofline(case.flops, case.bytes_moved, get_hardware(target.hardware), request.dtype)
            estimate["time"][target.arch] = {"hardware": target.hardware, "us": seconds * 1e6, "bound": bound}
    first_use = {name: i for i, name in reversed(list(enumerate(c.launch.name for c in cases)))}
    kernels = sorted(variants.values(), key=lambda k: first_use[k["kernel"]])  # a kernel's variants together
    a = shapes.arch
    return {
        "model": shapes.model, "dtype": request.dtype,
        "triton": triton.__version__,  # registers and spills are its compiler's: they change between releases
        "shapes": {"hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size, "num_heads": a.num_heads,
                   "num_kv_heads": a.num_kv_heads, "head_dim": a.head_dim, "windows": shapes.windows(),
                   "qk_norm": per_head_qk_norm(a), "block_size": shapes.block_size, "max_model_len": shapes.max_model_len,
                   "max_num_seqs": shapes.max_num_seqs, "max_num_batched_tokens": shapes.max_num_batched_tokens,
                   "num_kv_blocks": shapes.num_kv_blocks, "context_len": shapes.context_len},
        "steps": [{"name": s.name, "requests": len(s.query_lens), "tokens": s.num_tokens, "graph": s.graph}
                  for s in shapes.steps()],
        "targets": [{"arch": t.arch, "gpu": t.gpu, "num_sms": t.num_sms, "smem_per_block": t.smem_per_block}
                    for t in targets],
        "kernels": kernels,
        "estimates": list(estimates.values()),
        "ok": not any(k["problems"] for k in kernels),
    }


# -- CLI ---------------------------------------------------------------------------------------


def add_gpu_compile_parser(bench_subparsers) -> argparse.ArgumentParser:
    d = EngineArgs()
    p = bench_subparsers.add_parser(
        "gpu-compile", help="compile every GPU kernel for H100/A100 here (no GPU needed) and report its resources")
    p.add_argument("--arch", default="sm_90,sm_80", help="targets, comma-separated (sm_90: H100, sm_80: A100)")
    p.add_argument("--model", default=None,
                   help="default (SmolLM2-135M), a planner preset (e.g. llama-3.1-8b), a config.json, HF dir or .gguf")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="model dtype (default: what auto picks on these GPUs)")
    p.add_argument("--context-len", type=int, default=None, help="each decoding request's context (default 1024)")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_gpu_compile)
    return p


def run_gpu_compile(args: argparse.Namespace) -> int:
    from kvflow.bench.gpu_compile_report import format_report

    engine = {f: getattr(args, f) for f in _ENGINE_FIELDS if getattr(args, f, None) is not None}
    [report] = compile_reports([CompileRequest(args.model, args.arch, args.dtype, args.context_len, engine)])
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":  # the child process of compile_reports
    try:
        reports = compile_reports([CompileRequest(**r) for r in json.loads(sys.argv[1])])
    except (ValueError, FileNotFoundError) as e:
        print(e)
        sys.exit(_BAD_REQUEST)
    print(json.dumps(reports))
