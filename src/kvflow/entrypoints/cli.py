"""The `kvflow` command: serve, generate, chat, bench, plan, quantize, train-drafter, eval."""

from __future__ import annotations

import argparse
import sys

from kvflow import settings
from kvflow.config import EngineArgs
from kvflow.entrypoints.openai.limits import ServerLimits
from kvflow.sampling_params import RequestOutputKind, SamplingParams

SERVE_MAX_NUM_BATCHED_TOKENS = 1024  # `kvflow serve`'s default; offline (LLM, bench): EngineArgs' 4096


class ServeDefault(int):
    """A flag's value that `kvflow serve` chose, not its user (an int everywhere else)."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        if _runs_a_worker_rank(args):
            return 0
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"kvflow: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _runs_a_worker_rank(args: argparse.Namespace) -> bool:
    """Under torchrun (or --node-rank > 0) every rank runs the same command; rank 0 runs it, the
    others become its tensor-parallel workers. Only commands that run an engine (its flags include
    --distributed-init-method): `kvflow plan --tensor-parallel-size N` plans for N ranks, it runs none."""
    if not hasattr(args, "distributed_init_method") or args.tensor_parallel_size * args.pipeline_parallel_size == 1:
        return False
    from kvflow.worker.worker_process import external_rank, run_external_rank

    engine_args = EngineArgs.from_cli_args(args)
    init = external_rank(engine_args)
    if init is not None:
        run_external_rank(engine_args, init)
    return init is not None


def build_parser() -> argparse.ArgumentParser:
    from kvflow.bench.ceilings import add_ceilings_parser
    from kvflow.bench.disagg import add_disagg_parser
    from kvflow.bench.gpu_compile import add_gpu_compile_parser
    from kvflow.bench.latency import add_latency_parser
    from kvflow.bench.lora import add_lora_bench_parser
    from kvflow.bench.memory import add_memory_parser
    from kvflow.bench.serve import add_serve_bench_parser
    from kvflow.bench.throughput import add_throughput_parser
    from kvflow.entrypoints.plan_cli import add_plan_parser
    from kvflow.entrypoints.quantize_cli import add_quantize_parser
    from kvflow.entrypoints.router import add_router_parser
    from kvflow.entrypoints.train_drafter_cli import add_train_drafter_parser
    from kvflow.eval.perplexity import add_eval_parser

    parser = argparse.ArgumentParser(prog="kvflow", description="LLM inference with a paged KV cache and continuous batching")
    sub = parser.add_subparsers(title="commands")

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, models, metrics)")
    add_server_args(serve)
    EngineArgs.add_cli_args(serve)
    # A server's prompts come in bursts of clients: 1,024 tokens a step let the first of a burst
    # stream sooner (TTFT p50 −25% against 2,048 for −2% throughput, docs/performance-journal.md, stop 28),
    # as vLLM also gives its API server a smaller default budget than its `LLM`; left unset, the
    # budget also follows the machine's speed (engine/step_budget.py). And the KV pool's pages are
    # mapped in only while no step runs, so that the first requests keep both cores.
    serve.set_defaults(func=run_serve, max_num_batched_tokens=ServeDefault(SERVE_MAX_NUM_BATCHED_TOKENS),
                       kv_populate="when-idle")

    gen = sub.add_parser("generate", help="stream a completion of one prompt")
    gen.add_argument("prompt")
    add_sampling_args(gen)
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=run_generate)

    chat = sub.add_parser("chat", help="multi-turn streaming chat in the terminal")
    chat.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(chat, max_tokens=512, temperature=0.7)
    EngineArgs.add_cli_args(chat)
    chat.set_defaults(func=run_chat)

    bench = sub.add_parser("bench", help="measure throughput, latency and machine ceilings")
    bench_sub = bench.add_subparsers(title="benchmarks")
    add_throughput_parser(bench_sub)
    add_latency_parser(bench_sub)
    add_ceilings_parser(bench_sub)
    add_serve_bench_parser(bench_sub)
    add_lora_bench_parser(bench_sub)
    add_gpu_compile_parser(bench_sub)
    add_disagg_parser(bench_sub)
    add_memory_parser(bench_sub)
    add_plan_parser(sub)
    add_quantize_parser(sub)
    add_train_drafter_parser(sub)
    add_router_parser(sub)
    add_eval_parser(sub)
    return parser


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port; the URL is printed)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 and /metrics (default: $KVFLOW_API_KEY)")
    g.add_argument("--disable-metrics-auth", action="store_true",
                   help="serve /metrics without the API key, e.g. to a Prometheus scraper on a private network "
                        "(its prefix-cache counters then tell anyone who reaches the port whether a prompt was sent)")
    g.add_argument("--disable-dashboard", action="store_true",
                   help="do not serve the live engine page (/dashboard: KV blocks, requests, steps; its state behind "
                        "the API key). It is on by default because it costs the engine nothing until a viewer opens "
                        "it: one flag read per step")
    g.add_argument("--allowed-hosts", action="append", default=None, metavar="HOST[,HOST...]",
                   help="Host header names requests may give besides loopback ones (e.g. a reverse proxy's); '*': "
                        "any. On a loopback bind (the default) other names get 403, against web pages reaching the "
                        "server by DNS rebinding; on another bind there is no check unless this is given")
    g.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGIN[,ORIGIN...]",
                   help="origins whose web pages may call the API (CORS, e.g. http://localhost:3000); "
                        "default: none, no CORS headers")
    g.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    g.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--disallow-special-tokens-in-content", action="store_true",
                   help="tokenize special-token text in chat messages as plain text, so users cannot forge roles")
    g.add_argument("--tool-call-parser", default="hermes", choices=["hermes"],
                   help="the format tool calls are read from when tool_choice is auto")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served by name (needs --enable-lora): name=path, or JSON {\"name\", \"path\"}")
    g.add_argument("--allow-runtime-lora-updating", action=argparse.BooleanOptionalAction, default=None,
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which let clients make the "
                        "server read adapters from its disk (default: $KVFLOW_ALLOW_RUNTIME_LORA_UPDATING)")
    ServerLimits.add_cli_args(parser)


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 128, temperature: float = 0.0) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=temperature)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.sampling_seed, stop=args.stop,
        output_kind=RequestOutputKind.DELTA,
    )


def stream(engine, prompt, params: SamplingParams, out=sys.stdout) -> str:
    """Run one request to the end, printing text as it is released; returns the full text."""
    request_id = engine.add_request(None, prompt, params)
    pieces = []
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                piece = output.outputs[0].text
                pieces.append(piece)
                out.write(piece)
                out.flush()
    except KeyboardInterrupt:
        engine.abort_request(request_id)
    out.write("\n")
    return "".join(pieces)


def run_serve(args: argparse.Namespace) -> int:
    from kvflow.entrypoints.openai.api_server import run_server

    # Without --max-num-batched-tokens the budget follows the machine's speed once the engine is
    # warm; a budget given is kept as it is.
    args.fit_token_budget = isinstance(args.max_num_batched_tokens, ServeDefault)
    # Flags not given take the user's settings (kvflow/settings.py), read here, inside main's error
    # handling: a variable it cannot read is a one-line error naming it.
    user = settings.get()
    if args.api_key is None:
        args.api_key = user.api_key
    if args.allow_runtime_lora_updating is None:
        args.allow_runtime_lora_updating = user.allow_runtime_lora_updating
    return run_server(args)


def run_generate(args: argparse.Namespace) -> int:
    from kvflow.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs.from_cli_args(args))
    stream(engine, args.prompt, sampling_params_from_args(args))
    return 0


def run_chat(args: argparse.Namespace) -> int:
    from kvflow.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs.from_cli_args(args))
    tokenizer = engine.get_tokenizer()
    if not tokenizer.chat_template:
        raise ValueError(f"{args.model or 'this model'} has no chat template (a base model?): "
                         "use `kvflow generate` for plain completions")
    params = sampling_params_from_args(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("kvflow chat — /reset clears the conversation, /exit or Ctrl-D quits.")
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print()
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
        try:
            reply = stream(engine, prompt, params)
        except ValueError as e:  # e.g. the conversation outgrew the context: say so, keep chatting
            print(f"[error] {e}; try /reset")
            history.pop()
            continue
        history.append({"role": "assistant", "content": reply})


if __name__ == "__main__":
    sys.exit(main())
