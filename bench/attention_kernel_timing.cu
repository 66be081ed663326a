// The Hopper prefill kernels on their own, outside PyTorch: forward (gate-suffix pre-pass and
// forward kernel) and backward (delta, gate-suffix, dK/dV, dQ and gate-gradient kernels), bf16,
// causal, B = 16384 / N sequences, H = 32 heads of 64 or 16 of 128, half the heads global (log f
// in [-1e-3, 0]) and half local (log f ~ -1), the inputs a hash of their index. CUDA events around
// each pass, median of the repetitions; prints checksums of out, dq, dk and dv per cell.
//
//   fox_attention_kernel_timing [--reps N] [--d 64|128] [--heads H] [--fused | --nondeterministic] [N ...]
//
// (default: both head dims, 2k-16k, the two-kernel backward; --fused: the five-product backward
// with dQ added in turns; --nondeterministic: in any order; --heads: H heads instead of 32 / 16.)
//
// Built with the Catch2 tests (FOX_BUILD_TESTS=1, or FOX_BUILD_BENCH=1) into build/cmake; needs an
// sm_90 GPU. To compare a change of the kernels with the kept code, link both builds into
// attention_kernel_ab.cu's program, which alternates them call by call (its header has the
// commands): separate processes of one build move by several percent between runs (bench/NOTES.md,
// versions 90-91). Equal checksums mean equal results. This file also serves that program: with
// FOX_TIMING_NO_MAIN it leaves out main() and exports the cells (fox::bench::attention_cell_*).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "hopper_backward.cuh"
#include "kernel_timing.cuh"

namespace {

using fox::BackwardParams;
using fox::cuda::BackwardWorkspace;
using fox::bench::check;
using fox::bench::hashed_unit;

// Roughly unit variance: the sum of 4 uniforms, centred and scaled.
__global__ void fill_values(__nv_bfloat16* x, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    float s = 0.f;
    for (unsigned k = 0; k < 4; ++k) s += hashed_unit(4 * i + k, seed);
    x[i] = __float2bfloat16((s - 2.f) * 1.732f);
  }
}

// (B, N, H) gates: heads below H / 2 global, the others local.
__global__ void fill_gates(float* g, size_t n, int H, unsigned seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const float u = hashed_unit(i, seed);
    g[i] = static_cast<int>(i % H) < H / 2 ? -1e-3f * u : -0.5f - u;
  }
}

// Partial sums of a weighted checksum, one per thread (added up in order on the host: the same
// bits for the same tensor).
constexpr int kSumBlocks = 256, kSumThreads = 256;
__global__ void checksum(const __nv_bfloat16* x, size_t n, double* partial) {
  const size_t t = size_t{blockIdx.x} * blockDim.x + threadIdx.x;
  double a = 0;
  for (size_t i = t; i < n; i += size_t{kSumBlocks} * kSumThreads)
    a += static_cast<double>(__bfloat162float(x[i])) * (1 + i % 7);
  partial[t] = a;
}

// One cell (head dim D, N, H heads, the backward's form): its tensors, filled once, and one timed
// forward + backward at a time.
struct Cell {
  int D = 0, N = 0, B = 0, H = 0;
  bool fused = false;
  size_t n = 0, ns = 0;
  __nv_bfloat16* t[8] = {};  // q, k, v, out, dout, dq, dk, dv
  float *g = nullptr, *lse = nullptr, *suffix = nullptr, *delta = nullptr, *dc = nullptr, *rowsum = nullptr,
        *query_bias = nullptr, *dg = nullptr;
  BackwardParams p;
  BackwardWorkspace ws;
  size_t acc_bytes = 0;
  int64_t zeroed = 0;
  cudaEvent_t e[3];

