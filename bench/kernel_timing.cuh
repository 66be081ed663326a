// Helpers of the standalone kernel timing programs of bench/ (decode_kernel_timing.cu,
// attention_kernel_timing.cu).
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

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

// The options of the prefill timing programs (attention_kernel_timing.cu, attention_kernel_ab.cu):
// [--reps N] [--d 64|128] [--heads H] [--fused | --nondeterministic] [N ...].
struct AttentionTimingOptions {
  int reps = 20, only_d = 0, heads = 0;
  bool fused = false, in_turns = false;
  std::vector<int> lengths;
};
// False, after printing the usage, on an argument it does not know.
inline bool parse_attention_timing_options(int argc, char** argv, AttentionTimingOptions& o) {
  for (int i = 1; i < argc; ++i) {
    const int n = std::atoi(argv[i]);
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) {
      o.reps = std::max(2, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--heads") && i + 1 < argc) {
      o.heads = std::max(1, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--d") && i + 1 < argc) {
      o.only_d = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--nondeterministic")) {
      o.fused = true;
    } else if (!std::strcmp(argv[i], "--fused")) {
      o.fused = o.in_turns = true;
    } else if (n >= 128 && n <= 16384 && 16384 % n == 0) {
      o.lengths.push_back(n);
    } else {
      std::fprintf(stderr,
                   "usage: %s [--reps N] [--d 64|128] [--heads H] [--fused | --nondeterministic] [N ...] "
                   "(N divides 16384)\n",
                   argv[0]);
      return false;
    }
  }
  return true;
}

// Whether the current device is an sm_90 GPU (the Hopper kernels'), with a message if not.
inline bool hopper_device() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) == cudaSuccess &&
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major == 9)
    return true;
  std::fprintf(stderr, "the Hopper kernels need an sm_90 GPU\n");
  return false;
}

}  // namespace fox::bench
