#!/usr/bin/env bash
# The tests, as the README gives them and CI runs them: every Rust test in the workspace, then
# the Python package's tests (cohort as a torch.distributed backend; see scripts/python-tests.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace
bash scripts/python-tests.sh
