"""Where a served run's time goes, step by step: `kvflow serve` with a timer around each model step,
issue 17's load against it (`kvflow bench serve`), then the steps grouped by what they ran
(decode-only, mixed with prompt tokens) and the time the engine spent outside them.

    .venv/bin/python benchmarks/serve_steps.py [--port 8000] [-- kvflow serve flags ...]

The load is `--num-prompts 64 --input-len 256 --input-dist fixed --output-len 64 --concurrency 16`
(issue 17's served comparison). Only the steps from the load's first request on are counted.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

LOAD = ["--num-prompts", "64", "--input-len", "256", "--input-dist", "fixed", "--output-len", "64", "--concurrency", "16"]


def serve_timed(record: str, serve_args: list[str]) -> int:
    """`kvflow serve` in this process, every step appended to `record` as JSON lines:
    [start, seconds, decode rows (verifications' included), prompt tokens]."""
    from kvflow.entrypoints.cli import main
    from kvflow.executor.in_process import InProcessExecutor

    execute = InProcessExecutor.execute_model
    steps: list[list] = []

    def timed(self, sched):
        start = time.perf_counter()
        out = execute(self, sched)
        decode_rows = sum(c.num_tokens for c in sched.chunks if c.is_decode)
        steps.append([time.time(), time.perf_counter() - start, decode_rows, sched.num_batched_tokens - decode_rows])
        return out

    def flush() -> None:  # the server is killed, not stopped: write as it goes
        written = 0
        while True:
            time.sleep(0.5)
            with open(record, "a") as f:
                while written < len(steps):
                    f.write(json.dumps(steps[written]) + "\n")
                    written += 1

    InProcessExecutor.execute_model = timed
    threading.Thread(target=flush, daemon=True).start()
    return main(["serve", *serve_args])


def summarize(record: str, since: float) -> None:
    steps = [s for s in map(json.loads, open(record)) if s[0] >= since]
    groups = collections.defaultdict(lambda: [0, 0.0, 0, 0])
    for _, seconds, decode_rows, prompt_tokens in steps:
        g = groups["decode-only" if prompt_tokens == 0 else "mixed"]
        g[0] += 1
        g[1] += seconds
        g[2] += decode_rows
        g[3] += prompt_tokens
    busy = sum(s[1] for s in steps)
    span = steps[-1][0] - steps[0][0] + steps[-1][1]
    print(f"{len(steps)} steps over {span:.2f} s, {busy:.2f} s in steps, {span - busy:.2f} s outside them")
    print("| steps | count | seconds | ms a step | decode rows a step | prompt tokens a step |")
    print("|---|---|---|---|---|---|")
    for name, (n, seconds, rows, tokens) in sorted(groups.items()):
        print(f"| {name} | {n} | {seconds:.2f} | {1000 * seconds / n:.1f} | {rows / n:.1f} | {tokens / n:.1f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--serve-timed", metavar="RECORD", help=argparse.SUPPRESS)  # the server's own process
    args, serve_args = parser.parse_known_args()
    serve_args = [a for a in serve_args if a != "--"] + ["--port", str(args.port)]
    if args.serve_timed:
        return serve_timed(args.serve_timed, serve_args)
    record = tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False).name
    server = subprocess.Popen([sys.executable, __file__, "--serve-timed", record, *serve_args],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{args.port}"
        for _ in range(600):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        else:
            raise SystemExit("the server did not answer /health in 120 s")
        since = time.time()
        load = subprocess.run([sys.executable, "-m", "kvflow.entrypoints.cli", "bench", "serve", "--url", url, *LOAD,
                               "--json"], capture_output=True, text=True, check=True)
        result = json.loads([line for line in load.stdout.splitlines() if line.startswith("{")][-1])
        time.sleep(1)  # the last steps' records
        print(f"out tok/s {result['output_tok_s']:.1f}, TTFT p50 {result['ttft_ms']['p50']:.0f} ms, "
              f"ITL p50 {result['itl_ms']['p50']:.1f} ms")
        summarize(record, since)
    finally:
        server.kill()
        server.wait()
        os.unlink(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
