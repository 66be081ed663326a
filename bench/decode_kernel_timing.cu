// The decoding kernel on its own, outside PyTorch: random bf16 inputs, the L2 flushed before every
// launch, CUDA events around the kernel and its combine, the cells interleaved within each
// repetition; prints the median time of each cell and a checksum of its output.
//
//   fox_decode_kernel_timing [--long] [--reps N]
//
// Built with the Catch2 tests (FOX_BUILD_TESTS=1, or FOX_BUILD_BENCH=1) into build/cmake. To
// compare a change of decode.cuh with the kept code, build both into two programs and run them
// alternately, one process each (the medians of one build agree within ~1% from run to run;
// equal checksums mean equal outputs). A changed copy of the header is compiled in place of the
// original with -DFOX_DECODE_HEADER='"path/to/copy.cuh"', e.g.
//
//   nvcc -std=c++20 -O3 --use_fast_math --expt-relaxed-constexpr -arch=sm_90a \
//     -Icsrc -Icsrc/ops/cuda -DFOX_DECODE_HEADER='"my_decode.cuh"' bench/decode_kernel_timing.cu
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#ifdef FOX_DECODE_HEADER
#include FOX_DECODE_HEADER
#else
#include "decode.cuh"
#endif
#include "kernel_timing.cuh"

namespace {

using fox::ForwardParams;
using fox::bench::check;
using fox::bench::hashed_unit;

__global__ void fill_values(__nv_bfloat16* x, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    x[i] = __float2bfloat16(2.f * hashed_unit(i, seed) - 1.f);
}

// log f in [-0.2, 0]: a slowly forgetting head, so every key contributes.
template <typename G>
__global__ void fill_gates(G* x, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    x[i] = static_cast<G>(-0.2f * hashed_unit(i, seed));
}

__global__ void checksum(const __nv_bfloat16* out, const float* lse, int n_out, int n_lse,
                         double* sums) {
  double a = 0, b = 0;
  for (int i = 0; i < n_out; ++i) a += fabs(static_cast<double>(__bfloat162float(out[i]))) * (1 + i % 7);
  for (int i = 0; i < n_lse; ++i) b += static_cast<double>(lse[i]) * (1 + i % 5);
  sums[0] = a;
  sums[1] = b;
}

// One decoding call: B sequences of Tk cached keys, one query token, (B, T, H, D) layouts, float16
// gates for GQA (as a static cache with gate_dtype=float16 holds them) and float32 for MHA, the
// cache cut into `splits` chunks (the op's planner picks these counts for these shapes).
struct Cell {
  int B, H, Hkv, D, Tk, splits;
  bool half_gates = false;
  ForwardParams p{};
  float* out_partial = nullptr;
  float* lse_partial = nullptr;
  float* gate_total = nullptr;
  std::vector<float> us;

  void allocate() {
    half_gates = H != Hkv;
    const size_t nq = size_t{1} * B * H * D, nkv = size_t{1} * B * Tk * Hkv * D;
    const size_t ng = size_t{1} * B * Tk * H;
    void *q, *k, *v, *out, *g, *lse;
    check(cudaMalloc(&q, nq * 2), "q");
    check(cudaMalloc(&k, nkv * 2), "k");
    check(cudaMalloc(&v, nkv * 2), "v");
    check(cudaMalloc(&out, nq * 2), "out");
    check(cudaMalloc(&g, ng * (half_gates ? 2 : 4)), "log f");
    check(cudaMalloc(&lse, size_t{1} * B * H * 4), "lse");
    check(cudaMalloc(&out_partial, size_t{1} * splits * H * B * D * 4), "partial out");
    check(cudaMalloc(&lse_partial, size_t{1} * splits * H * B * 4), "partial lse");
    check(cudaMalloc(&gate_total, size_t{1} * splits * B * H * 4), "gate totals");
    fill_values<<<1024, 256>>>(static_cast<__nv_bfloat16*>(q), nq, 1);
    fill_values<<<1024, 256>>>(static_cast<__nv_bfloat16*>(k), nkv, 2);
    fill_values<<<1024, 256>>>(static_cast<__nv_bfloat16*>(v), nkv, 3);
    if (half_gates)
      fill_gates<__half><<<1024, 256>>>(static_cast<__half*>(g), ng, 4);
    else
      fill_gates<float><<<1024, 256>>>(static_cast<float*>(g), ng, 4);
    check(cudaDeviceSynchronize(), "fill");
    p.q = q;
    p.k = k;
    p.v = v;
    p.log_fgate = g;
    p.out = out;
    p.lse = lse;
    p.q_batch_stride = p.o_batch_stride = int64_t{H} * D;
    p.q_row_stride = p.o_row_stride = int64_t{H} * D;
    p.q_head_stride = p.o_head_stride = D;
    p.k_batch_stride = p.v_batch_stride = int64_t{Tk} * Hkv * D;
    p.k_row_stride = p.v_row_stride = int64_t{Hkv} * D;
    p.k_head_stride = p.v_head_stride = D;
    p.g_batch_stride = int64_t{Tk} * H;
    p.g_row_stride = H;
    p.g_head_stride = 1;
    p.batch = B;
    p.seqlen_q = 1;
    p.seqlen_k = Tk;
    p.num_heads = H;
    p.num_kv_heads = Hkv;
    p.head_dim = D;
    p.scale = 1.0 / std::sqrt(static_cast<double>(D));
  }

