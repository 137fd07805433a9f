"""Issue 6 on a GPU: kvflow against HF transformers on a dummy-weight Llama-3.1-8B, in one run.

    python benchmarks/gpu_bench.py --out bench-results/gpu                 # the 8B run on a GPU
    python benchmarks/gpu_bench.py --out /tmp/gb --device cpu --model DIR   # any config, on CPU

Three phases, each in its own process so no two engines share GPU memory (or a CUDA context):
1. ceilings: the GPU's copy bandwidth and bf16 matmul peak (`kvflow bench ceilings`' code);
2. kvflow: batch-1 decode (`kvflow bench latency`'s measurement, with MBU against 1.), then
   offline throughput: all requests submitted at once (continuous batching);
3. HF transformers: the same two workloads with `generate()`, a static KV cache and its decode
   step compiled (generate() compiles it itself when the cache is static, on a GPU), throughput
   in static batches (left-padded) in arrival order.

Throughput workload: --num-requests prompts of random token ids, prompt and output lengths each
uniform in [--min-len, --max-len] (seeded), EOS ignored so every request makes exactly its own
output length. For HF a batch generates until its longest request is done; only each request's
own output tokens count as useful.

Every phase runs under a time limit derived from --budget-s, so the whole run ends in time even
if a phase hangs; a killed phase keeps what it had written. HF's throughput may stop after fewer
requests (--hf-throughput-cap-s); kvflow's stops early only past --kvflow-throughput-cap-s, and
both outputs then say how many requests ran. Results: <out>/gpu_bench.json, <out>/gpu_bench.md,
and the phases' logs in <out>/gpu_bench.log.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
# Measure this checkout's engine, not whichever kvflow happens to be installed.
sys.path.insert(0, str(ROOT / "src"))

from kvflow.bench.ceilings import Ceilings, measure_ceilings  # noqa: E402
from kvflow.bench.mbu import (  # noqa: E402
    batch_work,
    latency_decode_work,
    load_ceilings,
    spec_from_arch,
    utilization,
)
from kvflow.bench.workloads import random_prompts  # noqa: E402
from kvflow.model.arch_config import ArchConfig  # noqa: E402

DEFAULT_MODEL = ROOT / "benchmarks" / "configs" / "llama-3.1-8b"
MBU_TARGET = 0.80
PHASE_MARGIN_S = 15  # a worker ends its measurement this long before it would be killed


# ---- the workloads ---------------------------------------------------------------------------


def throughput_workload(args: argparse.Namespace, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, output length of each): the same for every engine and every run with one seed."""
    prompts = random_prompts(args.num_requests, args.min_len, args.max_len, vocab_size, args.seed)
    rng = random.Random(args.seed + 1)  # a stream of its own: prompts stay `random_prompts`' for the seed
    return prompts, [rng.randint(args.min_len, args.max_len) for _ in prompts]


def latency_prompt(args: argparse.Namespace, vocab_size: int) -> list[int]:
    """The prompt `kvflow.bench.latency.measure_latency` draws, so HF decodes after the same one."""
    return random_prompts(1, args.latency_input_len, args.latency_input_len, vocab_size, args.seed)[0]


def max_context(args: argparse.Namespace) -> int:
    """The longest sequence any workload makes: a prompt plus its output."""
    return max(2 * args.max_len, args.latency_input_len + args.latency_output_len)


def arch_of(model_dir: str) -> ArchConfig:
    return ArchConfig.from_hf(json.loads((Path(model_dir) / "config.json").read_text()))


def sync(device: str) -> None:
    """Wait for queued GPU work, so a clock read after it covers that work."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def seconds_left(args: argparse.Namespace) -> float:
    return args.deadline - time.time() - PHASE_MARGIN_S


def log(message: str) -> None:
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


class ResultFile:
    """A phase's JSON result, rewritten after each step, so a phase killed midway keeps the rest."""

    def __init__(self, path: str) -> None:
        self.path, self.data = Path(path), {}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=2))


