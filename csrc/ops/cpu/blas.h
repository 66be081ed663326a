// Row-major tile products on top of the Fortran BLAS that LibTorch links and exports (MKL or
// OpenBLAS: sgemm_/dgemm_). The kernels call these from inside an OpenMP team (parallel.h), where
// the BLAS runs single-threaded (nested OpenMP regions are off), so each task owns one core.
#pragma once

#include <cstdint>

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

}  // namespace fox::cpu
