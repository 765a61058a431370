#!/usr/bin/env bash
# GPU tests of the NCCL backend (feature `nccl`): the tests in transports/src/nccl/cuda.rs that a
# plain `cargo test` reports as ignored because they need a GPU (the device conformance suite on
# CUDA, a real stream hang ended by abort, non-blocking init and split, the NCCL version gates),
# then `cohort bench --transport nccl` on one GPU (every collective size checked).
#
#   scripts/gpu-tests.sh          build, then run: one go on a GPU machine with a Rust toolchain
#   scripts/gpu-tests.sh build    build the test binary and the cohort binary (release) with
#                                 --features nccl and copy them to gpu-bin/
#                                 (no GPU needed: build here, copy gpu-bin/ to the GPU machine)
#   scripts/gpu-tests.sh run      run gpu-bin/cohort_transports-tests, then
#                                 gpu-bin/cohort bench --transport nccl --ranks 1, on the GPU machine
#
# `run` fails (exit 1) when no GPU or driver is visible, when CUDA or NCCL cannot be loaded, when
# any test fails, or when the benchmark fails (or finds a wrong result): a GPU test that could not
# run is never counted as passed.
#
# NCCL: cudarc dlopens `libnccl.so`, not NCCL's soname `libnccl.so.2`. Set NCCL_LIB to NCCL's
# library file (for example .../site-packages/nvidia/nccl/lib/libnccl.so.2). When it is unset the
# script looks in the pip wheels python3 sees (nvidia-nccl-cu12 / nvidia-nccl-cu13, which PyTorch
# pulls in), then in the usual system folders and ldconfig's cache, and puts a folder holding a
# `libnccl.so` link to what it found on LD_LIBRARY_PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=gpu-bin/cohort_transports-tests
COHORT=gpu-bin/cohort
FILTER=nccl::cuda::tests::
PROBE=nccl::cuda::tests::gpu_probe_finds_cuda_nccl_and_a_device
# One GPU: world size 1, every size from 8 B to 64 MiB checked against the reference.
BENCH=(bench --transport nccl --ranks 1 -b 8 -e 64M -f 8 -n 20 -w 5)

# Reads cargo's JSON messages on stdin; prints the path of the last executable built for target $1.
executable() {
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$1" | tail -1
}

# Copies executable $1 to $2 without its debug info.
install_bin() {
    mkdir -p "$(dirname "$2")"
    cp "$1" "$2"
    # Debug info is most of a binary (about 90 of the test binary's 95 MB): drop it so gpu-bin/
    # travels light. Function names stay, so backtraces still say where a test failed.
    if command -v strip >/dev/null; then
        strip --strip-debug "$2"
    fi
    echo "built $2 ($(du -h "$2" | cut -f1))"
}

build() {
    local bin
    bin=$(cargo test -p cohort-transports --features nccl --lib --no-run --message-format=json |
        executable cohort_transports)
    if [[ -z "$bin" ]]; then
        echo "the build produced no cohort_transports test binary" >&2
        exit 1
    fi
    install_bin "$bin" "$BIN"
    bin=$(cargo build --release -p cohort-cli --features nccl --bin cohort --message-format=json | executable cohort)
    if [[ -z "$bin" ]]; then
        echo "the build produced no cohort binary" >&2
        exit 1
    fi
    install_bin "$bin" "$COHORT"
}