def gpu_memory(device: str) -> dict[str, float]:
    if not device.startswith("cuda"):
        return {}
    return {"gpu_max_allocated_gb": torch.cuda.max_memory_allocated(device) / 1e9,
            "gpu_max_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9}


# ---- phase 1: ceilings -----------------------------------------------------------------------


def phase_ceilings(args: argparse.Namespace, out: ResultFile) -> None:
    c = measure_ceilings(args.dtype, args.device, copy_bytes=args.copy_mib * 2**20, max_n=args.max_matmul_n)
    out.put("ceilings", c.to_json())
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    out.put("device", {"name": name, "torch": torch.__version__, "cuda": torch.version.cuda,
                       "triton": _version_of("triton")})


def _version_of(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


# ---- phase 2: kvflow -------------------------------------------------------------------------


def phase_kvflow(args: argparse.Namespace, ceilings: Ceilings, out: ResultFile) -> None:
    from kvflow import LLM
    from kvflow.bench.latency import LatencyWorkload, measure_latency

    backend = args.attention_backend or ("triton" if args.device.startswith("cuda") else "torch_sdpa")
    engine_args = {
        "load_format": "dummy", "skip_tokenizer_init": True, "dtype": args.dtype, "device": args.device,
        "attention_backend": backend, "max_model_len": args.max_model_len or max_context(args),
        "kv_cache_memory_gb": args.kv_cache_memory_gb, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "enforce_eager": args.enforce_eager,
        "disable_log_stats": True, "seed": args.seed,
    }
    start = time.perf_counter()
    llm = LLM(model=args.model, **engine_args)
    sync(args.device)
    engine = llm.llm_engine
    out.put("engine", {**engine_args, "init_s": time.perf_counter() - start, "num_kv_blocks": engine.num_kv_blocks,
                       "cuda_graphs": engine.config.use_cuda_graphs})
    log(f"kvflow engine ready in {out.data['engine']['init_s']:.1f} s")

    workload = LatencyWorkload(args.latency_input_len, args.latency_output_len, args.latency_iters, args.seed)
    out.put("latency", measure_latency(engine, workload, ceilings))
    log(f"kvflow batch-1 decode {out.data['latency']['decode_tok_s']:.1f} tok/s, MBU {out.data['latency']['mbu']:.1%}")

    llm.reset_prefix_cache()  # the latency prompt must not be a cache hit for anything later
    prompts, output_lens = throughput_workload(args, engine.arch.vocab_size)
    cap = min(args.kvflow_throughput_cap_s, seconds_left(args))
    out.put("throughput", kvflow_throughput(llm, prompts, output_lens, cap, ceilings, args.device))
    out.put("memory", gpu_memory(args.device))
    log(f"kvflow throughput {out.data['throughput']['output_tok_s']:.1f} output tok/s")


def kvflow_throughput(llm: Any, prompts: list[list[int]], output_lens: list[int], cap_s: float,
                      ceilings: Ceilings, device: str) -> dict[str, Any]:
    """All requests at once, each with its own max_tokens; counts engine steps for MBU.

    `kvflow.bench.throughput` gives every request one output length and has no time limit, so
    the engine is driven here; past `cap_s` the unfinished requests are aborted and the tokens
    they had made still count (the result then says `complete: false`)."""
    from kvflow import SamplingParams
    from kvflow.bench.mbu import EngineShape
    from kvflow.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    # Warm-up on the workload's own first prompts: chunked prefills and decode batches of several
    # shapes, so Triton compiles its kernels' variants before the clock starts.
    llm.generate([{"prompt_token_ids": p} for p in prompts[:32]], params.clone(max_tokens=8), use_tqdm=False)
    llm.reset_prefix_cache()

    sync(device)
    start = time.perf_counter()
    ids = [engine.add_request(None, {"prompt_token_ids": p}, params.clone(max_tokens=n))
           for p, n in zip(prompts, output_lens)]
    produced: dict[str, int] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if time.perf_counter() - start > cap_s:
            unfinished = [i for i in ids if i not in produced]
            produced |= {o.request_id: len(o.outputs[0].token_ids) for o in engine.abort_request(unfinished)}
            break
        steps += 1
        for o in engine.step():
            if o.finished:
                produced[o.request_id] = len(o.outputs[0].token_ids)
    sync(device)
    elapsed = time.perf_counter() - start

    made = [produced.get(i, 0) for i in ids]
    shape = EngineShape.from_engine(engine)
    # Cut short, only requests that made a token count as prefilled: MBU errs low, never high.
    started = [(len(p), n) for p, n in zip(prompts, made) if n > 0]
    util = utilization(batch_work(shape.spec, started, steps, shape.dtype_bytes), elapsed, ceilings)
    prompt_tokens, output_tokens = sum(len(p) for p in prompts), sum(made)
    return {
        "num_requests": len(prompts),
        "num_requests_finished": sum(m == n for m, n in zip(made, output_lens)),
        "complete": made == output_lens,
        "time_cap_s": cap_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens_asked": sum(output_lens),
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "output_tok_s": output_tokens / elapsed,
        "total_tok_s": (prompt_tokens + output_tokens) / elapsed,
        "num_steps": steps,
        "num_preemptions": engine.get_stats().num_preemptions_total,
        "mbu": util.mbu,
        "mfu": util.mfu,
    }


# ---- phase 3: HF transformers ----------------------------------------------------------------


class HFRunner:
    """`generate()` with one static KV cache per batch size, sized for the longest request, so
    every call of a size reuses the same cache tensors and the same compiled decode step."""

    def __init__(self, model: Any, max_cache_len: int, device: str) -> None:
        self.model, self.max_cache_len, self.device = model, max_cache_len, device
        self.caches: dict[int, Any] = {}
        self.compile_config = hf_compile_config(device)

    def generate(self, batch: list[list[int]], new_tokens: int) -> None:
        from transformers import StaticCache

        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=self.device)
        cache = self.caches.get(len(batch))
        if cache is None:
            cache = self.caches[len(batch)] = StaticCache(config=self.model.config, max_cache_len=self.max_cache_len)
        extra = {"compile_config": self.compile_config} if self.compile_config else {}
        with torch.inference_mode():  # the cache's tensors are inference tensors: reset them inside too
            cache.reset()
            self.model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, do_sample=False,
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0, **extra)

    def timed(self, batch: list[list[int]], new_tokens: int) -> float:
        sync(self.device)
        start = time.perf_counter()
        self.generate(batch, new_tokens)
        sync(self.device)
        return time.perf_counter() - start


