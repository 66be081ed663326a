// Fused elementwise kernels of the model (see fused_kernels.h). All are memory-bound: each reads
// its inputs once (twice for the row reductions, the second time from L1/L2), computes in float32
// and writes its outputs once, instead of the 5-15 ATen kernels (and float32 round trips) each
// replaces. Reductions are in a fixed order: the results are bitwise reproducible.
#include "fused_kernels.h"

#include <map>
#include <mutex>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <utility>

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mv.h>
#include <ATen/ops/ones.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "../../ops/cuda/dependent_launch.cuh"

namespace fox::nn::cuda {
namespace {

using fox::cuda::allow_next_kernel;
using fox::cuda::launch_dependent;
using fox::cuda::wait_for_previous_kernel;

constexpr int kWarp = 32;
constexpr int kMaxRowThreads = 1024;  // a row kernel's block: one row's channels at most

__device__ __forceinline__ float sigmoidf(float x) { return 1.f / (1.f + __expf(-x)); }

int64_t blocks_for(int64_t n, int threads) { return (n + threads - 1) / threads; }


// ---- row kernels ----------------------------------------------------------------------------------
// A block holds `rows_per_block` rows of C channels, each thread VEC consecutive channels of one row
// (one 16-byte load where alignment allows), so every input is read from memory once. Sums over a
// group of channels (an RMSNorm group, a KV-shift head) go through shared memory in a fixed order.

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <int N, typename T>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}

template <int N, typename T>
__device__ __forceinline__ void unpack(const Pack<T, N>& pk, float (&out)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = static_cast<float>(pk.v[i]);
}

template <int N, typename T>
__device__ __forceinline__ void load(const T* p, float (&out)[N]) {
  unpack(load_pack<N>(p), out);
}

template <int N, typename T>
__device__ __forceinline__ void store(T* p, const float (&in)[N]) {
  Pack<T, N> pk;
#pragma unroll
  for (int i = 0; i < N; ++i) pk.v[i] = static_cast<T>(in[i]);
  *reinterpret_cast<Pack<T, N>*>(p) = pk;
}

// Whether group_sums over runs of `per_group` threads takes shuffles alone: then it uses no shared
// memory and no barrier, and a kernel that walks block rows needs no barrier between them (its
// warps walk on without waiting for each other: H200, the per-head norms' backward 30 -> 28 us
// a call, the k part's shift+norm backward 57 -> 54).
__device__ __forceinline__ bool group_sums_by_shuffles(int per_group) {
  return per_group % kWarp != 0 && kWarp % per_group == 0 && (blockDim.x * blockDim.y) % kWarp == 0;
}

// The sums of each value[n] over each run of `per_group` consecutive threads of this block row, in
// a fixed order (N values a thread: N rows of a row kernel). Whole warps: shuffles, then the
// group's warp totals; a power of two within a warp: shuffles; otherwise through shared memory
// (N x the block's threads floats). One call per kernel, or a barrier between calls (the buffer is
// written again) unless group_sums_by_shuffles.
template <int N>
__device__ __forceinline__ void group_sums(float (&value)[N], int per_group) {
  extern __shared__ float partial[];
  const int region = blockDim.x * blockDim.y;  // one per value
  float* row = partial + threadIdx.y * blockDim.x;
  if (per_group % kWarp == 0) {  // then blockDim.x is a multiple of 32 too: no warp spans rows
#pragma unroll
    for (int n = 0; n < N; ++n) {
#pragma unroll
      for (int o = kWarp / 2; o > 0; o /= 2)
        value[n] += __shfl_xor_sync(0xffffffffu, value[n], o);
      if (threadIdx.x % kWarp == 0) row[n * region + threadIdx.x / kWarp] = value[n];
    }
    __syncthreads();
    const int first = (threadIdx.x - threadIdx.x % per_group) / kWarp;
#pragma unroll
    for (int n = 0; n < N; ++n) {
      float s = 0.f;
      for (int i = 0; i < per_group / kWarp; ++i) s += row[n * region + first + i];
      value[n] = s;
    }
    return;
  }
  if (group_sums_by_shuffles(per_group)) {
    for (int o = per_group / 2; o > 0; o /= 2) {  // the N values' butterflies side by side
#pragma unroll
      for (int n = 0; n < N; ++n) value[n] += __shfl_xor_sync(0xffffffffu, value[n], o);
    }
    return;
  }
#pragma unroll
  for (int n = 0; n < N; ++n) row[n * region + threadIdx.x] = value[n];
  __syncthreads();
  const int first = threadIdx.x - threadIdx.x % per_group;
#pragma unroll
  for (int n = 0; n < N; ++n) {
    float s = 0.f;
    for (int i = 0; i < per_group; ++i) s += row[n * region + first + i];
    value[n] = s;
  }
}

__device__ __forceinline__ float group_sum(float value, int per_group) {
  float v[1] = {value};
  group_sums(v, per_group);
  return v[0];
}

__device__ __forceinline__ int64_t block_row() {
  return int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
}

// Reduces a pair (a, b) over a block of kThreads with merge(a, b, a2, b2), which folds (a2, b2)
// into (a, b): a butterfly within each warp, then thread 0 folds the warp results in warp order
// (a fixed order: bitwise reproducible). The result is valid on thread 0.
template <int kThreads, typename A, typename B, typename Merge>
__device__ __forceinline__ void block_merge(A& a, B& b, Merge merge) {
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const A a2 = __shfl_xor_sync(0xffffffffu, a, o);
    const B b2 = __shfl_xor_sync(0xffffffffu, b, o);
    merge(a, b, a2, b2);
  }
  __shared__ A warp_a[kThreads / kWarp];
  __shared__ B warp_b[kThreads / kWarp];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (lane == 0) {
    warp_a[warp] = a;
    warp_b[warp] = b;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / kWarp; ++w) merge(a, b, warp_a[w], warp_b[w]);
  }
}

// The KV-shift's and the norm's per-channel formulas, written once: the kernels that recompute a
// value another kernel wrote (the shifted rows, made again in a fused backward) must round it
// bit for bit as that kernel did, so the products are pinned (no contraction left to the compiler).
__device__ __forceinline__ float shift_value(float a, float prev, float now) {
  return __fmaf_rn(a, prev, __fmul_rn(1.f - a, now));  // a prev + (1 - a) now
}
// d cur[t] = (1 - a_t) d out[t] + a_{t+1} d out[t+1]
__device__ __forceinline__ float shift_input_grad(float a, float g, float a_next, float g_next) {
  return __fmaf_rn(a_next, g_next, __fmul_rn(1.f - a, g));
}
// dx = r (w dy - xhat m) with xhat = x r, gw = w dy, m = mean(w dy xhat)
__device__ __forceinline__ float norm_input_grad(float r, float gw, float x, float m) {
  return __fmul_rn(r, __fsub_rn(gw, __fmul_rn(__fmul_rn(x, r), m)));
}

// The input of a norm kernel that is a KV-shift of its rows (an attention layer's k part and its
// shift logits): row (b, t) is shift_value(a, x[t-1], x[t]) rounded to x's dtype, as
// shift_mix_forward_kernel writes it, zeros before t = 0. No logits: x as it is.
template <typename T>
struct ShiftSource {
  const T* logits = nullptr;  // (rows, heads), row stride lg_rs
  int64_t lg_rs = 0;
  uint32_t seq_len = 1;  // rows of one sequence: row r is position r % seq_len
  int dim = 1;           // channels a logit covers (the shift's head)
  // The position of a row, in 32 bits (a 64-bit division is a long instruction sequence): the
  // launchers take at most 2^31 rows.
  __device__ __forceinline__ uint32_t position(int64_t row) const {
    return uint32_t(row) % seq_len;
  }
};

// ---- RMSNorm ------------------------------------------------------------------------------------

// With `delta`: the input is x + delta, rounded to x's dtype (as the separate add would) and
// written to `sum` (the residual stream), and y is its norm. delta is x's dtype, or a half
// precision branch added to a float32 stream (d_t). A thread takes ROWS rows (blockDim.y apart),
// whose loads are all issued before any store: a block holds ROWS x blockDim.y rows. With kShift
// the input is the KV-shift of x's rows (ShiftSource; no delta).
template <typename in_t, typename out_t, typename w_t, int VEC, int ROWS, typename d_t = in_t,
          bool kShift = false>