  void launch() const {
    fox::cuda::DecodePlan plan;
    plan.num_splits = splits;
    if (D == 64)
      fox::cuda::run_decode_forward<__nv_bfloat16, 64>(p, half_gates, plan, out_partial, lse_partial,
                                                       gate_total, 0);
    else
      fox::cuda::run_decode_forward<__nv_bfloat16, 128>(p, half_gates, plan, out_partial,
                                                        lse_partial, gate_total, 0);
  }
};

}  // namespace

int main(int argc, char** argv) {
  bool long_cells = false;
  int reps = 40;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--long")) {
      long_cells = true;
    } else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: %s [--long] [--reps N]\n", argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "device");
  // The planner's chunk counts differ between an H100 (132 SMs, 80 GB) and an H200 for a few cells.
  const bool h200 = prop.totalGlobalMem > (100ull << 30);
  std::vector<Cell> cells;
  auto add = [&](int B, int H, int Hkv, int D, int Tk, int splits) {
    cells.push_back(Cell{B, H, Hkv, D, Tk, splits});
  };
  if (long_cells) {  // bandwidth-bound
    add(64, 32, 4, 64, 131072, 1);
    add(64, 32, 4, 64, 32768, 1);
    add(8, 32, 4, 64, 131072, 8);
    add(64, 32, 8, 64, 32768, 1);
    add(8, 16, 16, 128, 131072, 2);
  } else {  // short caches: latency-bound, split over many blocks
    for (int D : {64, 128}) add(1, 32, 8, D, 2048, 16);
    for (int D : {64, 128}) add(1, 32, 4, D, 2048, 16);
    for (int D : {64, 128}) add(8, 32, 8, D, 2048, h200 ? 4 : 3);
    for (int D : {64, 128}) add(8, 32, 4, D, 2048, h200 ? 8 : 6);
    add(64, 32, 8, 64, 2048, 1);
    add(64, 32, 4, 64, 2048, 1);
    add(64, 32, 4, 128, 2048, 1);
    add(1, 16, 16, 128, 2048, 16);
    add(1, 12, 12, 64, 2048, 16);
    add(8, 16, 16, 64, 2048, 1);
    add(1, 32, 8, 128, 8192, 16);
    add(8, 32, 4, 64, 8192, h200 ? 8 : 6);
    add(1, 32, 4, 64, 32768, 64);
    add(1, 32, 8, 64, 8192, 32);
  }
  for (Cell& c : cells) c.allocate();
  const size_t flush_bytes = size_t{256} << 20;  // more than any L2
  void* flush;
  check(cudaMalloc(&flush, flush_bytes), "flush buffer");
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  constexpr int kWarmup = 3;
  for (int rep = 0; rep < kWarmup + reps; ++rep) {
    for (Cell& c : cells) {
      check(cudaMemset(flush, rep & 0xff, flush_bytes), "flush");
      check(cudaEventRecord(start), "record");
      c.launch();
      check(cudaEventRecord(stop), "record");
      check(cudaEventSynchronize(stop), "launch");
      float ms = 0.f;
      check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
      if (rep >= kWarmup) c.us.push_back(1e3f * ms);
    }
  }
  double* sums;
  check(cudaMallocManaged(&sums, 2 * sizeof(double)), "sums");
  std::printf("%s, %d repetitions, median us\n", prop.name, reps);
  for (Cell& c : cells) {
    std::sort(c.us.begin(), c.us.end());
    checksum<<<1, 1>>>(static_cast<const __nv_bfloat16*>(c.p.out), static_cast<const float*>(c.p.lse),
                       c.B * c.H * c.D, c.B * c.H, sums);
    check(cudaDeviceSynchronize(), "checksum");
    std::printf("B=%d %d/%d D=%d Tk=%d chunks=%d: %.2f us  check %.9e %.9e\n", c.B, c.H, c.Hkv, c.D,
                c.Tk, c.splits, c.us[c.us.size() / 2], sums[0], sums[1]);
  }
  return 0;
}