def hf_compile_config(device: str) -> Any:
    """generate() compiles the decode step (never the prefill, whose shape changes) when the cache
    is static, on a GPU only; dynamic=False specialises each batch size, its fastest code."""
    from transformers import CompileConfig

    return CompileConfig(dynamic=False) if device.startswith("cuda") else None


def phase_hf(args: argparse.Namespace, ceilings: Ceilings, out: ResultFile) -> None:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    compile_config = hf_compile_config(args.device)
    start = time.perf_counter()
    config = AutoConfig.from_pretrained(args.model)
    with torch.device(args.device):  # random init straight on the GPU: no 16 GB host copy
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).eval()
    sync(args.device)
    out.put("engine", {"transformers": transformers.__version__, "init_s": time.perf_counter() - start,
                       "attn_implementation": getattr(model.config, "_attn_implementation", None),
                       "decode_compile_config": compile_config.to_dict() if compile_config else None})
    log(f"HF model ready in {out.data['engine']['init_s']:.1f} s")
    spec = spec_from_arch(arch_of(args.model))

    n_in, n_out = args.latency_input_len, args.latency_output_len
    lat = HFRunner(model, n_in + n_out, args.device)
    prompt = latency_prompt(args, config.vocab_size)
    start = time.perf_counter()
    for _ in range(2):  # compile, then CUDA-graph recording, both outside the timing
        lat.generate([prompt], min(8, n_out))
    warmup_s = time.perf_counter() - start
    ttft = statistics.median(lat.timed([prompt], 1) for _ in range(args.latency_iters))
    full = statistics.median(lat.timed([prompt], n_out) for _ in range(args.latency_iters))
    decode_s = full - ttft
    util = utilization(latency_decode_work(spec, n_in, n_out, getattr(torch, args.dtype).itemsize), decode_s, ceilings)
    out.put("latency", {"input_len": n_in, "output_len": n_out, "warmup_s": warmup_s, "ttft_ms": ttft * 1e3,
                        "decode_tok_s": (n_out - 1) / decode_s, "mbu": util.mbu, "mfu": util.mfu})
    log(f"HF batch-1 decode {out.data['latency']['decode_tok_s']:.1f} tok/s, MBU {util.mbu:.1%}")

    prompts, output_lens = throughput_workload(args, config.vocab_size)
    out.put("throughput", hf_throughput(args, model, prompts, output_lens))
    out.put("dynamo", dynamo_counts())
    out.put("memory", gpu_memory(args.device))
    log(f"HF throughput {out.data['throughput']['output_tok_s']:.1f} useful output tok/s "
        f"({out.data['throughput']['num_requests_finished']} of {args.num_requests} requests)")