__global__ void rms_norm_forward_kernel(const in_t* __restrict__ x, int64_t x_rs,
                                        const d_t* __restrict__ delta, int64_t d_rs,
                                        in_t* __restrict__ sum, const w_t* __restrict__ w,
                                        out_t* __restrict__ y, float* __restrict__ rstd,
                                        int64_t rows, int C, int G, float eps,
                                        ShiftSource<in_t> shift) {
  wait_for_previous_kernel();
  allow_next_kernel();
  // A thread's rows: blockDim.y apart, or with kShift consecutive, so that row t - 1 of all but
  // the first is the row before it in registers (H200, the k part's 16384 rows of 768 bf16: 25 ->
  // 20-22 us a call, 80 registers instead of 92).
  const int64_t step = kShift ? 1 : blockDim.y;
  const int64_t first =
      int64_t(blockIdx.x) * ROWS * blockDim.y + threadIdx.y * (kShift ? ROWS : 1);
  const int c = threadIdx.x * VEC;
  // All ROWS rows' loads are issued before any of them is used, with no branch between them: a
  // row past the end loads the last row instead (its results are not stored). Loads guarded row
  // by row left one row in flight a thread (the conversion of one row waited before the next
  // row's load was issued).
  int64_t at[ROWS];
#pragma unroll
  for (int n = 0; n < ROWS; ++n) at[n] = min(first + n * step, rows - 1);
  Pack<in_t, VEC> xs[ROWS];
#pragma unroll
  for (int n = 0; n < ROWS; ++n) xs[n] = load_pack<VEC>(x + at[n] * x_rs + c);
  // kShift: the row before the first (the first itself at a sequence's start), and the logits
  [[maybe_unused]] Pack<in_t, VEC> before;
  [[maybe_unused]] in_t logit[ROWS];
  if constexpr (kShift) {
#pragma unroll
    for (int n = 0; n < ROWS; ++n) logit[n] = shift.logits[at[n] * shift.lg_rs + c / shift.dim];
    before = load_pack<VEC>(x + (at[0] - (shift.position(at[0]) > 0)) * x_rs + c);
  }
  Pack<d_t, VEC> ds[ROWS];
  if (delta) {
#pragma unroll
    for (int n = 0; n < ROWS; ++n) ds[n] = load_pack<VEC>(delta + at[n] * d_rs + c);
  }
  float v[ROWS][VEC];
#pragma unroll
  for (int n = 0; n < ROWS; ++n) {
    unpack(xs[n], v[n]);
    if constexpr (kShift) {
      const float a = sigmoidf(static_cast<float>(logit[n]));
      const bool starts = shift.position(at[n]) == 0;
      float prev[VEC];
      unpack(n == 0 ? before : xs[n - 1], prev);
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        v[n][i] = static_cast<float>(
            static_cast<in_t>(shift_value(a, starts ? 0.f : prev[i], v[n][i])));
    }
    if (delta) {
      float d[VEC];
      unpack(ds[n], d);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[n][i] = static_cast<float>(static_cast<in_t>(v[n][i] + d[i]));
    }
  }
  float ss[ROWS] = {};
#pragma unroll
  for (int n = 0; n < ROWS; ++n) {
    const int64_t row = first + n * step;
    if (delta && row < rows) store(sum + row * C + c, v[n]);
#pragma unroll
    for (int i = 0; i < VEC; ++i) ss[n] += v[n][i] * v[n][i];
  }
  group_sums(ss, G / VEC);
#pragma unroll
  for (int n = 0; n < ROWS; ++n) {
    const int64_t row = first + n * step;
    if (row >= rows) break;
    const float r = rsqrtf(ss[n] / G + eps);
    if (c % G == 0) rstd[row * (C / G) + c / G] = r;
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[n][i] *= r * (w ? static_cast<float>(w[c + i]) : 1.f);
    store(y + row * C + c, v[n]);
  }
}

// A walking block's weight-gradient sums (VEC channels a thread, summed over its block rows' rows
// in order) added over the block rows in order by block row 0 and written as the block's row of
// dw_partial (gridDim.x, C). Shared memory: blockDim.y x C floats, free to write (after a barrier).
template <int VEC>
__device__ __forceinline__ void store_weight_grad_partial(float (&dw)[VEC], int C, int c,
                                                          float* __restrict__ dw_partial) {
  extern __shared__ float sums[];
#pragma unroll
  for (int i = 0; i < VEC; ++i) sums[threadIdx.y * C + c + i] = dw[i];
  __syncthreads();
  if (threadIdx.y != 0) return;
  for (int y = 1; y < int(blockDim.y); ++y) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) dw[i] += sums[y * C + c + i];
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i) dw_partial[int64_t(blockIdx.x) * C + c + i] = dw[i];
}

// dx = r * (w dy - xhat * mean(w dy xhat)), xhat = x r. With dsum (x's dtype): dx + dsum, the
// gradient of a residual stream that is both normed and passed on; with dx_cast it is also
// written there in that dtype (the gradient of the branch added to the stream).
// With dw_partial (gridDim.x, C): the weight's gradient in the same pass. Each block then walks
// the block rows blockIdx.x, + gridDim.x, ..., every thread summing dy * xhat of its channels in
// order, and writes its block's sums (its block rows added in order); the host adds the blocks'
// rows in order. Without it a block takes one block row. A float32 x (the residual stream) has
// dsum loaded with x and dy, so that a block row waits for memory once; 16-bit rows load it after
// the sum (loaded early its registers would cost the per-head norms a block an SM). 16-bit rows go
// two a step (a walk's rows k and k + 1, or two block rows), their loads issued together and
// summed in the walk's order, so that two rows a thread are in flight; float32 rows (the residual
// stream, at the bandwidth with one) one. At most 64 registers (the bound of 1024 threads a
// block): two rows took 96 and three blocks an SM, which is no more rows in flight than one row
// in six blocks (H200, 16384 rows of 768 bf16, per-head groups: 29 -> 23 us a call).
template <typename in_t>
constexpr int kNormBackwardRows = sizeof(in_t) == 4 ? 1 : 2;  // rows a thread takes a step

template <typename in_t, typename grad_t, int VEC, typename d_t = in_t>
__global__ void __launch_bounds__(kMaxRowThreads)
    rms_norm_backward_kernel(const grad_t* __restrict__ dy, int64_t dy_rs,
                             const in_t* __restrict__ x, int64_t x_rs, const float* __restrict__ w,
                             const float* __restrict__ rstd, in_t* __restrict__ dx, int64_t dx_rs,
                             int64_t rows, int C, int G, const in_t* __restrict__ dsum = nullptr,
                             int64_t ds_rs = 0, d_t* __restrict__ dx_cast = nullptr,
                             float* __restrict__ dw_partial = nullptr) {
  constexpr bool kEarlyDsum = sizeof(in_t) == 4;
  constexpr int R = kNormBackwardRows<in_t>;
  const int c = threadIdx.x * VEC;
  // A thread's R rows of a step: a walk's next R block rows, or without the weight's gradient
  // its block's R block rows.
  const int64_t gap = dw_partial ? int64_t(gridDim.x) * blockDim.y : int64_t(blockDim.y);
  float dw[VEC] = {};
  for (int64_t first = int64_t(blockIdx.x) * (dw_partial ? 1 : R) * blockDim.y; first < rows;
       first += R * gap) {
    int64_t row[R], at[R];
#pragma unroll
    for (int n = 0; n < R; ++n) {
      row[n] = first + n * gap + threadIdx.y;
      at[n] = min(row[n], rows - 1);  // loads without a branch; a row past the end is not stored
    }
    Pack<in_t, VEC> xs[R];
    Pack<grad_t, VEC> gs[R];
    [[maybe_unused]] Pack<in_t, VEC> early[R];
    float r[R];
#pragma unroll
    for (int n = 0; n < R; ++n) {
      xs[n] = load_pack<VEC>(x + at[n] * x_rs + c);
      gs[n] = load_pack<VEC>(dy + at[n] * dy_rs + c);
      r[n] = rstd[at[n] * (C / G) + c / G];
    }
    if (kEarlyDsum && dsum) {
#pragma unroll
      for (int n = 0; n < R; ++n) early[n] = load_pack<VEC>(dsum + at[n] * ds_rs + c);
    }
    float xv[R][VEC], g[R][VEC], dot[R];
#pragma unroll
    for (int n = 0; n < R; ++n) {
      unpack(xs[n], xv[n]);
      unpack(gs[n], g[n]);
      dot[n] = 0.f;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        if (row[n] < rows) dw[i] += g[n][i] * xv[n][i] * r[n];
        g[n][i] *= w ? w[c + i] : 1.f;
        dot[n] += g[n][i] * xv[n][i];
      }
    }
    group_sums(dot, G / VEC);
#pragma unroll
    for (int n = 0; n < R; ++n) {
      if (row[n] >= rows) break;
      const float m = dot[n] * r[n] / G;  // mean(w dy xhat)
#pragma unroll
      for (int i = 0; i < VEC; ++i) g[n][i] = norm_input_grad(r[n], g[n][i], xv[n][i], m);
      if (dsum) {
        float ds[VEC];
        if constexpr (kEarlyDsum) {
          unpack(early[n], ds);
        } else {
          load(dsum + row[n] * ds_rs + c, ds);
        }
#pragma unroll
        for (int i = 0; i < VEC; ++i)
          g[n][i] = static_cast<float>(static_cast<in_t>(g[n][i])) + ds[i];
      }
      store(dx + row[n] * dx_rs + c, g[n]);
      if (dx_cast) store(dx_cast + row[n] * C + c, g[n]);
    }
    if (!dw_partial) return;  // one step per block
    // group_sums' buffer is written again in the next step
    if (!group_sums_by_shuffles(G / VEC)) __syncthreads();
  }
  store_weight_grad_partial(dw, C, c, dw_partial);
}

// ---- KV-shift -------------------------------------------------------------------------------------
// Row (b, t): out = a * prev + (1 - a) * cur with a = sigmoid(logit of the thread's head).

