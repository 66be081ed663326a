// Turns runtime dtypes and head dims into template parameters (after FlashAttention's
// static_switch.h). Used by api.cu only; the kernels themselves are instantiated in
// instantiations/*.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fox::cuda {

// Element types the CUDA kernels read and write (api.cu maps ATen dtypes onto it).
enum class ElementType { kHalf, kBFloat16, kFloat };

}  // namespace fox::cuda

// FOX_ELEMENT_SWITCH(type, T, ...): runs the body with `using T = __half / __nv_bfloat16 / float`.
#define FOX_ELEMENT_SWITCH(TYPE, T, ...)                       \
  [&] {                                                        \
    switch (TYPE) {                                            \
      case ::fox::cuda::ElementType::kHalf: {                  \
        using T = __half;                                      \
        return __VA_ARGS__();                                  \
      }                                                        \
      case ::fox::cuda::ElementType::kBFloat16: {              \
        using T = __nv_bfloat16;                               \
        return __VA_ARGS__();                                  \
      }                                                        \
      default: {                                               \
        using T = float;                                       \
        return __VA_ARGS__();                                  \
      }                                                        \
    }                                                          \
  }()

// FOX_FAST_HEAD_DIM_SWITCH(head_dim, kHeadDim, ...): head dims that have a tensor-core kernel
// (callers check fast_head_dim() first).
#define FOX_FAST_HEAD_DIM_SWITCH(HEAD_DIM, K_HEAD_DIM, ...) \
  [&] {                                                     \
    if ((HEAD_DIM) == 64) {                                 \
      constexpr int K_HEAD_DIM = 64;                        \
      return __VA_ARGS__();                                 \
    } else {                                                \
      constexpr int K_HEAD_DIM = 128;                       \
      return __VA_ARGS__();                                 \
    }                                                       \
  }()

namespace fox::cuda {
inline bool fast_head_dim(long long head_dim) { return head_dim == 64 || head_dim == 128; }
}  // namespace fox::cuda