  Cell(int d, int length, int heads, bool fused_, bool in_turns) : D(d), N(length), fused(fused_) {
    B = 16384 / N;
    H = heads > 0 ? heads : D == 64 ? 32 : 16;
    n = size_t{1} * B * N * H * D;
    ns = size_t{1} * B * H * N;
    for (int i = 0; i < 8; ++i) {
      check(cudaMalloc(&t[i], n * 2), "tensor");
      fill_values<<<1024, 256>>>(t[i], n, 11 + i);
    }
    check(cudaMalloc(&g, ns * 4), "log f");
    fill_gates<<<1024, 256>>>(g, ns, H, 7);
    for (float** x : {&lse, &suffix, &delta, &dc, &rowsum, &query_bias, &dg}) check(cudaMalloc(x, (ns + 1) * 4), "workspace");
    p.q = t[0];
    p.k = t[1];
    p.v = t[2];
    p.out = t[3];
    p.dout = t[4];
    p.dq = t[5];
    p.dk = t[6];
    p.dv = t[7];
    p.log_fgate = g;
    p.dlog_fgate = dg;
    p.lse = lse;
    const int64_t batch = int64_t{N} * H * D, row = int64_t{H} * D;
    p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = p.do_batch_stride = batch;
    p.dq_batch_stride = p.dk_batch_stride = p.dv_batch_stride = batch;
    p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = p.do_row_stride = row;
    p.dq_row_stride = p.dk_row_stride = p.dv_row_stride = row;
    p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = p.do_head_stride = D;
    p.dq_head_stride = p.dk_head_stride = p.dv_head_stride = D;
    p.g_batch_stride = p.dg_batch_stride = int64_t{N} * H;
    p.g_row_stride = p.dg_row_stride = H;
    p.g_head_stride = p.dg_head_stride = 1;
    p.batch = B;
    p.seqlen_q = p.seqlen_k = N;
    p.num_heads = p.num_kv_heads = H;
    p.head_dim = D;
    p.scale = 1.0 / std::sqrt(static_cast<double>(D));
    ws.delta = delta;
    ws.dc = dc;
    ws.dq_rowsum = rowsum;
    ws.query_bias = query_bias;
    // The fused backward: its float32 dQ accumulator and turn counters, the part that needs zeros
    // zeroed in the timed part
    acc_bytes = fox::cuda::fused_dq_workspace_words(ns, D) * sizeof(float);
    zeroed = fox::cuda::fused_dq_zeroed_from(ns, D, in_turns);
    if (fused) check(cudaMalloc(&ws.dq_accum, acc_bytes), "dQ accumulator");
    if (fused && in_turns)
      ws.dq_turns = reinterpret_cast<int*>(ws.dq_accum + fox::cuda::fused_dq_accumulator_floats(ns, D));
    for (auto& x : e) check(cudaEventCreate(&x), "event");
  }
  ~Cell() {
    for (auto x : t) check(cudaFree(x), "free");
    for (float* x : {g, lse, suffix, delta, dc, rowsum, query_bias, dg}) check(cudaFree(x), "free");
    if (fused) check(cudaFree(ws.dq_accum), "free");
    for (auto x : e) check(cudaEventDestroy(x), "event");
  }

  template <int kD>
  void launch() {
    fox::cuda::run_hopper_forward<__nv_bfloat16, kD>(p, suffix, N, N, 0);
    check(cudaEventRecord(e[1]), "record");
    if (fused) check(cudaMemsetAsync(ws.dq_accum + zeroed, 0, acc_bytes - zeroed * sizeof(float), 0), "zero");
    fox::cuda::run_hopper_backward<__nv_bfloat16, kD>(p, ws, suffix, N, N, 0);
  }
  // One forward and one backward, each timed (us).
  void step(float* fwd_us, float* bwd_us) {
    check(cudaEventRecord(e[0]), "record");
    if (D == 64)
      launch<64>();
    else
      launch<128>();
    check(cudaEventRecord(e[2]), "record");
    check(cudaEventSynchronize(e[2]), "run");
    float a, b;
    check(cudaEventElapsedTime(&a, e[0], e[1]), "time");
    check(cudaEventElapsedTime(&b, e[1], e[2]), "time");
    *fwd_us = a * 1e3f;
    *bwd_us = b * 1e3f;
  }
  // Weighted sums of out, dq, dk and dv (the same bits for the same tensors).
  void checksums(double sums[4]) const {
    double* partial;
    std::vector<double> host(kSumBlocks * kSumThreads);
    check(cudaMalloc(&partial, host.size() * sizeof(double)), "partial sums");
    for (int i = 0; i < 4; ++i) {
      checksum<<<kSumBlocks, kSumThreads>>>(t[i == 0 ? 3 : 4 + i], n, partial);
      check(cudaMemcpy(host.data(), partial, host.size() * sizeof(double), cudaMemcpyDeviceToHost), "sums");
      sums[i] = 0;
      for (double x : host) sums[i] += x;
    }
    check(cudaFree(partial), "free");
  }
  double forward_flops() const { return 2.0 * B * H * static_cast<double>(N) * N * D; }  // causal; backward 2.5x
};