def hf_throughput(args: argparse.Namespace, model: Any, prompts: list[list[int]],
                  output_lens: list[int]) -> dict[str, Any]:
    """Static batches in arrival order until the time cap; the batch that would cross it is not
    started, so the requests run are a prefix of the workload."""
    runner = HFRunner(model, 2 * args.max_len, args.device)
    size = args.hf_batch_size
    batches = [(prompts[i:i + size], output_lens[i:i + size]) for i in range(0, len(prompts), size)]
    start = time.perf_counter()
    for batch, _ in {len(b): (b, n) for b, n in batches}.values():  # compile each batch size once, untimed
        runner.generate(batch, min(4, args.max_len))
    warmup_s = time.perf_counter() - start

    cap = min(args.hf_throughput_cap_s, seconds_left(args))
    elapsed, last, run, generated = 0.0, 0.0, 0, 0
    for batch, lens in batches:
        if run and elapsed + last > cap:
            break
        last = runner.timed(batch, max(lens))
        elapsed += last
        run += len(batch)
        generated += max(lens) * len(batch)
    prompt_tokens = sum(len(p) for p in prompts[:run])
    useful = sum(output_lens[:run])
    return {
        "batch_size": size,
        "num_requests": len(prompts),
        "num_requests_finished": run,
        "complete": run == len(prompts),
        "time_cap_s": cap,
        "warmup_s": warmup_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": useful,
        "generated_tokens": generated,  # padding rows included: what the GPU actually computed
        "elapsed_s": elapsed,
        "output_tok_s": useful / elapsed,
        "total_tok_s": (prompt_tokens + useful) / elapsed,
    }


