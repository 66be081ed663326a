// Helpers of the standalone kernel timing programs of bench/ (decode_kernel_timing.cu,
// attention_kernel_timing.cu).
#pragma once

#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

namespace fox::bench {

inline void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  std::exit(1);
}

// Deterministic pseudo-random values in [0, 1) (a hash of the index): the same inputs in every
// build.
__device__ __forceinline__ float hashed_unit(size_t i, unsigned seed) {
  unsigned h = static_cast<unsigned>(i) * 2654435761u ^ seed;
  h ^= h >> 13;
  h *= 0x5bd1e995u;
  h ^= h >> 15;
  return (h & 0xffff) / 65536.f;
}

}  // namespace fox::bench