// A row's sequence and position: in 32-bit divisions where the row index fits (a 64-bit division
// is a long instruction sequence).
__device__ __forceinline__ void sequence_and_position(int64_t row, int64_t T_, int64_t& b,
                                                      int64_t& t) {
  if (row <= int64_t(UINT32_MAX) && T_ <= int64_t(UINT32_MAX)) {
    b = uint32_t(row) / uint32_t(T_);
    t = uint32_t(row) % uint32_t(T_);
  } else {
    b = row / T_;
    t = row % T_;
  }
}

// The shift kernels load a row's inputs without a branch between them (a neighbour that does not
// exist is read from the row itself and zeroed after), so that they are in flight together.

// With `last` (B, C): row T-1 of cur is also written there (the next step's `first`; it may be
// `first` itself when T = 1: each thread reads its slice of it before writing that slice).
template <typename T, int VEC>
__global__ void shift_mix_forward_kernel(const T* __restrict__ cur, int64_t cur_bs, int64_t cur_ts,
                                         const T* __restrict__ logits, int64_t lg_bs,
                                         int64_t lg_ts, const T* first, T* __restrict__ out,
                                         T* last, int64_t B, int64_t T_, int C, int D) {
  wait_for_previous_kernel();
  allow_next_kernel();
  const int64_t row = block_row();
  if (row >= B * T_) return;
  int64_t b, t;
  sequence_and_position(row, T_, b, t);
  const int c = threadIdx.x * VEC;
  const T* now_p = cur + b * cur_bs + t * cur_ts + c;
  const T* prev_p = t > 0 ? now_p - cur_ts : first ? first + b * C + c : now_p;
  const bool no_prev = t == 0 && !first;
  const float a = sigmoidf(static_cast<float>(logits[b * lg_bs + t * lg_ts + c / D]));
  float now[VEC], prev[VEC];
  load(now_p, now);
  load(prev_p, prev);
  if (last && t == T_ - 1) store(last + b * C + c, now);
#pragma unroll
  for (int i = 0; i < VEC; ++i) now[i] = shift_value(a, no_prev ? 0.f : prev[i], now[i]);
  store(out + row * C + c, now);
}

// dcur[t] = (1 - a_t) dout[t] + a_{t+1} dout[t+1]; dlogit = a (1 - a) sum_head (prev - cur) dout;
// dfirst = a_0 dout[0].
template <typename T, int VEC>
__global__ void shift_mix_backward_kernel(const T* __restrict__ dout, const T* __restrict__ cur,
                                          int64_t cur_bs, int64_t cur_ts,
                                          const T* __restrict__ logits, int64_t lg_bs,
                                          int64_t lg_ts, const T* __restrict__ first,
                                          T* __restrict__ dcur, int64_t dc_bs, int64_t dc_ts,
                                          T* __restrict__ dlogits, int64_t dl_bs, int64_t dl_ts,
                                          T* __restrict__ dfirst, int64_t B, int64_t T_, int C,
                                          int D) {
  const bool active = block_row() < B * T_;
  const int64_t row = active ? block_row() : B * T_ - 1;  // loads the last row; nothing stored
  int64_t b, t;
  sequence_and_position(row, T_, b, t);
  const int c = threadIdx.x * VEC, h = c / D;
  const bool has_next = t + 1 < T_;
  const T* now_p = cur + b * cur_bs + t * cur_ts + c;
  const T* prev_p = t > 0 ? now_p - cur_ts : first ? first + b * C + c : now_p;
  const bool no_prev = t == 0 && !first;
  const int64_t next = has_next ? 1 : 0;  // the next row, or the row itself
  float g[VEC], g_next[VEC], now[VEC], prev[VEC];
  const T logit = logits[b * lg_bs + t * lg_ts + h];
  const T logit_next = logits[b * lg_bs + (t + next) * lg_ts + h];
  load(dout + row * C + c, g);
  load(now_p, now);
  load(prev_p, prev);
  load(dout + (row + next) * C + c, g_next);
  const float a = sigmoidf(static_cast<float>(logit));
  const float a_next = has_next ? sigmoidf(static_cast<float>(logit_next)) : 0.f;
  float dot = 0.f;
#pragma unroll
  for (int i = 0; i < VEC; ++i) dot += ((no_prev ? 0.f : prev[i]) - now[i]) * g[i];
  dot = group_sum(dot, D / VEC);
  if (!active) return;
  if (c % D == 0) dlogits[b * dl_bs + t * dl_ts + h] = static_cast<T>(dot * a * (1.f - a));
  if (t == 0 && dfirst) {
    float df[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) df[i] = a * g[i];
    store(dfirst + b * C + c, df);
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i)
    g[i] = shift_input_grad(a, g[i], a_next, has_next ? g_next[i] : 0.f);
  store(dcur + b * dc_bs + t * dc_ts + c, g);
}

// The backward of the KV-shift and the norm after it (the forward: rms_norm_forward_kernel with
// kShift) in one pass, the shifted rows made again from cur instead of kept. Row t's d cur needs
// the norm's input gradient at t and t + 1 (the shift's backward), and the shifted row t + 1 needs
// cur at t: each thread-row walks a run of consecutive rows and carries row t + 1's cur and norm
// gradient into the next step, so that every row is loaded and normed once (the shift's
// neighbours from registers; a run's last step loads and norms the next run's first row too).
// Each step requests the inputs of the row after next, so that a step waits for no load issued
// in it (H200, 16384 rows of 768 bf16: 45 us a call, against 52 with each step's own row loaded
// in it and 54 for the form that strode over the rows and loaded and normed each row twice).
// Every value is rounded as rms_norm_backward_kernel and shift_mix_backward_kernel round it. The
// norm weight's gradient: each thread sums its run's rows in order, the block its thread-rows in
// order (one row of dw_partial), the host the blocks in order; with one row a run (small inputs)
// that is rms_norm_backward_kernel's grouping.
constexpr int kShiftNormThreads = 256;
constexpr int64_t kShiftNormMaxRows = int64_t(1) << 31;  // positions in 32 bits
// At most 112 registers: three blocks of 192 threads an SM, no spills (at 80, four blocks, the
// inputs requested a step ahead spilled: ~60 us a call). CUDA before 12.4 has no
// __maxnreg__: two blocks of 256 threads.
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12040
#define FOX_SHIFT_NORM_BACKWARD_BOUNDS __maxnreg__(112)
#else
#define FOX_SHIFT_NORM_BACKWARD_BOUNDS __launch_bounds__(kShiftNormThreads, 2)
#endif
template <typename T, int VEC>
__global__ void FOX_SHIFT_NORM_BACKWARD_BOUNDS
    shift_norm_backward_kernel(const T* __restrict__ dy, int64_t dy_rs, const T* __restrict__ cur,
                               int64_t cur_rs, ShiftSource<T> shift, const float* __restrict__ w,
                               const float* __restrict__ rstd, T* __restrict__ dcur, int64_t dc_rs,
                               T* __restrict__ dlogits, int64_t dl_rs, int64_t rows, int C, int G,
                               float* __restrict__ dw_partial) {
  const int c = threadIdx.x * VEC, h = c / shift.dim;
  const bool barriers =
      !group_sums_by_shuffles(G / VEC) || !group_sums_by_shuffles(shift.dim / VEC);
  auto sum_over = [&](float v, int per_group) {
    if (barriers) __syncthreads();  // the buffer of the sum before
    return group_sum(v, per_group);
  };
  // Rows in 32 bits (the launcher takes at most 2^31).
  const int n_rows = int(rows);
  const int runs = int(gridDim.x * blockDim.y);
  const int len = (n_rows + runs - 1) / runs;
  const int begin = int(blockIdx.x * blockDim.y + threadIdx.y) * len;
  const int end = begin + len < n_rows ? begin + len : n_rows;
  float dw[VEC] = {};
  // A row's inputs, requested a step before the step that uses them (a row past the end loads
  // the last row instead, without a branch; nothing of it is kept).
  struct Inputs {
    Pack<T, VEC> cur, dy;
    T logit;
    float r;
  };
  auto fetch = [&](int t) {
    const int64_t at = t < n_rows ? t : n_rows - 1;
    return Inputs{load_pack<VEC>(cur + at * cur_rs + c), load_pack<VEC>(dy + at * dy_rs + c),
                  shift.logits[at * shift.lg_rs + h], rstd[at * (C / G) + c / G]};
  };
  // The backward of a row whose shifted row is made from prev and now (zero where the row does not
  // exist): the norm's input gradient n rounded to T, the row's shift weight a, and the sum of
  // (prev - now) n over its shift head (the shift logit's gradient is that times a (1 - a)); with
  // `count` its part of the norm weight's gradient is added to dw. Rows are held in T (cur's rows
  // and n are values of T): half the registers of float32.
  auto row_backward = [&](bool exists, const Pack<T, VEC>& prev_p, const Pack<T, VEC>& now_p,
                          const Inputs& in, bool count, Pack<T, VEC>& n, float& a, float& mix) {
    float g[VEC], prev[VEC], now[VEC], x[VEC];
    unpack(in.dy, g);
    unpack(prev_p, prev);
    unpack(now_p, now);
    a = exists ? sigmoidf(static_cast<float>(in.logit)) : 0.f;
    const float r = exists ? in.r : 0.f;
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      if (!exists) g[i] = 0.f;
      x[i] = static_cast<float>(static_cast<T>(shift_value(a, prev[i], now[i])));
      if (count && exists) dw[i] += g[i] * x[i] * r;
      g[i] *= w ? w[c + i] : 1.f;
      dot += g[i] * x[i];
    }
    const float m = sum_over(dot, G / VEC) * r / G;
    mix = 0.f;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      n.v[i] = static_cast<T>(norm_input_grad(r, g[i], x[i], m));
      mix += (prev[i] - now[i]) * static_cast<float>(n.v[i]);
    }
    mix = sum_over(mix, shift.dim / VEC);
  };
  // Row t's state: cur at t, its norm gradient, a and mix; the inputs of row t + 1 (requested in
  // the step before).
  const Pack<T, VEC> zero{};
  Pack<T, VEC> now, n;
  float a, mix;
  {
    const Inputs first = fetch(begin);
    Pack<T, VEC> prev = zero;
    if (begin < n_rows && shift.position(begin) > 0)
      prev = load_pack<VEC>(cur + int64_t(begin - 1) * cur_rs + c);
    now = first.cur;
    row_backward(begin < n_rows, prev, now, first, true, n, a, mix);
  }
  Inputs in_next = fetch(begin + 1);
  for (int t = begin; t < begin + len; ++t) {
    const bool active = t < end;
    const bool next_exists = active && t + 1 < n_rows;
    const bool has_next = next_exists && shift.position(t + 1) > 0;  // the same sequence
    const Inputs in_after = fetch(t + 2);  // in flight while this step computes
    Pack<T, VEC> n_next;
    float a_next, mix_next;
    row_backward(next_exists, has_next ? now : zero, in_next.cur, in_next, t + 1 < end, n_next,
                 a_next, mix_next);
    if (active) {
      if (c % shift.dim == 0) dlogits[int64_t(t) * dl_rs + h] = static_cast<T>(mix * a * (1.f - a));
      float d[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        d[i] = shift_input_grad(a, static_cast<float>(n.v[i]), has_next ? a_next : 0.f,
                                has_next ? static_cast<float>(n_next.v[i]) : 0.f);
      }
      store(dcur + int64_t(t) * dc_rs + c, d);
    }
    now = in_next.cur;
    n = n_next;
    a = a_next;
    mix = mix_next;
    in_next = in_after;
  }
  if (barriers) __syncthreads();  // the last sum's buffer, before the weight gradient's
  if (dw_partial) store_weight_grad_partial(dw, C, c, dw_partial);
}