# Prints the path of NCCL's shared library, or nothing.
find_nccl() {
    local dir lib
    if command -v python3 >/dev/null; then
        while IFS= read -r dir; do
            [[ -n "$dir" && -d "$dir/nvidia" ]] || continue
            lib=$(find "$dir/nvidia" -maxdepth 4 -name 'libnccl.so*' 2>/dev/null | sort | head -1)
            if [[ -n "$lib" ]]; then
                echo "$lib"
                return
            fi
        done < <(python3 -c 'import site, sys
dirs = site.getsitepackages() + [site.getusersitepackages()] + sys.path
print("\n".join(dict.fromkeys(dirs)))' 2>/dev/null || true)
    fi
    for lib in ${CONDA_PREFIX:+"$CONDA_PREFIX/lib/libnccl.so.2"} /usr/lib/x86_64-linux-gnu/libnccl.so.2 \
        /usr/lib64/libnccl.so.2 /usr/local/cuda/lib64/libnccl.so.2 /usr/local/lib/libnccl.so.2 /opt/conda/lib/libnccl.so.2; do
        if [[ -e "$lib" ]]; then
            echo "$lib"
            return
        fi
    done
    ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF; exit}' || true
}

# Runs the test binary with the given arguments, echoes its output, and prints how many tests
# passed on the last line of stdout; fails if the binary failed.
run_tests() {
    local log status=0
    log=$(mktemp)
    "$BIN" "$@" --include-ignored --nocapture --test-threads=1 2>&1 | tee "$log" >&2 || status=$?
    grep -Eo 'test result: [a-zA-Z]+\. [0-9]+ passed' "$log" | tail -1 | grep -Eo '[0-9]+ passed' | grep -Eo '[0-9]+' ||
        echo 0
    rm -f "$log"
    return "$status"
}

run() {
    local exe
    for exe in "$BIN" "$COHORT"; do
        if [[ ! -x "$exe" ]]; then
            echo "$exe is missing: run '$0 build' first" >&2
            exit 1
        fi
    done
    if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L; then
        echo "no GPU here (nvidia-smi -L failed): the GPU tests were skipped, not passed" >&2
        exit 1
    fi

    local lib=${NCCL_LIB:-}
    [[ -n "$lib" ]] || lib=$(find_nccl)
    if [[ -n "$lib" ]]; then
        if [[ ! -e "$lib" ]]; then
            echo "NCCL_LIB=$lib does not exist" >&2
            exit 1
        fi
        NCCL_LINK_DIR=$(mktemp -d)
        trap 'rm -rf "$NCCL_LINK_DIR"' EXIT
        ln -s "$(readlink -f "$lib")" "$NCCL_LINK_DIR/libnccl.so"
        export LD_LIBRARY_PATH="$NCCL_LINK_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        echo "NCCL: $lib (linked as $NCCL_LINK_DIR/libnccl.so)"
    else
        echo "NCCL: no libnccl.so.2 found (set NCCL_LIB); relying on the loader's own search" >&2
    fi

    # The probe first: without CUDA, NCCL or a device every GPU test would fail the same way.
    local passed
    if ! passed=$(run_tests "$PROBE" --exact) || [[ "$passed" -ne 1 ]]; then
        echo "no usable GPU here (CUDA or NCCL could not be loaded, or no device: see above):" \
            "the GPU tests were skipped, not passed" >&2
        exit 1
    fi

    local expected
    expected=$("$BIN" "$FILTER" --list --ignored 2>/dev/null | grep -c ': test$' || true)
    if [[ "$expected" -lt 1 ]]; then
        echo "$BIN holds no ignored GPU test under $FILTER" >&2
        exit 1
    fi
    if ! passed=$(run_tests "$FILTER"); then
        echo "GPU tests FAILED" >&2
        exit 1
    fi
    if [[ "$passed" -lt "$expected" ]]; then
        echo "only $passed tests passed, $expected GPU tests exist: not all of them ran" >&2
        exit 1
    fi
    echo "GPU tests passed: $passed (of which $expected need the GPU)"

    echo "$COHORT ${BENCH[*]}"
    if ! "$COHORT" "${BENCH[@]}"; then
        echo "cohort bench --transport nccl FAILED (see above)" >&2
        exit 1
    fi
    echo "cohort bench --transport nccl passed"
}

case "${1:-all}" in
all)
    build
    run
    ;;
build) build ;;
run) run ;;
*)
    echo "usage: $0 [build|run]   (no argument: build, then run; see the comments at the top)" >&2
    exit 2
    ;;
esac
