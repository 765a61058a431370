#!/usr/bin/env bash
# The Python package's tests (python/tests): cohort as a torch.distributed backend.
#
# From a clean clone: makes a venv under target/ (reused when present), installs CPU-capable
# torch 2.15 from PyPI, maturin and pytest into it, builds and installs ./python, and runs
# pytest. Exits non-zero on any failure. The first run downloads torch (a few GB); later runs
# rebuild only what changed.
#
# The extension is built in cargo's dev profile, not the release one `pip install ./python` uses:
# the dev profile's dependencies (optimised, `profile.dev.package."*"`) are the ones the Rust
# test build (`cargo test`, same target/debug) compiles, so the two builds share most of them
# (not tokio, serde and the few others the workspace turns more features on for) instead of
# compiling all of them again with fat LTO; and the tests run with debug assertions on.
# Benchmarks (`python/bench/`) want the release build: run
# `pip install --no-build-isolation ./python` in the venv first.
#
# `--venv-only`: make the venv and install into it, then stop (CI does this in the background
# while it lints).
#
# Environment: PYTHON (the interpreter to make the venv with, default python3), COHORT_VENV
# (default target/python-venv), PYTEST_ARGS (extra pytest arguments).
set -euo pipefail

venv_only=0
case "${1:-}" in
    "") ;;
    --venv-only) venv_only=1 ;;
    *) echo "python-tests: unknown argument '$1' (the only one is --venv-only)" >&2; exit 2 ;;
esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${COHORT_VENV:-$root/target/python-venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "python-tests: creating $venv"
    "$python" -m venv "$venv"
fi
export PATH="$venv/bin:$PATH"
export VIRTUAL_ENV="$venv"

if ! python -c 'import torch, maturin, pytest' 2>/dev/null; then
    echo "python-tests: installing torch 2.15, maturin, pytest (the first time takes a few minutes)"
    python -m pip install --quiet --upgrade pip
    python -m pip install --quiet "torch>=2.15,<2.16" "maturin>=1.16,<1.17" "pytest>=8" numpy
fi
if [ "$venv_only" = 1 ]; then
    echo "python-tests: $venv is ready"
    exit 0
fi

echo "python-tests: building and installing ./python"
MATURIN_PEP517_ARGS="${MATURIN_PEP517_ARGS:---profile dev}" python -m pip install --quiet --no-build-isolation --force-reinstall --no-deps ./python

# Run from python/tests so that `import cohort_torch` finds the installed package, not the
# source folder (which has no compiled extension).
cd "$root/python/tests"
# shellcheck disable=SC2086
python -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} .
