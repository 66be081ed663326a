#!/usr/bin/env bash
# Set up a fresh machine and build everything: system packages, pinned Python packages, then one
# CMake build (libfox_torch, _C, the Catch2 tests in build/cmake; the CUDA kernels when torch has
# CUDA) packed into a wheel (dist/), which is installed into the virtual environment .venv (it sees
# the pinned packages of this Python; the package itself comes only from the wheel). The tests and
# the main job run with .venv's Python. Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  if ! dpkg -s catch2 ccache nlohmann-json3-dev >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq catch2 ccache nlohmann-json3-dev >/dev/null
  fi
fi

# torch 2.14.1 is the CUDA 13.0 build: CI compiles and links the CUDA kernels against it. The last
# line is the hf extra (pyproject.toml): forgetting_transformer.model and its tests, lm-eval. One
# pip call: each one costs seconds even when everything is installed.
python3 -m pip install -q --disable-pip-version-check \
  torch==2.14.1 numpy==2.4.1 ninja==1.13.2 cmake==4.4.4 nvidia-cutlass==4.2.0.0 \
  nlohmann-json==3.12.0 pytest==9.0.3 expecttest==0.3.0 setuptools==84.2.1 matplotlib==3.11.2 \
  pyyaml==6.0.3 \
  transformers==5.17.0 safetensors==0.8.0 tokenizers==0.23.3 accelerate==1.15.0 lm-eval==0.4.13

source .ci/env.sh
echo "CUDA toolkit: ${CUDA_HOME:-none (CPU-only build)}"
# The README's commands run the tests after this: build the Catch2 tests too (in build/cmake, the
# wheel's own build directory: no second compile).
rm -f dist/forgetting_transformer-*.whl
FOX_BUILD_TESTS=${FOX_BUILD_TESTS:-1} MAX_JOBS=${MAX_JOBS:-$(nproc)} \
  python3 -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps -w dist .

# No pip of its own: `.venv/bin/python -m pip` is this Python's (with the pinned setuptools).
[ -x .venv/bin/python ] || python3 -m venv --system-site-packages --without-pip .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --force-reinstall \
  dist/forgetting_transformer-*.whl
echo "Installed $(ls dist/forgetting_transformer-*.whl) into .venv (.venv/bin/fox, .venv/bin/python)"
