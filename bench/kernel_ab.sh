#!/usr/bin/env bash
# Builds fox_attention_kernel_ab (bench/attention_kernel_ab.cu) for one comparison: build A from the
# prefill kernels of a git revision, build B from this working tree (optionally with a patch applied
# and extra -D switches), both linked into one program that times them call by call.
#
#   bash bench/kernel_ab.sh [--base REV] [--patch FILE] [--out PATH] [-- NVCC_FLAGS_FOR_B...]
#
#   --base REV    build A's revision (default HEAD: the working tree's changes against it)
#   --patch FILE  a patch (git diff) applied to B's copy of the working tree
#   --out PATH    the program (default build/kernel_ab/fox_attention_kernel_ab)
#   after --       switches for B only, e.g. -DFOX_SECTION_MIB_QUERY_BLOCKS=24
#
# Then, on a GPU machine: PATH --reps 150 2048 16384; PATH --fused --d 64 --heads 12 2048 16384.
# Needs nvcc (CUDA 12.4+) and CUTLASS's headers (the nvidia-cutlass wheel, or FOX_CUTLASS_INCLUDE_DIR).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
base=HEAD patch="" out="$root/build/kernel_ab/fox_attention_kernel_ab" b_flags=()
while [ $# -gt 0 ]; do
  case $1 in
    --base) base=$2; shift 2 ;;
    --patch) patch=$(realpath "$2"); shift 2 ;;
    --out) out=$(realpath -m "$2"); shift 2 ;;
    --) shift; b_flags=("$@"); break ;;
    *) sed -n '2,14p' "$0" >&2; exit 2 ;;
  esac
done
cutlass=${FOX_CUTLASS_INCLUDE_DIR:-$(python3 -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))" 2>/dev/null || true)}
if [ ! -f "$cutlass/cute/arch/mma_sm90_gmma.hpp" ]; then
  echo "CUTLASS headers not found: pip install nvidia-cutlass==4.2.0.0, or set FOX_CUTLASS_INCLUDE_DIR" >&2
  exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/a" "$work/b" "$(dirname "$out")"
git -C "$root" archive "$base" csrc bench | tar -x -C "$work/a"
# B: the working tree's sources as they are (tracked and untracked files alike)
cp -r "$root/csrc" "$root/bench" "$work/b/"
if [ -n "$patch" ]; then (cd "$work/b" && patch -p1 -s < "$patch"); fi

flags=(-std=c++20 -O3 --use_fast_math --expt-relaxed-constexpr -arch=sm_90a -isystem "$cutlass"
       -DFOX_TIMING_NO_MAIN)
compile() {  # tree, object prefix, extra flags...
  local tree=$1 name=$2
  shift 2
  nvcc "${flags[@]}" "$@" -I"$tree/csrc" -I"$tree/csrc/ops/cuda" -c "$tree/bench/attention_kernel_timing.cu" \
    -o "$work/$name.o" &
  nvcc "${flags[@]}" "$@" -I"$tree/csrc" -I"$tree/csrc/ops/cuda" -c "$tree/csrc/ops/cuda/tma.cu" \
    -o "$work/${name}_tma.o" &
}
compile "$work/a" a
compile "$work/b" b -Dfox=fox_b "${b_flags[@]}"
for job in $(jobs -p); do wait "$job"; done
nvcc -std=c++20 -O3 -arch=sm_90a -I"$work/b/bench" "$work/b/bench/attention_kernel_ab.cu" \
  "$work/a.o" "$work/a_tma.o" "$work/b.o" "$work/b_tma.o" -o "$out"
echo "$out: A = $(git -C "$root" rev-parse --short "$base"), B = the working tree${patch:+ + $(basename "$patch")}${b_flags[*]:+ (${b_flags[*]})}"