def dynamo_counts() -> dict[str, int]:
    """Graphs compiled and graph breaks: a break would leave part of the decode step eager."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


# ---- the orchestrator ------------------------------------------------------------------------

PHASES = {"ceilings": phase_ceilings, "kvflow": phase_kvflow, "hf": phase_hf}


def run_phase(name: str, argv: list[str], timeout: float, workdir: Path, log_file: Path,
              ceilings_path: Path | None) -> dict[str, Any]:
    """One phase in a fresh interpreter; its result, with how it ended under "phase"."""
    result_path = workdir / f"{name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--phase", name, "--result", str(result_path),
           "--deadline", str(time.time() + timeout)]
    if ceilings_path is not None:
        cmd += ["--ceilings-json", str(ceilings_path)]
    log(f"phase {name}: up to {timeout:.0f} s")
    start = time.perf_counter()
    with log_file.open("a") as logf:
        logf.write(f"\n===== phase {name} =====\n")
        logf.flush()
        try:
            proc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout, check=False)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "killed at its time limit"
    wall = time.perf_counter() - start
    log(f"phase {name}: {'ok' if rc == 0 else f'FAILED ({rc}), see {log_file}'} after {wall:.0f} s")
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    return {**result, "phase": {"rc": rc, "wall_s": wall, "time_limit_s": timeout}}


def orchestrate(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_file = out_dir / "gpu_bench.log"
    log_file.write_text("")
    deadline = time.monotonic() + args.budget_s
    workdir = Path(tempfile.mkdtemp(prefix="gpu-bench-"))

    if args.ceilings_json:
        ceilings_result = {"ceilings": load_ceilings(args.ceilings_json).to_json(), "device": {"name": args.device}}
    else:
        ceilings_result = run_phase("ceilings", argv, min(120.0, args.budget_s), workdir, log_file, None)
    if "ceilings" not in ceilings_result:
        raise SystemExit(f"gpu_bench: the ceilings phase failed; see {log_file}")
    ceilings_path = workdir / "ceilings-only.json"
    ceilings_path.write_text(json.dumps(ceilings_result["ceilings"]))

    hf_reserve = 0 if args.skip_hf else args.hf_reserve_s
    kvflow = run_phase("kvflow", argv, max(60.0, deadline - time.monotonic() - hf_reserve), workdir, log_file,
                       ceilings_path)
    hf = None
    if not args.skip_hf:
        hf = run_phase("hf", argv, max(60.0, deadline - time.monotonic() - 5), workdir, log_file, ceilings_path)

    report = summarize(args, ceilings_result, kvflow, hf)
    (out_dir / "gpu_bench.json").write_text(json.dumps(report, indent=2))
    (out_dir / "gpu_bench.md").write_text(markdown(report))
    return report


def _get(d: dict | None, *keys: str) -> Any:
    for key in keys:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return None if ours is None or theirs is None or theirs == 0 else ours / theirs


def summarize(args: argparse.Namespace, ceilings: dict, kvflow: dict, hf: dict | None) -> dict[str, Any]:
    def both(*keys: str) -> float | None:
        return _ratio(_get(kvflow, *keys), _get(hf, *keys))

    ratios = {"decode_tok_s": both("latency", "decode_tok_s"),
              "throughput_output_tok_s": both("throughput", "output_tok_s"),
              "throughput_total_tok_s": both("throughput", "total_tok_s")}
    mbu = _get(kvflow, "latency", "mbu")
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": str(args.model),
        "dtype": args.dtype,
        "device": ceilings.get("device"),
        "ceilings": ceilings["ceilings"],
        "workloads": {
            "latency": {"input_len": args.latency_input_len, "output_len": args.latency_output_len,
                        "iters": args.latency_iters},
            "throughput": {"num_requests": args.num_requests, "min_len": args.min_len, "max_len": args.max_len,
                           "seed": args.seed, "hf_batch_size": args.hf_batch_size},
        },
        "kvflow": kvflow,
        "hf": hf,
        "ratios_kvflow_over_hf": ratios,
        "goal": {
            "batch1_mbu": mbu,
            "batch1_mbu_target": MBU_TARGET,
            "batch1_mbu_met": None if mbu is None else mbu >= MBU_TARGET,
            "ahead_of_hf_decode": None if ratios["decode_tok_s"] is None else ratios["decode_tok_s"] > 1,
            "ahead_of_hf_throughput": None if ratios["throughput_output_tok_s"] is None
            else ratios["throughput_output_tok_s"] > 1,
        },
    }


def markdown(r: dict[str, Any]) -> str:
    kv, hf, ratios = r["kvflow"], r["hf"], r["ratios_kvflow_over_hf"]
    lat, tput = r["workloads"]["latency"], r["workloads"]["throughput"]
    c, goal, asked = r["ceilings"], r["goal"], tput["num_requests"]
    rows = [
        (f"batch-1 decode, tok/s ({lat['input_len']}-token prompt, {lat['output_len']} new)",
         _num(_get(kv, "latency", "decode_tok_s")), _num(_get(hf, "latency", "decode_tok_s")),
         _num(ratios["decode_tok_s"], "**{:.2f}×**")),
        ("batch-1 decode MBU", _pct(_get(kv, "latency", "mbu")), _pct(_get(hf, "latency", "mbu")), ""),
        ("throughput, output tok/s", _num(_get(kv, "throughput", "output_tok_s")),
         _num(_get(hf, "throughput", "output_tok_s")), _num(ratios["throughput_output_tok_s"], "**{:.2f}×**")),
        ("throughput, total tok/s", _num(_get(kv, "throughput", "total_tok_s")),
         _num(_get(hf, "throughput", "total_tok_s")), _num(ratios["throughput_total_tok_s"], "{:.2f}×")),
        ("throughput, requests run", _requests(_get(kv, "throughput"), asked),
         _requests(_get(hf, "throughput"), asked), ""),
    ]
    kv_tput = _get(kv, "throughput") or {}
    hf_decode = "eager" if _get(hf, "engine", "decode_compile_config") is None else "compiled"
    lines = [
        (f"kvflow vs HF transformers {_get(hf, 'engine', 'transformers') or ''} on "
         f"{_get(r, 'device', 'name') or '?'}, {Path(r['model']).name} (dummy weights), {r['dtype']}, {r['date']}"),
        "",
        (f"Measured in this run: copy bandwidth {c['memory_bandwidth_gb_s']:.0f} GB/s, "
         f"{c['dtype']} matmul {c['peak_flops'] / 1e12:.0f} TFLOP/s."),
        "",
        "| workload | kvflow | HF generate() | kvflow / HF |",
        "|---|---|---|---|",
        *(f"| {' | '.join(row)} |" for row in rows),
        "",
        (f"Throughput: {asked} requests, prompt and output lengths uniform in {tput['min_len']}–{tput['max_len']} "
         f"(seed {tput['seed']}), EOS ignored; kvflow gets them all at once, HF runs static batches of "
         f"{tput['hf_batch_size']} (left-padded, static cache, {hf_decode} decode step) and is credited only each "
         "request's own output tokens."),
        (f"kvflow throughput MBU {_pct(kv_tput.get('mbu'))}, MFU {_pct(kv_tput.get('mfu'))}, "
         f"{_num(kv_tput.get('num_steps'), '{:.0f}')} steps, {_num(kv_tput.get('num_preemptions'), '{:.0f}')} "
         "preemptions."),
        "",
        (f"Goal (issue 6): batch-1 MBU ≥ {MBU_TARGET:.0%}: {_verdict(goal['batch1_mbu_met'])}; ahead of HF on "
         f"decode: {_verdict(goal['ahead_of_hf_decode'])}; on throughput: {_verdict(goal['ahead_of_hf_throughput'])}."),
    ]
    failed = [f"{name} ({_get(res, 'phase', 'rc')})" for name, res in (("kvflow", kv), ("hf", hf))
              if res is not None and _get(res, "phase", "rc") != 0]
    if failed:
        lines.append(f"Phases that did not finish: {', '.join(failed)}; see gpu_bench.log.")
    return "\n".join(lines) + "\n"


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if x is None else fmt.format(x)


def _pct(x: float | None) -> str:
    return _num(None if x is None else 100 * x, "{:.1f}%")


def _requests(t: dict | None, asked: int) -> str:
    if t is None:
        return "—"
    note = "" if t["complete"] else f" (stopped at its {t['time_cap_s']:.0f} s cap)"
    return f"{t['num_requests_finished']} of {asked}{note}"


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "NOT met")


# ---- CLI -------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for gpu_bench.json, gpu_bench.md, gpu_bench.log")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="directory with a config.json (weights are random)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=540, help="the whole run's time; phases are killed past it")
    w = p.add_argument_group("workloads")
    w.add_argument("--num-requests", type=int, default=512)
    w.add_argument("--min-len", type=int, default=100, help="shortest prompt and shortest output")
    w.add_argument("--max-len", type=int, default=1024, help="longest prompt and longest output")
    w.add_argument("--latency-input-len", type=int, default=32)
    w.add_argument("--latency-output-len", type=int, default=128)
    w.add_argument("--latency-iters", type=int, default=3, help="timed batch-1 runs; the median is reported")
    k = p.add_argument_group("kvflow")
    k.add_argument("--attention-backend", default=None, help="default: triton on CUDA, torch_sdpa on CPU")
    k.add_argument("--max-model-len", type=int, default=None, help="default: the longest prompt + output asked")
    k.add_argument("--kv-cache-memory-gb", type=float, default=30.0)
    k.add_argument("--max-num-seqs", type=int, default=256)
    k.add_argument("--max-num-batched-tokens", type=int, default=8192)
    k.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    k.add_argument("--kvflow-throughput-cap-s", type=float, default=240,
                   help="abort kvflow's unfinished requests past this (reported, never silent)")
    h = p.add_argument_group("HF transformers")
    h.add_argument("--hf-batch-size", type=int, default=64)
    h.add_argument("--hf-throughput-cap-s", type=float, default=120,
                   help="start no HF batch past this; fewer requests are then run (and reported)")
    h.add_argument("--hf-reserve-s", type=float, default=210, help="time of the budget kept for the HF phase")
    h.add_argument("--skip-hf", action="store_true")
    c = p.add_argument_group("ceilings")
    c.add_argument("--ceilings-json", default=None, help="`kvflow bench ceilings --json` output instead of measuring")
    c.add_argument("--copy-mib", type=int, default=128, help="size of the timed copy")
    c.add_argument("--max-matmul-n", type=int, default=None, help="largest square matmul timed")
    # Set by the orchestrator for the process of one phase.
    p.add_argument("--phase", choices=list(PHASES), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 1 <= args.min_len <= args.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.phase:
        result = ResultFile(args.result)
        ceilings = load_ceilings(args.ceilings_json) if args.ceilings_json else None
        PHASES[args.phase](args, *([] if args.phase == "ceilings" else [ceilings]), result)
        return 0
    report = orchestrate(args, argv)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
