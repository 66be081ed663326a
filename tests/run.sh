#!/usr/bin/env bash
# Run every test: pytest (Python API, reference grid, CMake consumer) and the Catch2 suites.
# GPU tests skip where there is no GPU. Expects the build of .ci/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/env.sh
python3 -m pytest tests/python -q "$@"
ctest --test-dir build/cmake --output-on-failure
