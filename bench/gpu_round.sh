#!/usr/bin/env bash
# One round on a GPU machine: build for sm_90a, run the CUDA tests, then the benchmarks, writing
# logs and JSON under $OUT (default runs/gpu_round). Stages are chosen by name:
#
#   bash bench/gpu_round.sh build tests decode generate
#
# build      pip install -e . (TORCH_CUDA_ARCH_LIST=9.0a unless set)
# tests      pytest -m cuda (bad-argument cases deselected: see NOTES, "Hygiene run")
# cuda_table bench_cuda.py --no-flex: the prefill table against SDPA (calls back to back, the two
#            alternating), decoding and peak memory
# decode     bench_decode.py, the full grid (Tq = 1; float32 and float16 gates) and Tq 4/16 on
#            the quick grid
# decode_kernel  the decoding kernel on its own (fox_decode_kernel_timing: built by `build` here)
# attention_kernel  the prefill kernels on their own, forward and backward, D=64/128, N=2k-16k
#            (fox_attention_kernel_timing: built by `build` here)
# generate   bench_generate.py: 125M at B 1/16/64 after a 2k prompt, then 760M at 32k and 128k
# model      bench_model.py (training step), for the cost of the wrapper layers
# context_parallel  (2 GPUs) bench_context_parallel.py: the model on 1 GPU at 32k-128k and on 2 at
#            64k-256k (the same lengths and the same tokens per GPU), the overlap against
#            FOX_CP_OVERLAP=0 side by side, then 2 and 4 head groups against 1
# context_parallel_longest  (2 GPUs) the longest sequence that fits on 1 and on 2
# context_parallel_table  (2 GPUs) the scaling table in one pass: 1 GPU at 32k-512k and 2 at
#            64k-1M (the same tokens per GPU, and the longest that fits on each), 2 timed steps
# context_parallel_prune  (2 GPUs) pruning across ranks: every head forgetting fast (log f =
#            -0.05): one GPU at the same tokens per GPU, the pruned exchange against the
#            all-gather (FOX_CP_PRUNE=0) and against itself without the prefetch (FOX_CP_OVERLAP=0)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_round}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0
for stage in "$@"; do
  echo "=== $stage ($(date +%T))"
  case $stage in
    build)
      TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=$(nproc) FOX_BUILD_BENCH=1 \
        python3 -m pip install -q --no-build-isolation --no-deps -e . > /tmp/fox_build.log 2>&1 \
        || { tail -40 /tmp/fox_build.log; exit 1; } ;;
    tests)
      python3 -m pytest tests/python -m cuda -k "not bad" -q -p no:cacheprovider \
        > "$OUT/tests.log" 2>&1 || status=1
      tail -15 "$OUT/tests.log" ;;
    cuda_table)
      python3 bench/bench_cuda.py --no-flex 2>&1 | tee "$OUT/cuda_table.log" | grep "^| [0-9]\|^decode\|^peak" \
        || status=1 ;;
    decode)
      python3 bench/bench_decode.py --f16-gates --out "$OUT" 2>&1 | tee "$OUT/decode.log" | tail -3
      python3 bench/bench_decode.py --quick --tq 4 16 2>&1 | tee "$OUT/decode_tq.log" | tail -2 ;;
    decode_kernel)
      timing=${FOX_BUILD_DIR:-build/cmake}/fox_decode_kernel_timing
      { "$timing" && "$timing" --long; } 2>&1 | tee "$OUT/decode_kernel.log" || status=1 ;;
    attention_kernel)
      "${FOX_BUILD_DIR:-build/cmake}/fox_attention_kernel_timing" 2>&1 | tee "$OUT/attention_kernel.log" \
        || status=1 ;;
    generate)
      python3 bench/bench_generate.py --out "$OUT" 2>&1 | tee "$OUT/generate.log"
      python3 bench/bench_generate.py --model 760m --batch 1 --prompt 32768 131072 --new 64 \
        --no-compile 2>&1 | tee "$OUT/generate_760m.log" ;;
    model)
      python3 bench/bench_model.py 2>&1 | tee "$OUT/model.log" | tail -20 ;;
    context_parallel)
      python3 -m torch.distributed.run --nproc_per_node 1 bench/bench_context_parallel.py \
        --seqlen 32768 65536 131072 2>&1 | tee -a "$OUT/context_parallel.log"
      python3 -m torch.distributed.run --nproc_per_node 2 bench/bench_context_parallel.py \
        --seqlen 65536 131072 262144 --ab FOX_CP_OVERLAP=0 2>&1 | tee -a "$OUT/context_parallel.log"
      python3 -m torch.distributed.run --nproc_per_node 2 bench/bench_context_parallel.py \
        --seqlen 65536 131072 --ab FOX_CP_HEAD_GROUPS=2 2>&1 | tee -a "$OUT/context_parallel.log"
      python3 -m torch.distributed.run --nproc_per_node 2 bench/bench_context_parallel.py \
        --seqlen 65536 131072 --ab FOX_CP_HEAD_GROUPS=4 2>&1 | tee -a "$OUT/context_parallel.log" ;;
    context_parallel_prune)
      python3 -m torch.distributed.run --nproc_per_node 1 bench/bench_context_parallel.py \
        --forget -0.05 --seqlen 32768 65536 131072 2>&1 | tee -a "$OUT/context_parallel_prune.log"
      python3 -m torch.distributed.run --nproc_per_node 2 bench/bench_context_parallel.py \
        --forget -0.05 --seqlen 65536 131072 262144 --ab FOX_CP_PRUNE=0 2>&1 \
        | tee -a "$OUT/context_parallel_prune.log"
      python3 -m torch.distributed.run --nproc_per_node 2 bench/bench_context_parallel.py \
        --forget -0.05 --seqlen 131072 262144 --ab FOX_CP_OVERLAP=0 2>&1 \
        | tee -a "$OUT/context_parallel_prune.log" ;;
    context_parallel_table)
      python3 -m torch.distributed.run --nproc_per_node 1 bench/bench_context_parallel.py \
        --seqlen 32768 65536 131072 262144 524288 --reps 2 2>&1 | tee -a "$OUT/context_parallel_table.log"
      python3 -m torch.distributed.run --nproc_per_node 2 bench/bench_context_parallel.py \
        --seqlen 65536 131072 262144 524288 1048576 --reps 2 2>&1 \
        | tee -a "$OUT/context_parallel_table.log" ;;
    context_parallel_longest)
      for n in 1 2; do
        python3 -m torch.distributed.run --nproc_per_node $n bench/bench_context_parallel.py \
          --longest --reps 1 2>&1 | tee -a "$OUT/context_parallel_longest.log"
      done ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
exit $status
