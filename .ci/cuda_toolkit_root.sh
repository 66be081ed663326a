#!/usr/bin/env bash
# Assemble a CUDA toolkit root that CMake's FindCUDA/FindCUDAToolkit accept, from the machine's
# nvcc and the CUDA libraries that the torch wheel pulls in (nvidia-* wheels). Needed only where the
# system toolkit is compiler-only (no cuBLAS, cuSPARSE, ... development files), as on CI machines.
# Usage: cuda_toolkit_root.sh OUT_DIR   (prints OUT_DIR; set CUDA_HOME / CUDAToolkit_ROOT to it)
set -euo pipefail
out=${1:?usage: cuda_toolkit_root.sh OUT_DIR}
nvcc_bin=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
# nvcc may be a wrapper script: ask it where its toolkit is
nvcc_root=$(readlink -f "$("$nvcc_bin" -x cu --dryrun -c /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)")
wheel_root=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
rm -rf "$out"; mkdir -p "$out/bin" "$out/include" "$out/lib64" "$out/targets/x86_64-linux"
ln -s "$nvcc_root/nvvm" "$out/nvvm"
# nvcc finds its headers relative to its own (resolved) location, so nvcc and its profile are
# copied, not linked; the other tools are linked.
for f in "$nvcc_root"/bin/*; do
  case "$(basename "$f")" in
    nvcc | nvcc.profile) cp "$f" "$out/bin/" ;;
    *) ln -s "$f" "$out/bin/" ;;
  esac
done
ln -s ../../include "$out/targets/x86_64-linux/include"
ln -s ../../lib64 "$out/targets/x86_64-linux/lib"
ln -s lib64 "$out/lib"
# headers: the compiler's own first, then the libraries' headers it lacks
for src in "$nvcc_root/include" "$wheel_root/include"; do
  for f in "$src"/*; do [ -e "$out/include/$(basename "$f")" ] || ln -s "$f" "$out/include/"; done
done
# libraries: every shared object gets its unversioned name too (what find_library looks for)
for src in "$nvcc_root/lib64" "$nvcc_root/lib" "$wheel_root/lib"; do
  [ -d "$src" ] || continue
  for f in "$src"/*; do
    base=$(basename "$f")
    [ -e "$out/lib64/$base" ] || ln -s "$f" "$out/lib64/$base"
    plain=$(echo "$base" | sed -E 's/(\.so)(\.[0-9]+)+$/\1/')
    [ -e "$out/lib64/$plain" ] || ln -s "$f" "$out/lib64/$plain"
  done
done
echo "$out"
