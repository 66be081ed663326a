// y = x W^T (+ bias) (+ residual) for a few rows of x: the projections of a decoding step. One row
// of x against a weight matrix is a matrix-vector product bound by reading W once; cuBLAS runs a
// GEMM tile for it (4-5 us for a 768 x 3072 bf16 weight that takes ~1 us to read on an H100).
// Called only by csrc/nn/functional.cpp (functional::linear), which checks small_batch_linear_fits.
#pragma once

#include <ATen/core/Tensor.h>

namespace fox::nn::cuda {

// Rows of x the kernel takes (one instantiation per row count).
constexpr int64_t kSmallBatchMaxRows = 8;

// Whether small_batch_linear takes these tensors: x (rows <= kSmallBatchMaxRows, K) with a
// contiguous last dimension and 16-byte aligned rows, weight (N, K) contiguous and 16-byte aligned,
// K a multiple of 8, every tensor fp16 or bf16 of one dtype on one device; bias (N,) and residual
// (rows, N) optional.
bool small_batch_linear_fits(const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& bias, const at::Tensor& residual);

// y (rows, N), written in full; residual may alias y.
void small_batch_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                        const at::Tensor& residual, const at::Tensor& y);

}  // namespace fox::nn::cuda
