#!/usr/bin/env bash
# The tests, as the README gives them and CI runs them: the Python package's tests (cohort as a
# torch.distributed backend; see scripts/python-tests.sh), then every Rust test in the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
# The Python tests first: they make the venv with torch that the Rust tests of the interop with
# PyTorch (its TCPStore client and server, torch ranks under `cohort launch`) then run against.
bash scripts/python-tests.sh
# With cohort-transports' `nccl` feature: its CUDA device compiles (cudarc loads the libraries at
# run time, so no CUDA is needed to build) and its tests that need no GPU run; the GPU ones are
# ignored here (scripts/gpu-tests.sh). One build for everything, so CI compiles the crates once.
COHORT_TORCH_PYTHON="${COHORT_VENV:-$PWD/target/python-venv}/bin/python" \
    cargo test --workspace --features cohort-transports/nccl