// ---- gates: y = act(g) * u ------------------------------------------------------------------------

template <typename T, int VEC>
__global__ void gated_forward_kernel(const T* __restrict__ g, int64_t g_rs,
                                     const T* __restrict__ u, int64_t u_rs, T* __restrict__ y,
                                     int64_t rows, int C, bool silu) {
  wait_for_previous_kernel();
  allow_next_kernel();
  const int64_t row = block_row();
  if (row >= rows) return;
  const int c = threadIdx.x * VEC;
  float gv[VEC], uv[VEC];
  load(g + row * g_rs + c, gv);
  load(u + row * u_rs + c, uv);
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float s = sigmoidf(gv[i]);
    uv[i] *= silu ? gv[i] * s : s;
  }
  store(y + row * C + c, uv);
}

// y may be dy itself: each thread reads its elements of dy before it writes theirs of y (neither
// is __restrict__).
template <typename T, int VEC>
__global__ void gated_backward_kernel(const T* dy, const T* __restrict__ g, int64_t g_rs,
                                      const T* __restrict__ u, int64_t u_rs,
                                      T* __restrict__ dg, int64_t dg_rs, T* __restrict__ du,
                                      int64_t du_rs, int64_t rows, int C, bool silu, T* y) {
  const int64_t row = block_row();
  if (row >= rows) return;
  const int c = threadIdx.x * VEC;
  float gv[VEC], uv[VEC], d[VEC], prod[VEC];
  load(g + row * g_rs + c, gv);
  load(u + row * u_rs + c, uv);
  load(dy + row * C + c, d);
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float s = sigmoidf(gv[i]);
    const float act = silu ? gv[i] * s : s;
    const float dact = silu ? s * (1.f + gv[i] * (1.f - s)) : s * (1.f - s);
    prod[i] = uv[i] * act;  // gated_forward_kernel's product, bit for bit
    gv[i] = d[i] * uv[i] * dact;
    uv[i] = d[i] * act;
  }
  store(dg + row * dg_rs + c, gv);
  store(du + row * du_rs + c, uv);
  if (y) store(y + row * C + c, prod);
}

// ---- rows copied between strided views ------------------------------------------------------------
// ATen's copy into a view with a row stride runs its unvectorized kernel (~half the bandwidth).

template <typename T, int VEC>
__global__ void copy_rows_kernel(const T* __restrict__ src, int64_t src_rs, T* __restrict__ dst,
                                 int64_t dst_rs, int64_t rows) {
  const int64_t row = block_row();
  if (row >= rows) return;
  const int c = threadIdx.x * VEC;
  float v[VEC];
  load(src + row * src_rs + c, v);  // exact: every value of T is a float
  store(dst + row * dst_rs + c, v);
}

// ---- cross entropy ----------------------------------------------------------------------------------
// One block per row: an online (max, sum of exp) pass, then the label's logit. Each thread takes VEC
// consecutive logits per load (16 bytes where the rows allow it): with one 2-byte load per thread a
// 16k x 32k bf16 chunk ran at ~1 TB/s, a third of the bandwidth.

constexpr int kLossThreads = 512;

__device__ __forceinline__ void merge_max_sum(float& m, float& s, float m2, float s2) {
  const float mm = fmaxf(m, m2);
  if (mm == -INFINITY) return;
  s = s * __expf(m - mm) + s2 * __expf(m2 - mm);
  m = mm;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kLossThreads)
    cross_entropy_forward_kernel(const T* __restrict__ logits, int64_t rs,
                                 const int64_t* __restrict__ labels, float* __restrict__ loss,
                                 float* __restrict__ lse, int64_t V, int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * rs;
  float m = -INFINITY, s = 0.f;
  const int64_t whole = V - V % VEC;  // logits in whole vectors; the rest one a thread
  for (int64_t v = int64_t(threadIdx.x) * VEC; v < whole; v += int64_t(blockDim.x) * VEC) {
    float xv[VEC];
    load<VEC>(x + v, xv);
    float chunk_max = xv[0];
#pragma unroll
    for (int i = 1; i < VEC; ++i) chunk_max = fmaxf(chunk_max, xv[i]);
    if (chunk_max > m) {  // rescale once per chunk, not per logit
      s *= __expf(m - chunk_max);
      m = chunk_max;
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) s += __expf(xv[i] - m);
  }
  if (whole + threadIdx.x < V) {
    const float xv = static_cast<float>(x[whole + threadIdx.x]);
    if (xv > m) {
      s *= __expf(m - xv);
      m = xv;
    }
    s += __expf(xv - m);
  }
  block_merge<kLossThreads>(m, s, [](float& m1, float& s1, float m2, float s2) {
    merge_max_sum(m1, s1, m2, s2);
  });
  if (threadIdx.x == 0) {
    const float l = m + logf(s);
    lse[row] = l;
    const int64_t label = labels[row];
    if (label == ignore_index) {
      loss[row] = 0.f;
    } else if (label < 0 || label >= V) {
      loss[row] = NAN;  // an invalid label poisons its loss instead of faulting the device
    } else {
      loss[row] = l - static_cast<float>(x[label]);
    }
  }
}

// dlogits may be logits itself (the chunked loss turns its logits into their gradient in place):
// each thread reads its logits before it writes them.
template <typename T, int VEC>
__global__ void __launch_bounds__(kLossThreads)
    cross_entropy_backward_kernel(const float* __restrict__ dloss, const T* logits, int64_t rs,
                                  const int64_t* __restrict__ labels,
                                  const float* __restrict__ lse, T* dlogits, int64_t drs, int64_t V,
                                  int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * rs;
  T* dx = dlogits + row * drs;
  const int64_t label = labels[row];
  const bool ignored = label == ignore_index;
  const float g = ignored ? 0.f : dloss[row], l = lse[row];
  const int64_t whole = V - V % VEC;
  for (int64_t v = int64_t(threadIdx.x) * VEC; v < whole; v += int64_t(blockDim.x) * VEC) {
    float xv[VEC];
    load<VEC>(x + v, xv);
#pragma unroll
    for (int i = 0; i < VEC; ++i) xv[i] = (__expf(xv[i] - l) - (v + i == label ? 1.f : 0.f)) * g;
    store<VEC>(dx + v, xv);
  }
  const int64_t v = whole + threadIdx.x;
  if (v < V) {
    const float xv = static_cast<float>(x[v]);
    dx[v] = static_cast<T>((__expf(xv - l) - (v == label ? 1.f : 0.f)) * g);
  }
}

// The widest VEC (16 bytes at most) that divides the row stride of these (rows, V) tensors and
// their alignment (a row's last V % VEC logits are read one a thread).
int loss_vector_width(std::initializer_list<at::Tensor> tensors) {
  int64_t size = 1;
  for (const auto& t : tensors) size = std::max<int64_t>(size, t.element_size());
  for (int vec = int(16 / size); vec > 1; vec /= 2) {
    bool fits = true;
    for (const auto& t : tensors) {
      fits = fits && t.stride(0) % vec == 0 &&
             reinterpret_cast<uintptr_t>(t.data_ptr()) % (vec * t.element_size()) == 0;
    }
    if (fits) return vec;
  }
  return 1;
}

