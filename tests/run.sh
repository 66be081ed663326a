#!/usr/bin/env bash
# Run every test: pytest (Python API, reference grid, CMake consumer, the wheel in a fresh virtual
# environment) and the Catch2 suites. GPU tests skip where there is no GPU. Expects what
# .ci/setup.sh leaves: the package installed from the wheel into .venv, the Catch2 tests in
# build/cmake. FOX_PYTHON=python3 tests an editable install instead. Arguments go to pytest
# (test paths relative to tests/python).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
source .ci/env.sh
if [ -n "${FOX_PYTHON:-}" ]; then
  python=$FOX_PYTHON
else
  python=$root/.venv/bin/python
  export FOX_TEST_INSTALLED=1   # conftest.py: fail unless the package is the installed one
fi
# From tests/python, not the repository root: neither pytest nor the tests' `python -m ...`
# subprocesses may import the source tree's forgetting_transformer/ (it has no built libraries).
(cd tests/python && "$python" -m pytest -q --rootdir "$root" -c "$root/pyproject.toml" . "$@")
ctest --test-dir build/cmake --output-on-failure -j "$(nproc)"
