// Row-major tile products on top of the Fortran BLAS that LibTorch links and exports (MKL or
// OpenBLAS: sgemm_/dgemm_). The kernels call these from inside an OpenMP team (parallel.h), where
// the BLAS runs single-threaded (nested OpenMP regions are off), so each task owns one core.
//
// bfloat16: ATen's oneDNN batch-reduce GEMM micro-kernel (the one its CPU flash attention uses)
// multiplies bf16 x bf16 into float32 with the CPU's bf16 dot-product instructions, about twice
// the float32 GEMM rate. It wants B in the "VNNI" layout: rows of B in pairs, each pair stored
// interleaved (B[2p][n], B[2p+1][n]) so one 32-bit load feeds a 2-term dot product.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/Context.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
            const float* beta, float* c, const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const double* alpha, const double* a, const int* lda, const double* b, const int* ldb,
            const double* beta, double* c, const int* ldc);
}

namespace fox::cpu {

// Column-major C (m x n) = alpha * op(A) * op(B) + beta * C.
inline void blas_gemm(char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha,
                      const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                      float* c, int64_t ldc) {
  const int m_ = static_cast<int>(m), n_ = static_cast<int>(n), k_ = static_cast<int>(k);
  const int lda_ = static_cast<int>(lda), ldb_ = static_cast<int>(ldb), ldc_ = static_cast<int>(ldc);
  sgemm_(&ta, &tb, &m_, &n_, &k_, &alpha, a, &lda_, b, &ldb_, &beta, c, &ldc_);
}

inline void blas_gemm(char ta, char tb, int64_t m, int64_t n, int64_t k, double alpha,
                      const double* a, int64_t lda, const double* b, int64_t ldb, double beta,
                      double* c, int64_t ldc) {
  const int m_ = static_cast<int>(m), n_ = static_cast<int>(n), k_ = static_cast<int>(k);
  const int lda_ = static_cast<int>(lda), ldb_ = static_cast<int>(ldb), ldc_ = static_cast<int>(ldc);
  dgemm_(&ta, &tb, &m_, &n_, &k_, &alpha, a, &lda_, b, &ldb_, &beta, c, &ldc_);
}

// A row-major matrix is the transpose of a column-major one with the same leading dimension,
// so each product below is computed as its transpose.

// C (rows x cols) = alpha * A (rows x inner) * B^T (B: cols x inner) + beta * C
template <typename T>
inline void gemm_abt(int64_t rows, int64_t cols, int64_t inner, T alpha, const T* a, int64_t lda,
                     const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  blas_gemm('T', 'N', cols, rows, inner, alpha, b, ldb, a, lda, beta, c, ldc);
}

// C (rows x cols) = alpha * A (rows x inner) * B (inner x cols) + beta * C
template <typename T>
inline void gemm_ab(int64_t rows, int64_t cols, int64_t inner, T alpha, const T* a, int64_t lda,
                    const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  blas_gemm('N', 'N', cols, rows, inner, alpha, b, ldb, a, lda, beta, c, ldc);
}

// C (rows x cols) = alpha * A^T (A: inner x rows) * B (inner x cols) + beta * C
template <typename T>
inline void gemm_atb(int64_t rows, int64_t cols, int64_t inner, T alpha, const T* a, int64_t lda,
                     const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  blas_gemm('N', 'T', cols, rows, inner, alpha, b, ldb, a, lda, beta, c, ldc);
}

// C (m x n, row-major, ldc) = A (m x k, row-major bf16, lda) * B (+ C if accumulate), with B in
// VNNI layout: k/2 row pairs of ldb interleaved pairs each. k must be even (callers zero-pad).
// oneDNN JIT-compiles and caches one kernel per shape and thread, so callers keep the shapes few.
inline void gemm_bf16_vnni(int64_t m, int64_t n, int64_t k, const c10::BFloat16* a, int64_t lda,
                           const c10::BFloat16* b, int64_t ldb, float* c, int64_t ldc,
                           bool accumulate) {
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, accumulate, a, b, c, /*is_vnni=*/true);
}

// Frees the micro-kernel's hardware state (AMX tile configuration) at the end of a thread's work.
inline void gemm_bf16_release() { at::native::cpublas::brgemm_release(/*is_vnni=*/true); }

// Whether gemm_bf16_vnni runs here: it needs oneDNN enabled and an AVX-512 CPU (it throws
// otherwise). A small product, checked against the exact answer, decides once per process.
inline bool bf16_gemm_available() {
  static const bool works = [] {
    try {
      constexpr int64_t m = 3, n = 17, k = 4;
      std::vector<c10::BFloat16> a(m * k), b(k * n);
      std::vector<float> c(m * n, -1.f);
      for (int64_t i = 0; i < m * k; ++i) a[i] = static_cast<float>(i % 5 - 2);
      for (int64_t i = 0; i < k * n; ++i) b[i] = static_cast<float>(i % 7 - 3);  // VNNI order
      gemm_bf16_vnni(m, n, k, a.data(), k, b.data(), n, c.data(), n, false);
      gemm_bf16_release();
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          float want = 0;
          for (int64_t l = 0; l < k; ++l)
            want += static_cast<float>(a[i * k + l]) * static_cast<float>(b[(l / 2) * n * 2 + j * 2 + l % 2]);
          if (c[i * n + j] != want) return false;
        }
      return true;
    } catch (...) {
      return false;
    }
  }();
  return works && at::globalContext().userEnabledMkldnn();
}

}  // namespace fox::cpu