// ---- argmax ---------------------------------------------------------------------------------------
// One block per row; each thread keeps the best of its strided elements (kArgmaxUnroll loads in
// flight), then a warp and a block reduction. Order: larger value first, NaN above everything, the
// smaller index on ties (torch.argmax's result).

constexpr int kArgmaxThreads = 1024, kArgmaxUnroll = 8;

__device__ __forceinline__ bool comes_first(float a, int64_t ia, float b, int64_t ib) {
  if (isnan(a)) return !isnan(b) || ia < ib;
  if (isnan(b)) return false;
  return a > b || (a == b && ia < ib);
}

template <typename T>
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_kernel(const T* __restrict__ x, int64_t rs, int64_t* __restrict__ out, int64_t V) {
  wait_for_previous_kernel();
  allow_next_kernel();
  const T* row = x + int64_t(blockIdx.x) * rs;
  float best = -INFINITY;
  int64_t best_i = V;  // loses to any element
  for (int64_t base = threadIdx.x; base < V; base += int64_t(blockDim.x) * kArgmaxUnroll) {
    float vals[kArgmaxUnroll];
#pragma unroll
    for (int u = 0; u < kArgmaxUnroll; ++u) {
      const int64_t i = base + int64_t(u) * blockDim.x;
      vals[u] = i < V ? static_cast<float>(row[i]) : -INFINITY;
    }
#pragma unroll
    for (int u = 0; u < kArgmaxUnroll; ++u) {
      const int64_t i = base + int64_t(u) * blockDim.x;
      if (i < V && comes_first(vals[u], i, best, best_i)) {
        best = vals[u];
        best_i = i;
      }
    }
  }
  block_merge<kArgmaxThreads>(best, best_i, [](float& v, int64_t& i, float v2, int64_t i2) {
    if (comes_first(v2, i2, v, i)) {
      v = v2;
      i = i2;
    }
  });
  if (threadIdx.x == 0) out[blockIdx.x] = best_i;
}

// ---- static KV cache ------------------------------------------------------------------------------
// One launch writes a decoding step's keys, values and log forget gates into their rows of the
// static cache (three scatters otherwise). Block (b, t) copies row (b, t) of each to position
// pos[b, t] of row b. The gates come as float32 log f, or as the forget gate's logits (any float
// dtype) when `logits`: log f = logsigmoid(logit) is then computed here, in float32.
__device__ __forceinline__ float log_sigmoid(float x) {
  return fminf(x, 0.f) - log1pf(expf(-fabsf(x)));  // no overflow for large |x|
}

template <typename T, typename G, typename GO>
__global__ void cache_write_kernel(const T* __restrict__ k_new, int64_t kn_bs, int64_t kn_ts,
                                   const T* __restrict__ v_new, int64_t vn_bs, int64_t vn_ts,
                                   const G* __restrict__ g_new, int64_t gn_bs, int64_t gn_ts,
                                   bool logits, const int64_t* __restrict__ pos,
                                   T* __restrict__ k, int64_t k_bs, int64_t k_ts,
                                   T* __restrict__ v, int64_t v_bs, int64_t v_ts,
                                   GO* __restrict__ g, int64_t g_bs, int64_t g_ts, int T_new,
                                   int C, int H) {
  wait_for_previous_kernel();
  allow_next_kernel();
  const int64_t b = blockIdx.x / T_new, t = blockIdx.x % T_new;
  const int64_t j = pos[blockIdx.x];
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    k[b * k_bs + j * k_ts + c] = k_new[b * kn_bs + t * kn_ts + c];
    v[b * v_bs + j * v_ts + c] = v_new[b * vn_bs + t * vn_ts + c];
  }
  for (int h = threadIdx.x; h < H; h += blockDim.x) {
    const float x = static_cast<float>(g_new[b * gn_bs + t * gn_ts + h]);
    g[b * g_bs + j * g_ts + h] = static_cast<GO>(logits ? log_sigmoid(x) : x);
  }
}

// ---- forget gate ---------------------------------------------------------------------------------
// log f = logsigmoid(logit + bias) of a training forward, one launch for the bias's cast, the add,
// the cast up and the log-sigmoid. The sum is rounded as the composition rounds it (the bias cast to
// the logits' dtype, the sum in float32 rounded to it); the log-sigmoid and its derivative are
// evaluated in float64 (the build's fast math approximates float32 exp) and rounded once.
template <typename T, typename BT>
__device__ __forceinline__ float biased_logit(T logit, const BT* bias, int h) {
  if (bias == nullptr) return static_cast<float>(logit);
  const T b = static_cast<T>(static_cast<float>(bias[h]));
  return static_cast<float>(static_cast<T>(static_cast<float>(logit) + static_cast<float>(b)));
}

template <typename T, typename BT>
__global__ void forget_gate_forward_kernel(const T* __restrict__ logits, int64_t l_bs, int64_t l_ts,
                                           const BT* __restrict__ bias, float* __restrict__ out,
                                           int64_t n, int T_len, int H) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int h = int(i % H);
  const int64_t bt = i / H, b = bt / T_len, t = bt % T_len;
  const double x = biased_logit(logits[b * l_bs + t * l_ts + h], bias, h);
  out[i] = static_cast<float>(fmin(x, 0.0) - log1p(exp(-fabs(x))));
}

// dlogit = dlogf * sigmoid(-x), rounded to float32 and then to the logits' dtype (the composition's
// cast back down).
template <typename T, typename BT>
__global__ void forget_gate_backward_kernel(const float* __restrict__ dout,
                                            const T* __restrict__ logits, int64_t l_bs,
                                            int64_t l_ts, const BT* __restrict__ bias,
                                            T* __restrict__ dlogits, int64_t n, int T_len, int H) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int h = int(i % H);
  const int64_t bt = i / H, b = bt / T_len, t = bt % T_len;
  const double x = biased_logit(logits[b * l_bs + t * l_ts + h], bias, h);
  dlogits[i] = static_cast<T>(static_cast<float>(double(dout[i]) / (1.0 + exp(x))));
}

// ---- host side ------------------------------------------------------------------------------------

#define FOX_FLOAT_TYPES(TYPE, NAME, ...)                        \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)   \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

#define FOX_HALF_TYPES(TYPE, NAME, ...)                         \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)   \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

#define FOX_VEC_SWITCH(vec, ...)   \
  switch (vec) {                   \
    case 8: {                      \
      constexpr int VEC = 8;       \
      __VA_ARGS__();               \
      break;                       \
    }                              \
    case 4: {                      \
      constexpr int VEC = 4;       \
      __VA_ARGS__();               \
      break;                       \
    }                              \
    case 2: {                      \
      constexpr int VEC = 2;       \
      __VA_ARGS__();               \
      break;                       \
    }                              \
    default: {                     \
      constexpr int VEC = 1;       \
      __VA_ARGS__();               \
    }                              \
  }

const float* optional_float(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<float>() : nullptr;
}
template <typename T>
const T* optional_ptr(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}
template <typename T>
T* optional_mut(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

// Threads (x: one row's VEC-channel slices; y: rows) and shared memory of a row-kernel block.
struct RowLaunch {
  dim3 grid, block;
  size_t smem;
};
// `per_thread` rows a thread (a block then holds per_thread x blockDim.y rows; group_sums' buffer
// one float a thread and row).
RowLaunch row_launch(int64_t rows, int64_t channels, int vec, int per_thread = 1) {
  const int tx = int(channels / vec);
  const int ty = std::max(1, 256 / tx);
  return {dim3(unsigned(blocks_for(rows, int64_t(ty) * per_thread))),
          dim3(unsigned(tx), unsigned(ty)), size_t(tx) * ty * per_thread * sizeof(float)};
}

// Blocks of `kernel` that the device holds at once: a kernel whose blocks each walk many rows is
// launched with no more, so that none waits for a second wave (a few blocks running a whole
// block's walk after the rest). Cached per kernel and shape: a query per call costs host time.
template <typename Kernel>
int64_t resident_blocks(Kernel kernel, dim3 block, size_t smem) {
  static auto* cache = new std::map<std::tuple<const void*, int, unsigned, size_t>, int64_t>();
  static std::mutex mutex;
  const int device = c10::cuda::current_device();
  const auto key = std::tuple(reinterpret_cast<const void*>(kernel), device,
                              block.x * block.y * block.z, smem);
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache->find(key);
  if (it != cache->end()) return it->second;
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, kernel, int(block.x * block.y * block.z), smem));
  const int64_t blocks =
      int64_t(std::max(per_sm, 1)) * at::cuda::getDeviceProperties(device)->multiProcessorCount;
  cache->emplace(key, blocks);
  return blocks;
}

int checked_width(int64_t channels, int64_t group, std::initializer_list<at::Tensor> tensors) {
  const int vec = row_vector_width(channels, group, tensors);
  TORCH_CHECK(vec > 0, "fused row kernel: channels ", channels, " / group ", group,
              " do not fit (the caller checks row_vector_width first)");
  return vec;
}

}  // namespace

