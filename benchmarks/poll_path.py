"""GET a server path at a fixed rate until SIGTERM, then print how many polls answered 200 and
their mean latency: a live page's viewer (`/dashboard/state`), or a cheap control (`/health`),
beside a load (benchmarks/page_and_routes.sh)."""

import signal
import sys
import time

import httpx


def main(url: str, hz: float, path: str) -> None:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    ok, spent = 0, 0.0
    with httpx.Client(timeout=10, trust_env=False) as client:
        while not stop:
            started = time.perf_counter()
            ok += client.get(url + path).status_code == 200
            spent += time.perf_counter() - started
            time.sleep(max(0.0, 1 / hz - (time.perf_counter() - started)))
    print(f"polls {ok}, mean {1000 * spent / max(ok, 1):.1f} ms", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "/dashboard/state")
