# Sourced by .ci/setup.sh and tests/run.sh: where the CUDA toolkit is.
# A CUDA-enabled torch needs a full toolkit at CMake configure time. Where the machine's toolkit is
# compiler-only (nvcc + cudart, as on CI), build/cuda-toolkit is assembled from nvcc and the CUDA
# library wheels that torch installs (.ci/cuda_toolkit_root.sh).
fox_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -z "${CUDA_HOME:-}" ] && python3 -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
  nvcc_bin=$(command -v nvcc || true)
  [ -z "$nvcc_bin" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc_bin=/usr/local/cuda/bin/nvcc
  if [ -n "$nvcc_bin" ]; then
    nvcc_root=$(dirname "$(dirname "$(readlink -f "$nvcc_bin")")")
    if ls "$nvcc_root"/lib*/libcublas.so >/dev/null 2>&1; then
      export CUDA_HOME=$nvcc_root
    else
      [ -d "$fox_root/build/cuda-toolkit" ] || PATH="$(dirname "$nvcc_bin"):$PATH" \
        bash "$fox_root/.ci/cuda_toolkit_root.sh" "$fox_root/build/cuda-toolkit" >/dev/null
      export CUDA_HOME=$fox_root/build/cuda-toolkit
    fi
  fi
fi
