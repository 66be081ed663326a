// Fused elementwise kernels of the model (see fused_kernels.h). All are memory-bound: each reads
// its inputs once (twice for the row reductions, the second time from L1/L2), computes in float32
// and writes its outputs once, instead of the 5-15 ATen kernels (and float32 round trips) each
// replaces. Reductions are in a fixed order: the results are bitwise reproducible.
#include "fused_kernels.h"

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace fox::nn::cuda {
namespace {

constexpr int kWarp = 32;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float sigmoidf(float x) { return 1.f / (1.f + __expf(-x)); }

int64_t blocks_for(int64_t n, int threads) { return (n + threads - 1) / threads; }

// ---- RMSNorm ------------------------------------------------------------------------------------
// One warp per row; the groups of a row one after another (a group of 64 is two elements a lane).

template <typename in_t, typename out_t>
__global__ void rms_norm_forward_kernel(const in_t* __restrict__ x, int64_t x_rs,
                                        const float* __restrict__ w, out_t* __restrict__ y,
                                        float* __restrict__ rstd, int64_t rows, int C, int G,
                                        float eps) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (row >= rows) return;
  const in_t* xr = x + row * x_rs;
  out_t* yr = y + row * C;
  const int groups = C / G;
  for (int g = 0; g < groups; ++g) {
    const int base = g * G;
    float ss = 0.f;
    for (int e = lane; e < G; e += kWarp) {
      const float v = static_cast<float>(xr[base + e]);
      ss += v * v;
    }
    const float r = rsqrtf(warp_sum(ss) / G + eps);
    if (lane == 0) rstd[row * groups + g] = r;
    for (int e = lane; e < G; e += kWarp) {
      float v = static_cast<float>(xr[base + e]) * r;
      if (w) v *= w[base + e];
      yr[base + e] = static_cast<out_t>(v);
    }
  }
}

// dx = r * (w dy - xhat * mean(w dy xhat)), xhat = x r.
template <typename in_t, typename grad_t>
__global__ void rms_norm_backward_kernel(const grad_t* __restrict__ dy, int64_t dy_rs,
                                         const in_t* __restrict__ x, int64_t x_rs,
                                         const float* __restrict__ w,
                                         const float* __restrict__ rstd, in_t* __restrict__ dx,
                                         int64_t rows, int C, int G) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (row >= rows) return;
  const grad_t* dyr = dy + row * dy_rs;
  const in_t* xr = x + row * x_rs;
  in_t* dxr = dx + row * C;
  const int groups = C / G;
  for (int g = 0; g < groups; ++g) {
    const int base = g * G;
    const float r = rstd[row * groups + g];
    float dot = 0.f;
    for (int e = lane; e < G; e += kWarp) {
      const float wdy = static_cast<float>(dyr[base + e]) * (w ? w[base + e] : 1.f);
      dot += wdy * static_cast<float>(xr[base + e]);
    }
    const float m = warp_sum(dot) * r / G;  // mean(w dy xhat)
    for (int e = lane; e < G; e += kWarp) {
      const float wdy = static_cast<float>(dyr[base + e]) * (w ? w[base + e] : 1.f);
      dxr[base + e] = static_cast<in_t>(r * (wdy - static_cast<float>(xr[base + e]) * r * m));
    }
  }
}

// dweight partial sums: thread per channel, block row per chunk of rows (coalesced over channels);
// the chunks are summed afterwards, in order.
template <typename in_t, typename grad_t>
__global__ void rms_norm_weight_grad_kernel(const grad_t* __restrict__ dy, int64_t dy_rs,
                                            const in_t* __restrict__ x, int64_t x_rs,
                                            const float* __restrict__ rstd,
                                            float* __restrict__ partial, int64_t rows,
                                            int64_t rows_per_chunk, int C, int G) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int groups = C / G, g = c / G;
  const int64_t begin = int64_t(blockIdx.y) * rows_per_chunk;
  const int64_t end = min(rows, begin + rows_per_chunk);
  float acc = 0.f;
  for (int64_t r = begin; r < end; ++r) {
    acc += static_cast<float>(dy[r * dy_rs + c]) * static_cast<float>(x[r * x_rs + c]) *
           rstd[r * groups + g];
  }
  partial[int64_t(blockIdx.y) * C + c] = acc;
}

// ---- KV-shift -------------------------------------------------------------------------------------

