// Row-wise elementwise steps of the CPU kernels, written as plain loops that the compiler
// vectorizes (reductions through `omp simd`, enabled by -fopenmp-simd, since strict IEEE order
// would keep a float sum scalar). No std::min/std::max in the cloned functions: GCC 12 left the
// AVX-512 clone of a std::max reduction scalar (ternaries vectorize; check with objdump). float versions are cloned for AVX-512, AVX2 and baseline x86-64 and picked at load
// time (GCC/Clang function multiversioning), so the library runs on any x86-64 CPU. float64 (the
// gradcheck path) uses std::exp.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__NVCC__)
#define FOX_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FOX_CPU_CLONES
#endif

namespace fox::cpu {
namespace {

// exp(x) for x <= 0 (and tiny positive x) to about 1 ulp, branch-free so loops vectorize:
// 2^n * e^r with n = round(x / ln 2), |r| <= ln(2)/2, e^r by its degree-7 Taylor polynomial.
// Only the lower end is clamped (no caller passes x > 1): 27 instead of 36 AVX-512 instructions.
inline float fast_exp(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  // round to nearest by adding and removing 1.5 * 2^23 (vectorizes where floor may not)
  constexpr float kRound = 12582912.0f;
  const float n = (xc * 1.44269504088896341f + kRound) - kRound;
  const float r = xc - n * 0.693145751953125f - n * 1.42860682030941723e-06f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const float scale = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return x < -87.0f ? 0.f : p * scale;
}

// The gate sums (bias_q, bias_k) are float64: d = bias_q - bias_k[c] is a difference of two sums
// over up to a tile of strongly forgetting gates, which float32 would not resolve.

// s[c] = s[c] * scale + bias_q - bias_k[c]; returns max_c s[c]. (The softmax scale is applied
// here, not by the GEMM: the bf16 micro-kernel has no alpha.)
FOX_CPU_CLONES float add_bias_and_max(float* __restrict s, const double* __restrict bias_k,
                                      double bias_q, float scale, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t c = 0; c < n; ++c) {
    const float x = s[c] * scale + static_cast<float>(bias_q - bias_k[c]);
    s[c] = x;
    m = x > m ? x : m;
  }
  return m;
}

// s[c] = exp(s[c] - m); returns sum_c s[c].
FOX_CPU_CLONES float exp_and_sum(float* __restrict s, float m, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < n; ++c) {
    s[c] = fast_exp(s[c] - m);
    sum += s[c];
  }
  return sum;
}

// p[c] = exp(p[c] * scale + bias_q - bias_k[c] - lse); dp[c] = p[c] * (dp[c] - delta)
FOX_CPU_CLONES void probs_and_dscores(float* __restrict p, float* __restrict dp,
                                      const double* __restrict bias_k, double bias_q, float scale,
                                      float lse, float delta, int64_t n) {
  for (int64_t c = 0; c < n; ++c) {
    const float prob = fast_exp(p[c] * scale + static_cast<float>(bias_q - bias_k[c]) - lse);
    p[c] = prob;
    dp[c] = prob * (dp[c] - delta);
  }
}

// float -> bfloat16 bits, round to nearest even (finite inputs), in integer arithmetic so the
// loops below vectorize.
inline uint16_t bf16_bits(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// y[c] = bf16(x[c])
FOX_CPU_CLONES void to_bf16(const float* __restrict x, uint16_t* __restrict y, int64_t n) {
  for (int64_t c = 0; c < n; ++c) y[c] = bf16_bits(x[c]);
}

// Two rows into one VNNI row pair: y[2c] = bf16(x0[c]), y[2c + 1] = bf16(x1[c]).
FOX_CPU_CLONES void interleave_bf16(const float* __restrict x0, const float* __restrict x1,
                                    uint16_t* __restrict y, int64_t n) {
  for (int64_t c = 0; c < n; ++c) {
    y[2 * c] = bf16_bits(x0[c]);
    y[2 * c + 1] = bf16_bits(x1[c]);
  }
}

// x as the sum of two bf16 numbers (about 16 significant bits): y[2c] = hi, y[2c + 1] = lo.
FOX_CPU_CLONES void split_bf16(const float* __restrict x, uint16_t* __restrict y, int64_t n) {
  for (int64_t c = 0; c < n; ++c) {
    const uint16_t hi = bf16_bits(x[c]);
    y[2 * c] = hi;
    y[2 * c + 1] = bf16_bits(x[c] - std::bit_cast<float>(static_cast<uint32_t>(hi) << 16));
  }
}

FOX_CPU_CLONES void scale_row(float* __restrict x, float factor, int64_t n) {
  for (int64_t c = 0; c < n; ++c) x[c] *= factor;
}

FOX_CPU_CLONES void add_row(float* __restrict acc, const float* __restrict x, int64_t n) {
  for (int64_t c = 0; c < n; ++c) acc[c] += x[c];
}

FOX_CPU_CLONES float sum_row(const float* __restrict x, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < n; ++c) sum += x[c];
  return sum;
}

// float64 versions: exactness over speed.
inline double add_bias_and_max(double* s, const double* bias_k, double bias_q, double scale,
                               int64_t n) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t c = 0; c < n; ++c) {
    s[c] = s[c] * scale + bias_q - bias_k[c];
    m = std::max(m, s[c]);
  }
  return m;
}

inline double exp_and_sum(double* s, double m, int64_t n) {
  double sum = 0;
  for (int64_t c = 0; c < n; ++c) {
    s[c] = std::exp(s[c] - m);
    sum += s[c];
  }
  return sum;
}

inline void probs_and_dscores(double* p, double* dp, const double* bias_k, double bias_q,
                              double scale, double lse, double delta, int64_t n) {
  for (int64_t c = 0; c < n; ++c) {
    const double prob = std::exp(p[c] * scale + bias_q - bias_k[c] - lse);
    p[c] = prob;
    dp[c] = prob * (dp[c] - delta);
  }
}

inline void scale_row(double* x, double factor, int64_t n) {
  for (int64_t c = 0; c < n; ++c) x[c] *= factor;
}

inline void add_row(double* acc, const double* x, int64_t n) {
  for (int64_t c = 0; c < n; ++c) acc[c] += x[c];
}

inline double sum_row(const double* x, int64_t n) {
  double sum = 0;
  for (int64_t c = 0; c < n; ++c) sum += x[c];
  return sum;
}

}  // namespace
}  // namespace fox::cpu
