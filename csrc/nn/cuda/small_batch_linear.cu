// A warp per two output features: each lane reads 16 bytes of both weight rows per step, and up to
// four steps (1024 input features a row) are in flight before the first multiply, so a 768-wide
// row is three loads a lane issued back to back. x (a few rows, a few KB) is read through L1. The
// sums are float32 in a fixed order (lanes, then a butterfly over the warp): bitwise reproducible.
#include "small_batch_linear.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "../../ops/cuda/dependent_launch.cuh"

namespace fox::nn::cuda {
namespace {

constexpr int kWarps = 4;        // warps a block
constexpr int kOutPerWarp = 2;   // output features a warp
constexpr int kVec = 8;          // input features a lane reads at once (16 bytes of fp16/bf16)
constexpr int kSteps = 4;        // 32 * kVec-feature steps in flight a lane

template <typename T>
struct alignas(16) Pack8 {
  T v[kVec];
};

template <typename T, int R>
__global__ void __launch_bounds__(kWarps * 32)
    small_batch_linear_kernel(const T* __restrict__ x, int64_t x_rs, const T* __restrict__ w,
                              const T* __restrict__ bias, const T* residual, int64_t res_rs,
                              T* y, int64_t y_rs, int N, int K) {
  fox::cuda::wait_for_previous_kernel();  // x, and the weights too, may have just been written
  fox::cuda::allow_next_kernel();
  const int lane = threadIdx.x % 32;
  const int n0 = (blockIdx.x * kWarps + threadIdx.x / 32) * kOutPerWarp;
  if (n0 >= N) return;  // whole warps
  float acc[kOutPerWarp][R] = {};
  for (int k0 = lane * kVec; k0 < K; k0 += 32 * kVec * kSteps) {
    Pack8<T> wv[kOutPerWarp][kSteps];
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const int k = k0 + s * 32 * kVec;
#pragma unroll
      for (int o = 0; o < kOutPerWarp; ++o) {
        if (k < K && n0 + o < N) {
          wv[o][s] = *reinterpret_cast<const Pack8<T>*>(w + int64_t(n0 + o) * K + k);
        } else {
#pragma unroll
          for (int i = 0; i < kVec; ++i) wv[o][s].v[i] = T(0.f);
        }
      }
    }
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const int k = k0 + s * 32 * kVec;
      if (k >= K) break;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const Pack8<T> xv = *reinterpret_cast<const Pack8<T>*>(x + r * x_rs + k);
#pragma unroll
        for (int o = 0; o < kOutPerWarp; ++o) {
#pragma unroll
          for (int i = 0; i < kVec; ++i)
            acc[o][r] += static_cast<float>(wv[o][s].v[i]) * static_cast<float>(xv.v[i]);
        }
      }
    }
  }
#pragma unroll
  for (int o = 0; o < kOutPerWarp; ++o) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int m = 16; m > 0; m /= 2) acc[o][r] += __shfl_xor_sync(0xffffffffu, acc[o][r], m);
    }
  }
  // Lane o * R + r writes output (r, n0 + o): the stores of a warp go out at once.
#pragma unroll
  for (int o = 0; o < kOutPerWarp; ++o) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int n = n0 + o;
      if (lane != (o * R + r) % 32 || n >= N) continue;
      float v = acc[o][r];
      if (bias) v += static_cast<float>(bias[n]);
      if (residual) v += static_cast<float>(residual[r * res_rs + n]);
      y[r * y_rs + n] = static_cast<T>(v);
    }
  }
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

template <typename T, int R>
void launch(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
            const at::Tensor& residual, const at::Tensor& y, cudaStream_t stream) {
  const int N = int(w.size(0)), K = int(w.size(1));
  const int per_block = kWarps * kOutPerWarp;
  const dim3 grid(unsigned((N + per_block - 1) / per_block));
  const T* b = bias.defined() ? bias.data_ptr<T>() : nullptr;
  const T* res = residual.defined() ? residual.data_ptr<T>() : nullptr;
  const int64_t res_rs = residual.defined() ? residual.stride(0) : 0;
  C10_CUDA_CHECK(fox::cuda::launch_dependent(
      small_batch_linear_kernel<T, R>, grid, dim3(kWarps * 32), 0, stream, x.data_ptr<T>(),
      x.stride(0), w.data_ptr<T>(), b, res, res_rs, y.data_ptr<T>(), y.stride(0), N, K));
}

template <typename T>
void launch_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                 const at::Tensor& residual, const at::Tensor& y, cudaStream_t stream) {
  switch (x.size(0)) {
    case 1: return launch<T, 1>(x, w, bias, residual, y, stream);
    case 2: return launch<T, 2>(x, w, bias, residual, y, stream);
    case 3: return launch<T, 3>(x, w, bias, residual, y, stream);
    case 4: return launch<T, 4>(x, w, bias, residual, y, stream);
    case 5: return launch<T, 5>(x, w, bias, residual, y, stream);
    case 6: return launch<T, 6>(x, w, bias, residual, y, stream);
    case 7: return launch<T, 7>(x, w, bias, residual, y, stream);
    default: return launch<T, 8>(x, w, bias, residual, y, stream);
  }
}

}  // namespace

bool small_batch_linear_fits(const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& bias, const at::Tensor& residual) {
  const auto t = x.scalar_type();
  if (!x.is_cuda() || (t != at::kHalf && t != at::kBFloat16) || x.dim() != 2 ||
      weight.dim() != 2 || weight.scalar_type() != t || weight.device() != x.device())
    return false;
  const int64_t rows = x.size(0), N = weight.size(0), K = weight.size(1);
  if (rows < 1 || rows > kSmallBatchMaxRows || x.size(1) != K || K % kVec != 0 || N < 1 ||
      N > INT32_MAX || K > INT32_MAX)
    return false;
  if (x.stride(1) != 1 || x.stride(0) % kVec != 0 || !aligned16(x) || !weight.is_contiguous() ||
      !aligned16(weight))
    return false;
  if (bias.defined() && (bias.scalar_type() != t || bias.dim() != 1 || bias.size(0) != N ||
                         !bias.is_contiguous() || bias.device() != x.device()))
    return false;
  if (residual.defined() &&
      (residual.scalar_type() != t || residual.dim() != 2 || residual.size(0) != rows ||
       residual.size(1) != N || residual.stride(1) != 1 || residual.device() != x.device()))
    return false;
  return true;
}

void small_batch_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                        const at::Tensor& residual, const at::Tensor& y) {
  TORCH_CHECK(small_batch_linear_fits(x, weight, bias, residual),
              "small_batch_linear: tensors do not fit (the caller checks small_batch_linear_fits)");
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  if (x.scalar_type() == at::kHalf) {
    launch_rows<at::Half>(x, weight, bias, residual, y, stream);
  } else {
    launch_rows<at::BFloat16>(x, weight, bias, residual, y, stream);
  }
}

}  // namespace fox::nn::cuda