template <typename T>
__global__ void shift_mix_forward_kernel(const T* __restrict__ cur, int64_t cur_bs, int64_t cur_ts,
                                         const T* __restrict__ logits, int64_t lg_bs,
                                         int64_t lg_ts, const T* __restrict__ first,
                                         T* __restrict__ out, int64_t B, int64_t T_, int C,
                                         int D) {
  const int64_t n = B * T_ * C;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(i % C);
    const int64_t t = (i / C) % T_, b = i / (C * T_);
    const float a = sigmoidf(static_cast<float>(logits[b * lg_bs + t * lg_ts + c / D]));
    const float now = static_cast<float>(cur[b * cur_bs + t * cur_ts + c]);
    const float prev = t > 0 ? static_cast<float>(cur[b * cur_bs + (t - 1) * cur_ts + c])
                             : (first ? static_cast<float>(first[b * C + c]) : 0.f);
    out[i] = static_cast<T>(a * prev + (1.f - a) * now);
  }
}

// One warp per (b, t, head): dcur[t] = (1 - a_t) dout[t] + a_{t+1} dout[t+1];
// dlogit = a (1 - a) sum_d (prev - cur) dout; dfirst = a_0 dout[0].
template <typename T>
__global__ void shift_mix_backward_kernel(const T* __restrict__ dout, const T* __restrict__ cur,
                                          int64_t cur_bs, int64_t cur_ts,
                                          const T* __restrict__ logits, int64_t lg_bs,
                                          int64_t lg_ts, const T* __restrict__ first,
                                          T* __restrict__ dcur, T* __restrict__ dlogits,
                                          T* __restrict__ dfirst, int64_t B, int64_t T_, int H,
                                          int D) {
  const int lane = threadIdx.x % kWarp;
  const int64_t item = int64_t(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (item >= B * T_ * H) return;
  const int h = int(item % H);
  const int64_t t = (item / H) % T_, b = item / (H * T_);
  const int C = H * D;
  const float a = sigmoidf(static_cast<float>(logits[b * lg_bs + t * lg_ts + h]));
  const bool has_next = t + 1 < T_;
  const float a_next =
      has_next ? sigmoidf(static_cast<float>(logits[b * lg_bs + (t + 1) * lg_ts + h])) : 0.f;
  const int64_t row = (b * T_ + t) * C;
  float acc = 0.f;
  for (int d = lane; d < D; d += kWarp) {
    const int c = h * D + d;
    const float g = static_cast<float>(dout[row + c]);
    const float g_next = has_next ? static_cast<float>(dout[row + C + c]) : 0.f;
    dcur[row + c] = static_cast<T>((1.f - a) * g + a_next * g_next);
    const float now = static_cast<float>(cur[b * cur_bs + t * cur_ts + c]);
    const float prev = t > 0 ? static_cast<float>(cur[b * cur_bs + (t - 1) * cur_ts + c])
                             : (first ? static_cast<float>(first[b * C + c]) : 0.f);
    acc += (prev - now) * g;
    if (t == 0 && dfirst) dfirst[b * C + c] = static_cast<T>(a * g);
  }
  acc = warp_sum(acc);
  if (lane == 0) dlogits[(b * T_ + t) * H + h] = static_cast<T>(acc * a * (1.f - a));
}

// ---- gates: y = act(g) * u ------------------------------------------------------------------------

template <typename T>
__global__ void gated_forward_kernel(const T* __restrict__ g, int64_t g_rs,
                                     const T* __restrict__ u, int64_t u_rs, T* __restrict__ y,
                                     int64_t rows, int C, bool silu) {
  const int64_t n = rows * C;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / C;
    const int c = int(i % C);
    const float gv = static_cast<float>(g[r * g_rs + c]);
    const float s = sigmoidf(gv);
    y[i] = static_cast<T>((silu ? gv * s : s) * static_cast<float>(u[r * u_rs + c]));
  }
}

template <typename T>
__global__ void gated_backward_kernel(const T* __restrict__ dy, const T* __restrict__ g,
                                      int64_t g_rs, const T* __restrict__ u, int64_t u_rs,
                                      T* __restrict__ dg, T* __restrict__ du, int64_t rows,
                                      int C, bool silu) {
  const int64_t n = rows * C;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / C;
    const int c = int(i % C);
    const float gv = static_cast<float>(g[r * g_rs + c]);
    const float uv = static_cast<float>(u[r * u_rs + c]);
    const float d = static_cast<float>(dy[i]);
    const float s = sigmoidf(gv);
    const float act = silu ? gv * s : s;
    const float dact = silu ? s * (1.f + gv * (1.f - s)) : s * (1.f - s);
    dg[i] = static_cast<T>(d * uv * dact);
    du[i] = static_cast<T>(d * act);
  }
}

// ---- cross entropy ----------------------------------------------------------------------------------
// One block per row: an online (max, sum of exp) pass, then the label's logit.

constexpr int kLossThreads = 512;

__device__ __forceinline__ void merge_max_sum(float& m, float& s, float m2, float s2) {
  const float mm = fmaxf(m, m2);
  if (mm == -INFINITY) return;
  s = s * __expf(m - mm) + s2 * __expf(m2 - mm);
  m = mm;
}

