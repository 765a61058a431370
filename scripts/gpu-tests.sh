#!/usr/bin/env bash
# GPU tests of the NCCL backend (feature `nccl`) in two halves.
#
# Here (no GPU needed):      scripts/gpu-tests.sh build
#   builds the cohort-transports test binary with --features nccl and copies it to gpu-bin/.
# On the GPU machine:         scripts/gpu-tests.sh run
#   needs libcuda.so (the driver) and NCCL. cudarc dlopens `libnccl.so`, not `libnccl.so.2`:
#   with NCCL from the nvidia-nccl-cu12/cu13 wheel, point NCCL_LIB at the wheel's libnccl.so.2
#   and this script makes a folder with a `libnccl.so` link and puts it on LD_LIBRARY_PATH.
# Without a GPU the tests print "skipped: <reason>" and pass.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
build)
    bin=$(cargo test -p cohort-transports --features nccl --lib --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cohort_transports":
        print(m["executable"])' | tail -1)
    mkdir -p gpu-bin
    cp "$bin" gpu-bin/cohort_transports-tests
    echo "built gpu-bin/cohort_transports-tests"
    ;;
run)
    if [[ -n "${NCCL_LIB:-}" ]]; then
        dir=$(mktemp -d)
        ln -s "$NCCL_LIB" "$dir/libnccl.so"
        export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
    nvidia-smi -L || true
    ./gpu-bin/cohort_transports-tests nccl --nocapture --test-threads=1
    ;;
*)
    echo "usage: $0 build|run   (see the comments at the top)" >&2
    exit 2
    ;;
esac
