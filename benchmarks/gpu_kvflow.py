"""gpu_bench's phases 1 and 2, measured with kvflow's own code: the GPU's ceilings, then the engine.

kvflow: batch-1 decode (`kvflow bench latency`'s measurement, with MBU against the ceilings),
then offline throughput: all requests submitted at once, each with its own output length.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from gpu_phase import ResultFile, gpu_memory, log, max_context, seconds_left, sync, throughput_workload

from kvflow.bench.ceilings import Ceilings, measure_ceilings
from kvflow.bench.mbu import EngineShape, batch_work, utilization
from kvflow.bench.throughput import generate_counting_steps
from kvflow.sampling_params import SamplingParams


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

    engine.reset_prefix_cache()  # the latency prompt must not be a cache hit for anything later
    prompts, output_lens = throughput_workload(args, engine.arch.vocab_size)
    cap = min(args.kvflow_throughput_cap_s, seconds_left(args))
    out.put("throughput", kvflow_throughput(engine, prompts, output_lens, cap, ceilings, args.device))
    out.put("memory", gpu_memory(args.device))
    log(f"kvflow throughput {out.data['throughput']['output_tok_s']:.1f} output tok/s")


def kvflow_throughput(engine: Any, prompts: list[list[int]], output_lens: list[int], cap_s: float,
                      ceilings: Ceilings, device: str) -> dict[str, Any]:
    """All requests at once, each with its own max_tokens; counts engine steps for MBU. Past
    `cap_s` the unfinished requests are aborted and the tokens they had made still count (the
    result then says `complete: false`)."""
    params = SamplingParams(temperature=0, ignore_eos=True)
    # Warm-up on the workload's own first prompts: chunked prefills and decode batches of several
    # shapes, so Triton compiles its kernels' variants before the clock starts.
    generate_counting_steps(engine, prompts[:32], params.clone(max_tokens=8))
    engine.reset_prefix_cache()
    per_prompt = [params.clone(max_tokens=n) for n in output_lens]

    sync(device)
    start = time.perf_counter()
    run = generate_counting_steps(engine, prompts, per_prompt, deadline=start + cap_s)
    sync(device)
    elapsed = time.perf_counter() - start

    shape = EngineShape.from_engine(engine)
    # Cut short, only requests that made a token count as prefilled: MBU errs low, never high.
    started = [(len(p), n) for p, n in zip(prompts, run.output_lens) if n > 0]
    util = utilization(batch_work(shape.spec, started, run.steps, shape.dtype_bytes), elapsed, ceilings)
    prompt_tokens, output_tokens = sum(len(p) for p in prompts), sum(run.output_lens)
    return {
        "num_requests": len(prompts),
        "num_requests_finished": sum(m == n for m, n in zip(run.output_lens, output_lens)),
        "num_requests_aborted": sum(run.aborted),
        "complete": run.output_lens == output_lens,
        "time_cap_s": cap_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens_asked": sum(output_lens),
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "output_tok_s": output_tokens / elapsed,
        "total_tok_s": (prompt_tokens + output_tokens) / elapsed,
        "num_steps": run.steps,
        "num_preemptions": engine.get_stats().num_preemptions_total,
        "mbu": util.mbu,
        "mfu": util.mfu,
    }