template <typename T>
__global__ void __launch_bounds__(kLossThreads)
    cross_entropy_forward_kernel(const T* __restrict__ logits, int64_t rs,
                                 const int64_t* __restrict__ labels, float* __restrict__ loss,
                                 float* __restrict__ lse, int64_t V, int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * rs;
  float m = -INFINITY, s = 0.f;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const float xv = static_cast<float>(x[v]);
    if (xv > m) {
      s = s * __expf(m - xv) + 1.f;
      m = xv;
    } else {
      s += __expf(xv - m);
    }
  }
  for (int o = kWarp / 2; o > 0; o /= 2) {
    merge_max_sum(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
  }
  __shared__ float sm[kLossThreads / kWarp], ss[kLossThreads / kWarp];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float bm = sm[0], bs = ss[0];
    for (int i = 1; i < int(blockDim.x) / kWarp; ++i) merge_max_sum(bm, bs, sm[i], ss[i]);
    const float l = bm + logf(bs);
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

template <typename T>
__global__ void __launch_bounds__(kLossThreads)
    cross_entropy_backward_kernel(const float* __restrict__ dloss, const T* __restrict__ logits,
                                  int64_t rs, const int64_t* __restrict__ labels,
                                  const float* __restrict__ lse, T* __restrict__ dlogits,
                                  int64_t V, int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * rs;
  T* dx = dlogits + row * V;
  const int64_t label = labels[row];
  const bool ignored = label == ignore_index;
  const float g = ignored ? 0.f : dloss[row], l = lse[row];
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const float p = __expf(static_cast<float>(x[v]) - l);
    dx[v] = static_cast<T>((p - (v == label ? 1.f : 0.f)) * g);
  }
}

// ---- host side ------------------------------------------------------------------------------------

#define FOX_FLOAT_TYPES(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

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

constexpr int kRowThreads = 256;  // 8 rows (warps) per block
constexpr int kElementThreads = 256;

int elementwise_blocks(int64_t n) {
  const int64_t cap = int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 32;
  return int(std::max<int64_t>(1, std::min<int64_t>(blocks_for(n, kElementThreads), cap)));
}

}  // namespace

void rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, int64_t group, double eps,
                      const at::Tensor& y, const at::Tensor& rstd) {
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0);
  const int C = int(x.size(1));
  if (rows == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto grid = blocks_for(rows, kRowThreads / kWarp);
  FOX_FLOAT_TYPES(x.scalar_type(), "rms_norm_forward", [&] {
    using in_t = scalar_t;
    FOX_FLOAT_TYPES(y.scalar_type(), "rms_norm_forward", [&] {
      rms_norm_forward_kernel<in_t, scalar_t><<<grid, kRowThreads, 0, stream>>>(
          x.data_ptr<in_t>(), x.stride(0), optional_float(weight), y.data_ptr<scalar_t>(),
          rstd.data_ptr<float>(), rows, C, int(group), float(eps));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& rstd, int64_t group, const at::Tensor& dx,
                       const at::Tensor& dweight) {
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0);
  const int C = int(x.size(1));
  auto stream = at::cuda::getCurrentCUDAStream();
  if (rows == 0) {
    if (dweight.defined()) dweight.zero_();
    return;
  }
  FOX_FLOAT_TYPES(x.scalar_type(), "rms_norm_backward", [&] {
    using in_t = scalar_t;
    FOX_FLOAT_TYPES(dy.scalar_type(), "rms_norm_backward", [&] {
      rms_norm_backward_kernel<in_t, scalar_t>
          <<<blocks_for(rows, kRowThreads / kWarp), kRowThreads, 0, stream>>>(
              dy.data_ptr<scalar_t>(), dy.stride(0), x.data_ptr<in_t>(), x.stride(0),
              optional_float(weight), rstd.data_ptr<float>(), dx.data_ptr<in_t>(), rows, C,
              int(group));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (dweight.defined()) {
        const int64_t chunks = std::min<int64_t>(rows, 512);
        const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
        auto partial = at::empty({chunks, C}, x.options().dtype(at::kFloat));
        dim3 grid(unsigned(blocks_for(C, 128)), unsigned(chunks));
        rms_norm_weight_grad_kernel<in_t, scalar_t><<<grid, 128, 0, stream>>>(
            dy.data_ptr<scalar_t>(), dy.stride(0), x.data_ptr<in_t>(), x.stride(0),
            rstd.data_ptr<float>(), partial.data_ptr<float>(), rows, rows_per_chunk, C,
            int(group));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        at::sum_out(const_cast<at::Tensor&>(dweight), partial, {0});
      }
    });
  });
}

void shift_mix_forward(const at::Tensor& cur, const at::Tensor& logits, const at::Tensor& first,
                       const at::Tensor& out) {
  c10::cuda::CUDAGuard guard(cur.device());
  const int64_t B = cur.size(0), T = cur.size(1);
  const int C = int(cur.size(2)), H = int(logits.size(2));
  const int64_t n = B * T * C;
  if (n == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  FOX_FLOAT_TYPES(cur.scalar_type(), "shift_mix_forward", [&] {
    shift_mix_forward_kernel<scalar_t><<<elementwise_blocks(n), kElementThreads, 0, stream>>>(
        cur.data_ptr<scalar_t>(), cur.stride(0), cur.stride(1), logits.data_ptr<scalar_t>(),
        logits.stride(0), logits.stride(1), optional_ptr<scalar_t>(first),
        out.data_ptr<scalar_t>(), B, T, C, C / H);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void shift_mix_backward(const at::Tensor& dout, const at::Tensor& cur, const at::Tensor& logits,
                        const at::Tensor& first, const at::Tensor& dcur,
                        const at::Tensor& dlogits, const at::Tensor& dfirst) {
  c10::cuda::CUDAGuard guard(cur.device());
  const int64_t B = cur.size(0), T = cur.size(1);
  const int C = int(cur.size(2)), H = int(logits.size(2));
  const int64_t items = B * T * H;
  if (items == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  FOX_FLOAT_TYPES(cur.scalar_type(), "shift_mix_backward", [&] {
    shift_mix_backward_kernel<scalar_t>
        <<<blocks_for(items, kRowThreads / kWarp), kRowThreads, 0, stream>>>(
            dout.data_ptr<scalar_t>(), cur.data_ptr<scalar_t>(), cur.stride(0), cur.stride(1),
            logits.data_ptr<scalar_t>(), logits.stride(0), logits.stride(1),
            optional_ptr<scalar_t>(first), dcur.data_ptr<scalar_t>(),
            dlogits.data_ptr<scalar_t>(), optional_mut<scalar_t>(dfirst), B, T, H, C / H);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void gated_forward(const at::Tensor& g, const at::Tensor& u, bool silu, const at::Tensor& y) {
  c10::cuda::CUDAGuard guard(g.device());
  const int64_t rows = g.size(0);
  const int C = int(g.size(1));
  const int64_t n = rows * C;
  if (n == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  FOX_FLOAT_TYPES(g.scalar_type(), "gated_forward", [&] {
    gated_forward_kernel<scalar_t><<<elementwise_blocks(n), kElementThreads, 0, stream>>>(
        g.data_ptr<scalar_t>(), g.stride(0), u.data_ptr<scalar_t>(), u.stride(0),
        y.data_ptr<scalar_t>(), rows, C, silu);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void gated_backward(const at::Tensor& dy, const at::Tensor& g, const at::Tensor& u, bool silu,
                    const at::Tensor& dg, const at::Tensor& du) {
  c10::cuda::CUDAGuard guard(g.device());
  const int64_t rows = g.size(0);
  const int C = int(g.size(1));
  const int64_t n = rows * C;
  if (n == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  FOX_FLOAT_TYPES(g.scalar_type(), "gated_backward", [&] {
    gated_backward_kernel<scalar_t><<<elementwise_blocks(n), kElementThreads, 0, stream>>>(
        dy.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(), g.stride(0), u.data_ptr<scalar_t>(),
        u.stride(0), dg.data_ptr<scalar_t>(), du.data_ptr<scalar_t>(), rows, C, silu);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void cross_entropy_forward(const at::Tensor& logits, const at::Tensor& labels,
                           int64_t ignore_index, const at::Tensor& loss, const at::Tensor& lse) {
  c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0), V = logits.size(1);
  if (rows == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  FOX_FLOAT_TYPES(logits.scalar_type(), "cross_entropy_forward", [&] {
    cross_entropy_forward_kernel<scalar_t><<<unsigned(rows), kLossThreads, 0, stream>>>(
        logits.data_ptr<scalar_t>(), logits.stride(0), labels.data_ptr<int64_t>(),
        loss.data_ptr<float>(), lse.data_ptr<float>(), V, ignore_index);
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
  FOX_FLOAT_TYPES(logits.scalar_type(), "cross_entropy_backward", [&] {
    cross_entropy_backward_kernel<scalar_t><<<unsigned(rows), kLossThreads, 0, stream>>>(
        dloss.data_ptr<float>(), logits.data_ptr<scalar_t>(), logits.stride(0),
        labels.data_ptr<int64_t>(), lse.data_ptr<float>(), dlogits.data_ptr<scalar_t>(), V,
        ignore_index);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fox::nn::cuda