int row_vector_width(int64_t channels, int64_t group, std::initializer_list<at::Tensor> tensors) {
  if (channels <= 0 || group <= 0 || channels % group != 0) return 0;
  int64_t widest = 1;
  for (const auto& t : tensors) {
    if (t.defined()) widest = std::max<int64_t>(widest, t.element_size());
  }
  for (int vec = int(16 / widest); vec >= 1; vec /= 2) {
    bool fits = channels % vec == 0 && group % vec == 0;
    for (const auto& t : tensors) {
      if (!t.defined() || !fits) continue;
      fits = reinterpret_cast<uintptr_t>(t.data_ptr()) % (vec * t.element_size()) == 0;
      for (int64_t d = 0; d + 1 < t.dim() && fits; ++d) fits = t.stride(d) % vec == 0;
    }
    if (fits) return channels / vec <= kMaxRowThreads ? vec : 0;
  }
  return 0;
}

bool shift_norm_fits(int64_t rows, int64_t channels, int64_t group, int64_t head,
                     std::initializer_list<at::Tensor> tensors) {
  if (group <= 0 || head <= 0 || rows > kShiftNormMaxRows) return false;
  const int vec = row_vector_width(channels, std::gcd(group, head), tensors);
  return vec > 0 && channels / vec <= kShiftNormThreads;  // row_launch's blocks then fit too
}

void rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, int64_t group, double eps,
                      const at::Tensor& y, const at::Tensor& rstd, const at::Tensor& delta,
                      const at::Tensor& sum) {
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0);
  const int C = int(x.size(1));
  if (rows == 0) return;
  const bool mixed = delta.defined() && delta.scalar_type() != x.scalar_type();
  TORCH_CHECK(!delta.defined() || (sum.defined() && sum.scalar_type() == x.scalar_type()),
              "rms_norm_forward: delta and sum must both be given, sum of x's dtype");
  TORCH_CHECK(!mixed || (x.scalar_type() == at::kFloat && delta.scalar_type() == y.scalar_type()),
              "rms_norm_forward: a delta of another dtype than x's needs float32 x and y of "
              "delta's dtype");
  const int vec = checked_width(C, group, {x, y, delta, sum});
  // Rows a thread (H200, 16384 rows of 768): 4 for one dtype (bf16 per-head norms 21 -> 19 us a
  // call with one row in flight, 17 with all four), 1 for a float32 stream plus a 16-bit branch
  // (4 rows: 40 -> 43 us).
  constexpr int kRows = 4, kMixedRows = 1;
  auto stream = at::cuda::getCurrentCUDAStream();
  // The weight is read in its own dtype: float32, or x's (a bf16 model's norms, without a
  // float32 copy per call).
  const bool float_weight = !weight.defined() || weight.scalar_type() == at::kFloat;
  TORCH_CHECK(float_weight || weight.scalar_type() == x.scalar_type(),
              "rms_norm_forward: weight must be float32 or x's dtype");
  const int64_t d_rs = delta.defined() ? delta.stride(0) : 0;
  if (mixed) {  // a float32 residual stream plus a half-precision branch, y in the branch's dtype
    FOX_HALF_TYPES(delta.scalar_type(), "rms_norm_forward", [&] {
      FOX_VEC_SWITCH(vec, [&] {
        const auto L = row_launch(rows, C, vec, kMixedRows);
        C10_CUDA_CHECK(launch_dependent(
            rms_norm_forward_kernel<float, scalar_t, float, VEC, kMixedRows, scalar_t>, L.grid,
            L.block, L.smem, stream, x.data_ptr<float>(), x.stride(0), delta.data_ptr<scalar_t>(),
            d_rs, sum.data_ptr<float>(), optional_float(weight), y.data_ptr<scalar_t>(),
            rstd.data_ptr<float>(), rows, C, int(group), float(eps), ShiftSource<float>{}));
      });
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const auto L = row_launch(rows, C, vec, kRows);
  FOX_FLOAT_TYPES(x.scalar_type(), "rms_norm_forward", [&] {
    using in_t = scalar_t;
    FOX_FLOAT_TYPES(y.scalar_type(), "rms_norm_forward", [&] {
      FOX_VEC_SWITCH(vec, [&] {
        const in_t* d = optional_ptr<in_t>(delta);
        if (float_weight) {
          C10_CUDA_CHECK(launch_dependent(
              rms_norm_forward_kernel<in_t, scalar_t, float, VEC, kRows>, L.grid, L.block, L.smem,
              stream, x.data_ptr<in_t>(), x.stride(0), d, d_rs, optional_mut<in_t>(sum),
              optional_float(weight), y.data_ptr<scalar_t>(), rstd.data_ptr<float>(), rows, C,
              int(group), float(eps), ShiftSource<in_t>{}));
        } else {
          C10_CUDA_CHECK(launch_dependent(
              rms_norm_forward_kernel<in_t, scalar_t, in_t, VEC, kRows>, L.grid, L.block, L.smem,
              stream, x.data_ptr<in_t>(), x.stride(0), d, d_rs, optional_mut<in_t>(sum),
              optional_ptr<in_t>(weight), y.data_ptr<scalar_t>(), rstd.data_ptr<float>(), rows,
              C, int(group), float(eps), ShiftSource<in_t>{}));
        }
      });
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

namespace {
// Ones (rows of t,) float32 on t's device, made once per device and length and kept for the
// process (never freed: the cache outlives the CUDA context at exit).
const at::Tensor& ones_like_rows(const at::Tensor& t) {
  static auto* cache = new std::map<std::pair<int, int64_t>, at::Tensor>();
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  auto& ones = (*cache)[{t.get_device(), t.size(0)}];
  if (!ones.defined()) ones = at::ones({t.size(0)}, t.options().dtype(at::kFloat));
  return ones;
}

// A norm weight's gradient made by walking blocks (rms_norm_backward_kernel,
// shift_norm_backward_kernel): fit() takes a launch down to as many blocks as the device holds at
// once, each walking many rows and writing its sums as one row of `partial` (with shared memory
// for its block rows' sums), and returns that buffer; finish() adds its rows up in order.
struct WeightGradPartials {
  at::Tensor partial;

  template <typename Kernel>
  float* fit(Kernel kernel, RowLaunch& L, int C, const at::TensorOptions& options) {
    L.smem = std::max<size_t>(L.smem, size_t(L.block.y) * C * sizeof(float));
    L.grid.x = unsigned(std::min<int64_t>(L.grid.x, resident_blocks(kernel, L.block, L.smem)));
    partial = at::empty({int64_t(L.grid.x), C}, options.dtype(at::kFloat));
    return partial.data_ptr<float>();
  }
  // partial^T ones: cuBLAS's matrix-vector product takes ~4 us for 1056 x 768 on an H100, ATen's
  // column sum ~9 (both in a fixed order).
  void finish(const at::Tensor& dweight) const {
    if (partial.defined())
      at::mv_out(const_cast<at::Tensor&>(dweight), partial.t(), ones_like_rows(partial));
  }
};
}  // namespace

void rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& rstd, int64_t group, const at::Tensor& dx,
                       const at::Tensor& dweight, const at::Tensor& dsum,
                       const at::Tensor& dx_cast) {
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0);
  const int C = int(x.size(1));
  auto stream = at::cuda::getCurrentCUDAStream();
  if (rows == 0) {
    if (dweight.defined()) dweight.zero_();
    return;
  }
  TORCH_CHECK(!dsum.defined() || dsum.scalar_type() == x.scalar_type(),
              "rms_norm_backward: dsum must have x's dtype");
  TORCH_CHECK(!dx_cast.defined() || dx_cast.scalar_type() == x.scalar_type() ||
                  (x.scalar_type() == at::kFloat && dx_cast.scalar_type() == dy.scalar_type()),
              "rms_norm_backward: dx_cast must have x's dtype, or dy's when x is float32");
  const int vec = checked_width(C, group, {x, dy, dx, dsum, dx_cast});
  const int64_t ds_rs = dsum.defined() ? dsum.stride(0) : 0;
  WeightGradPartials dw;
  auto launch = [&](auto kernel, auto* dy_p, auto* x_p, auto* dx_p, auto* dsum_p, auto* cast_p) {
    using in_t = std::remove_const_t<std::remove_pointer_t<decltype(x_p)>>;
    auto L = row_launch(rows, C, vec, kNormBackwardRows<in_t>);  // the kernel's rows a step
    // With the weight's gradient: walking blocks, at most one a block row (the walk's sum order
    // does not depend on the rows a step); without, a block takes one step.
    if (dweight.defined()) L.grid.x = unsigned(blocks_for(rows, int(L.block.y)));
    float* dw_partial = dweight.defined() ? dw.fit(kernel, L, C, x.options()) : nullptr;
    kernel<<<L.grid, L.block, L.smem, stream>>>(
        dy_p, dy.stride(0), x_p, x.stride(0), optional_float(weight), rstd.data_ptr<float>(), dx_p,
        dx.stride(0), rows, C, int(group), dsum_p, ds_rs, cast_p, dw_partial);
  };
  if (dx_cast.defined() && dx_cast.scalar_type() != x.scalar_type()) {
    // float32 x; dy and dx_cast in one half-precision dtype (see the check above)
    FOX_HALF_TYPES(dy.scalar_type(), "rms_norm_backward", [&] {
      FOX_VEC_SWITCH(vec, [&] {
        launch(rms_norm_backward_kernel<float, scalar_t, VEC, scalar_t>,
               dy.data_ptr<scalar_t>(), x.data_ptr<float>(), dx.data_ptr<float>(),
               optional_ptr<float>(dsum), dx_cast.data_ptr<scalar_t>());
      });
    });
  } else {
    FOX_FLOAT_TYPES(x.scalar_type(), "rms_norm_backward", [&] {
      using in_t = scalar_t;
      FOX_FLOAT_TYPES(dy.scalar_type(), "rms_norm_backward", [&] {
        FOX_VEC_SWITCH(vec, [&] {
          launch(rms_norm_backward_kernel<in_t, scalar_t, VEC>, dy.data_ptr<scalar_t>(),
                 x.data_ptr<in_t>(), dx.data_ptr<in_t>(), optional_ptr<in_t>(dsum),
                 optional_mut<in_t>(dx_cast));
        });
      });
    });
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  dw.finish(dweight);
}

void shift_mix_forward(const at::Tensor& cur, const at::Tensor& logits, const at::Tensor& first,
                       const at::Tensor& out, const at::Tensor& last) {
  c10::cuda::CUDAGuard guard(cur.device());
  const int64_t B = cur.size(0), T = cur.size(1);
  const int C = int(cur.size(2)), D = C / int(logits.size(2));
  if (B * T == 0) return;
  TORCH_CHECK(!last.defined() || T == 1 || !first.defined() ||
                  last.data_ptr() != first.data_ptr(),
              "shift_mix_forward: last may be first only for one new token");
  const int vec = checked_width(C, D, {cur, first, out, last});
  const auto L = row_launch(B * T, C, vec);
  auto stream = at::cuda::getCurrentCUDAStream();
  FOX_FLOAT_TYPES(cur.scalar_type(), "shift_mix_forward", [&] {
    FOX_VEC_SWITCH(vec, [&] {
      C10_CUDA_CHECK(launch_dependent(
          shift_mix_forward_kernel<scalar_t, VEC>, L.grid, L.block, L.smem, stream,
          cur.data_ptr<scalar_t>(), cur.stride(0), cur.stride(1), logits.data_ptr<scalar_t>(),
          logits.stride(0), logits.stride(1), optional_ptr<scalar_t>(first),
          out.data_ptr<scalar_t>(), optional_mut<scalar_t>(last), B, T, C, D));
    });
  });
}

void shift_mix_backward(const at::Tensor& dout, const at::Tensor& cur, const at::Tensor& logits,
                        const at::Tensor& first, const at::Tensor& dcur,
                        const at::Tensor& dlogits, const at::Tensor& dfirst) {
  c10::cuda::CUDAGuard guard(cur.device());
  const int64_t B = cur.size(0), T = cur.size(1);
  const int C = int(cur.size(2)), D = C / int(logits.size(2));
  if (B * T == 0) return;
  const int vec = checked_width(C, D, {dout, cur, first, dcur, dfirst});
  const auto L = row_launch(B * T, C, vec);
  auto stream = at::cuda::getCurrentCUDAStream();
  FOX_FLOAT_TYPES(cur.scalar_type(), "shift_mix_backward", [&] {
    FOX_VEC_SWITCH(vec, [&] {
      shift_mix_backward_kernel<scalar_t, VEC><<<L.grid, L.block, L.smem, stream>>>(
          dout.data_ptr<scalar_t>(), cur.data_ptr<scalar_t>(), cur.stride(0), cur.stride(1),
          logits.data_ptr<scalar_t>(), logits.stride(0), logits.stride(1),
          optional_ptr<scalar_t>(first), dcur.data_ptr<scalar_t>(), dcur.stride(0),
          dcur.stride(1), dlogits.data_ptr<scalar_t>(), dlogits.stride(0), dlogits.stride(1),
          optional_mut<scalar_t>(dfirst), B, T, C, D);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void shift_norm_forward(const at::Tensor& cur, const at::Tensor& logits, int64_t seq_len,
                        const at::Tensor& weight, int64_t group, double eps, const at::Tensor& y,
                        const at::Tensor& rstd) {
  c10::cuda::CUDAGuard guard(cur.device());
  const int64_t rows = cur.size(0);
  const int C = int(cur.size(1));
  if (rows == 0) return;
  TORCH_CHECK(rows % seq_len == 0 && C % logits.size(1) == 0 && logits.size(0) == rows,
              "shift_norm_forward: cur (", cur.sizes(), ") and logits (", logits.sizes(),
              ") must be rows of whole sequences of ", seq_len);
  TORCH_CHECK(rows <= kShiftNormMaxRows, "shift_norm_forward: at most ", kShiftNormMaxRows,
              " rows, got ", rows);
  const int D = C / int(logits.size(1));
  const int vec = checked_width(C, std::gcd(int(group), D), {cur, y});
  TORCH_CHECK(!weight.defined() || weight.scalar_type() == at::kFloat ||
                  weight.scalar_type() == cur.scalar_type(),
              "shift_norm_forward: weight must be float32 or cur's dtype");
  // Four rows a thread, as the per-head norms (H200, 16384 rows of 768 bf16: 20-22 us a call with
  // their loads in flight together, 28 one row at a time; the two kernels it replaces took ~39).
  constexpr int kRows = 4;
  const auto L = row_launch(rows, C, vec, kRows);
  auto stream = at::cuda::getCurrentCUDAStream();
  FOX_FLOAT_TYPES(cur.scalar_type(), "shift_norm_forward", [&] {
    const ShiftSource<scalar_t> shift{logits.data_ptr<scalar_t>(), logits.stride(0),
                                      uint32_t(seq_len), D};
    FOX_VEC_SWITCH(vec, [&] {
      auto launch = [&](auto kernel, const auto* w) {
        C10_CUDA_CHECK(launch_dependent(kernel, L.grid, L.block, L.smem, stream,
                                        cur.data_ptr<scalar_t>(), cur.stride(0),
                                        static_cast<const scalar_t*>(nullptr), int64_t(0),
                                        static_cast<scalar_t*>(nullptr), w,
                                        y.data_ptr<scalar_t>(), rstd.data_ptr<float>(), rows, C,
                                        int(group), float(eps), shift));
      };
      if (!weight.defined() || weight.scalar_type() == at::kFloat) {
        launch(rms_norm_forward_kernel<scalar_t, scalar_t, float, VEC, kRows, scalar_t, true>,
               optional_float(weight));
      } else {
        launch(rms_norm_forward_kernel<scalar_t, scalar_t, scalar_t, VEC, kRows, scalar_t, true>,
               optional_ptr<scalar_t>(weight));
      }
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void shift_norm_backward(const at::Tensor& dy, const at::Tensor& cur, const at::Tensor& logits,
                         int64_t seq_len, const at::Tensor& weight, const at::Tensor& rstd,
                         int64_t group, const at::Tensor& dcur, const at::Tensor& dlogits,
                         const at::Tensor& dweight) {
  c10::cuda::CUDAGuard guard(cur.device());
  const int64_t rows = cur.size(0);
  const int C = int(cur.size(1));
  if (rows == 0) {
    if (dweight.defined()) dweight.zero_();
    return;
  }
  TORCH_CHECK(rows % seq_len == 0 && C % logits.size(1) == 0 && logits.size(0) == rows,
              "shift_norm_backward: cur (", cur.sizes(), ") and logits (", logits.sizes(),
              ") must be rows of whole sequences of ", seq_len);
  TORCH_CHECK(rows <= kShiftNormMaxRows, "shift_norm_backward: at most ", kShiftNormMaxRows,
              " rows, got ", rows);
  TORCH_CHECK(!weight.defined() || weight.scalar_type() == at::kFloat,
              "shift_norm_backward: weight must be float32");
  const int D = C / int(logits.size(1));
  const int vec = checked_width(C, std::gcd(int(group), D), {dy, cur, dcur});
  auto stream = at::cuda::getCurrentCUDAStream();
  WeightGradPartials dw;
  FOX_FLOAT_TYPES(cur.scalar_type(), "shift_norm_backward", [&] {
    const ShiftSource<scalar_t> shift{logits.data_ptr<scalar_t>(), logits.stride(0),
                                      uint32_t(seq_len), D};
    FOX_VEC_SWITCH(vec, [&] {
      auto kernel = shift_norm_backward_kernel<scalar_t, VEC>;
      auto L = row_launch(rows, C, vec);
      float* dw_partial = dweight.defined() ? dw.fit(kernel, L, C, cur.options()) : nullptr;
      kernel<<<L.grid, L.block, L.smem, stream>>>(
          dy.data_ptr<scalar_t>(), dy.stride(0), cur.data_ptr<scalar_t>(), cur.stride(0), shift,
          optional_float(weight), rstd.data_ptr<float>(), dcur.data_ptr<scalar_t>(),
          dcur.stride(0), dlogits.data_ptr<scalar_t>(), dlogits.stride(0), rows, C, int(group),
          dw_partial);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  dw.finish(dweight);
}

void gated_forward(const at::Tensor& g, const at::Tensor& u, bool silu, const at::Tensor& y) {
  c10::cuda::CUDAGuard guard(g.device());
  const int64_t rows = g.size(0);
  const int C = int(g.size(1));
  if (rows == 0) return;
  const int vec = checked_width(C, C, {g, u, y});
  const auto L = row_launch(rows, C, vec);
  auto stream = at::cuda::getCurrentCUDAStream();
  FOX_FLOAT_TYPES(g.scalar_type(), "gated_forward", [&] {
    FOX_VEC_SWITCH(vec, [&] {
      C10_CUDA_CHECK(launch_dependent(gated_forward_kernel<scalar_t, VEC>, L.grid, L.block, 0,
                                      stream, g.data_ptr<scalar_t>(), g.stride(0),
                                      u.data_ptr<scalar_t>(), u.stride(0),
                                      y.data_ptr<scalar_t>(), rows, C, silu));
    });
  });
}

void gated_backward(const at::Tensor& dy, const at::Tensor& g, const at::Tensor& u, bool silu,
                    const at::Tensor& dg, const at::Tensor& du, const at::Tensor& y) {
  c10::cuda::CUDAGuard guard(g.device());
  const int64_t rows = g.size(0);
  const int C = int(g.size(1));
  if (rows == 0) return;
  const int vec = checked_width(C, C, {dy, g, u, dg, du, y});
  const auto L = row_launch(rows, C, vec);
  auto stream = at::cuda::getCurrentCUDAStream();
  FOX_FLOAT_TYPES(g.scalar_type(), "gated_backward", [&] {
    FOX_VEC_SWITCH(vec, [&] {
      gated_backward_kernel<scalar_t, VEC><<<L.grid, L.block, 0, stream>>>(
          dy.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(), g.stride(0), u.data_ptr<scalar_t>(),
          u.stride(0), dg.data_ptr<scalar_t>(), dg.stride(0), du.data_ptr<scalar_t>(),
          du.stride(0), rows, C, silu, optional_mut<scalar_t>(y));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void copy_rows(const at::Tensor& src, const at::Tensor& dst) {
  c10::cuda::CUDAGuard guard(src.device());
  TORCH_CHECK(src.scalar_type() == dst.scalar_type() && src.sizes() == dst.sizes(),
              "copy_rows: src and dst must have one dtype and shape");
  const int64_t rows = src.size(0);
  const int C = int(src.size(1));
  if (rows == 0) return;
  const int vec = checked_width(C, C, {src, dst});
  const auto L = row_launch(rows, C, vec);
  auto stream = at::cuda::getCurrentCUDAStream();
  FOX_FLOAT_TYPES(src.scalar_type(), "copy_rows", [&] {
    FOX_VEC_SWITCH(vec, [&] {
      copy_rows_kernel<scalar_t, VEC><<<L.grid, L.block, 0, stream>>>(
          src.data_ptr<scalar_t>(), src.stride(0), dst.data_ptr<scalar_t>(), dst.stride(0), rows);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void cross_entropy_forward(const at::Tensor& logits, const at::Tensor& labels,
                           int64_t ignore_index, const at::Tensor& loss, const at::Tensor& lse) {
  c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0), V = logits.size(1);
  if (rows == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  const int vec = loss_vector_width({logits});
  FOX_FLOAT_TYPES(logits.scalar_type(), "cross_entropy_forward", [&] {
    FOX_VEC_SWITCH(vec, [&] {
      cross_entropy_forward_kernel<scalar_t, VEC><<<unsigned(rows), kLossThreads, 0, stream>>>(
          logits.data_ptr<scalar_t>(), logits.stride(0), labels.data_ptr<int64_t>(),
          loss.data_ptr<float>(), lse.data_ptr<float>(), V, ignore_index);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void cross_entropy_backward(const at::Tensor& dloss, const at::Tensor& logits,
                            const at::Tensor& labels, const at::Tensor& lse, int64_t ignore_index,
                            const at::Tensor& dlogits) {
  c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0), V = logits.size(1);
  if (rows == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  const int vec = loss_vector_width({logits, dlogits});
  FOX_FLOAT_TYPES(logits.scalar_type(), "cross_entropy_backward", [&] {
    FOX_VEC_SWITCH(vec, [&] {
      cross_entropy_backward_kernel<scalar_t, VEC><<<unsigned(rows), kLossThreads, 0, stream>>>(
          dloss.data_ptr<float>(), logits.data_ptr<scalar_t>(), logits.stride(0),
          labels.data_ptr<int64_t>(), lse.data_ptr<float>(), dlogits.data_ptr<scalar_t>(),
          dlogits.stride(0), V, ignore_index);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void argmax(const at::Tensor& x, const at::Tensor& out) {
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), V = x.size(1);
  if (rows == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  FOX_FLOAT_TYPES(x.scalar_type(), "argmax", [&] {
    C10_CUDA_CHECK(launch_dependent(argmax_kernel<scalar_t>, dim3(unsigned(rows)),
                                    dim3(kArgmaxThreads), 0, stream, x.data_ptr<scalar_t>(),
                                    x.stride(0), out.data_ptr<int64_t>(), V));
  });
}

void cache_write(const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& g_new,
                 bool gate_logits, const at::Tensor& positions, const at::Tensor& k,
                 const at::Tensor& v, const at::Tensor& g) {
  c10::cuda::CUDAGuard guard(k.device());
  const int64_t B = k_new.size(0), T = k_new.size(1);
  if (B * T == 0) return;
  const int C = int(k_new.size(2)), H = int(g_new.size(2));
  TORCH_CHECK(g_new.scalar_type() == at::kFloat || g_new.scalar_type() == k.scalar_type(),
              "cache_write: the new gates must be float32 or of the cache's dtype");
  TORCH_CHECK(g.scalar_type() == at::kFloat || g.scalar_type() == at::kHalf,
              "cache_write: the cache's gates must be float32 or float16");
  const int threads = std::min(256, std::max(32, ((std::max(C, H) + 31) / 32) * 32));
  auto stream = at::cuda::getCurrentCUDAStream();
  FOX_FLOAT_TYPES(k.scalar_type(), "cache_write", [&] {
    auto run = [&](auto gate, auto gate_out) {
      using G = decltype(gate);
      using GO = decltype(gate_out);
      C10_CUDA_CHECK(launch_dependent(
          cache_write_kernel<scalar_t, G, GO>, dim3(unsigned(B * T)), dim3(threads), 0, stream,
          k_new.data_ptr<scalar_t>(), k_new.stride(0), k_new.stride(1),
          v_new.data_ptr<scalar_t>(), v_new.stride(0), v_new.stride(1), g_new.data_ptr<G>(),
          g_new.stride(0), g_new.stride(1), gate_logits, positions.data_ptr<int64_t>(),
          k.data_ptr<scalar_t>(), k.stride(0), k.stride(1), v.data_ptr<scalar_t>(), v.stride(0),
          v.stride(1), g.data_ptr<GO>(), g.stride(0), g.stride(1), int(T), C, H));
    };
    // A float16 gate cache: half the gate bytes a decoding step reads (log f rounded to 11 bits).
    auto with_gate_out = [&](auto gate) {
      if (g.scalar_type() == at::kHalf) run(gate, at::Half());
      else run(gate, float());
    };
    if (g_new.scalar_type() == at::kFloat) {
      with_gate_out(float());
    } else {
      with_gate_out(scalar_t());
    }
  });
}

constexpr int kForgetGateThreads = 256;

// Launches a forget gate kernel over the logits' n elements, if any: launch(T(), BT(), blocks,
// stream), T the logits' element type, BT the bias's as the kernels read it (float32, or T, also
// for no bias).
template <typename F>
void launch_forget_gate(const at::Tensor& logits, const at::Tensor& bias, F launch) {
  c10::cuda::CUDAGuard guard(logits.device());
  const int64_t n = logits.numel();
  if (n == 0) return;
  const unsigned blocks = unsigned(blocks_for(n, kForgetGateThreads));
  auto stream = at::cuda::getCurrentCUDAStream();
  FOX_FLOAT_TYPES(logits.scalar_type(), "forget_gate", [&] {
    if (bias.defined() && bias.scalar_type() == at::kFloat) launch(scalar_t(), float(), blocks, stream);
    else launch(scalar_t(), scalar_t(), blocks, stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void forget_gate_forward(const at::Tensor& logits, const at::Tensor& bias, const at::Tensor& out) {
  launch_forget_gate(logits, bias, [&](auto t, auto bt, unsigned blocks, cudaStream_t stream) {
    using T = decltype(t);
    using BT = decltype(bt);
    forget_gate_forward_kernel<T, BT><<<blocks, kForgetGateThreads, 0, stream>>>(
        logits.data_ptr<T>(), logits.stride(0), logits.stride(1), optional_ptr<BT>(bias),
        out.data_ptr<float>(), logits.numel(), int(logits.size(1)), int(logits.size(2)));
  });
}

void forget_gate_backward(const at::Tensor& dout, const at::Tensor& logits, const at::Tensor& bias,
                          const at::Tensor& dlogits) {
  launch_forget_gate(logits, bias, [&](auto t, auto bt, unsigned blocks, cudaStream_t stream) {
    using T = decltype(t);
    using BT = decltype(bt);
    forget_gate_backward_kernel<T, BT><<<blocks, kForgetGateThreads, 0, stream>>>(
        dout.data_ptr<float>(), logits.data_ptr<T>(), logits.stride(0), logits.stride(1),
        optional_ptr<BT>(bias), dlogits.data_ptr<T>(), logits.numel(), int(logits.size(1)),
        int(logits.size(2)));
  });
}

}  // namespace fox::nn::cuda