#ifndef FOX_TIMING_NO_MAIN
void run(int D, int N, int reps, bool fused, bool in_turns, int heads) {
  Cell cell(D, N, heads, fused, in_turns);
  std::vector<float> fwd, bwd;
  for (int r = 0; r < reps + 3; ++r) {
    float a, b;
    cell.step(&a, &b);
    if (r >= 3) {  // (warm-up)
      fwd.push_back(a);
      bwd.push_back(b);
    }
  }
  std::sort(fwd.begin(), fwd.end());
  std::sort(bwd.begin(), bwd.end());
  double sums[4];
  cell.checksums(sums);
  const double flops = cell.forward_flops();
  const float f = fwd[fwd.size() / 2], b = bwd[bwd.size() / 2];
  std::printf("D=%d H=%d N=%d B=%d: fwd %.1f us (%.0f TFLOP/s)  bwd %.1f us (%.0f)  f+b %.1f us (%.0f)  "
              "checksums out %.9e dq %.9e dk %.9e dv %.9e\n",
              D, cell.H, N, cell.B, f, flops / f * 1e-6, b, 2.5 * flops / b * 1e-6, f + b, 3.5 * flops / (f + b) * 1e-6,
              sums[0], sums[1], sums[2], sums[3]);
}
#endif  // FOX_TIMING_NO_MAIN

}  // namespace

// The cells for a program that links two builds of the kernels and alternates them call by call
// (attention_kernel_ab.cu; the second build compiled with -Dfox=fox_b, so that its symbols differ).
namespace fox::bench {
void* attention_cell_create(int d, int n, int heads, bool fused, bool in_turns) {
  return new Cell(d, n, heads, fused, in_turns);
}
void attention_cell_step(void* cell, float* fwd_us, float* bwd_us) { static_cast<Cell*>(cell)->step(fwd_us, bwd_us); }
void attention_cell_checksums(void* cell, double sums[4]) { static_cast<Cell*>(cell)->checksums(sums); }
double attention_cell_flops(void* cell) { return static_cast<Cell*>(cell)->forward_flops(); }
void attention_cell_shape(void* cell, int* heads, int* batch) {
  *heads = static_cast<Cell*>(cell)->H;
  *batch = static_cast<Cell*>(cell)->B;
}
void attention_cell_destroy(void* cell) { delete static_cast<Cell*>(cell); }
}  // namespace fox::bench

#ifndef FOX_TIMING_NO_MAIN
int main(int argc, char** argv) {
  fox::bench::AttentionTimingOptions o;
  if (!fox::bench::parse_attention_timing_options(argc, argv, o)) return 2;
  if (o.lengths.empty()) o.lengths = {2048, 4096, 8192, 16384};
  if (!fox::bench::hopper_device()) return 1;
  for (int d : {128, 64}) {
    if (o.only_d != 0 && d != o.only_d) continue;
    for (int n : o.lengths) run(d, n, o.reps, o.fused, o.in_turns, o.heads);
  }
  return 0;
}
#endif  // FOX_TIMING_NO_MAIN
