// Internal: argument checks and ForwardParams/BackwardParams construction shared by the backends.
// This is the one place (with the backends' entry points) that turns tensors into params.
#pragma once

#include <optional>

#include <ATen/Tensor.h>

#include "params.h"

namespace fox::detail {

// Validated, backend-ready versions of the optional index tensors (int64, contiguous, on q's device).
struct IndexTensors {
  std::optional<at::Tensor> seq_start;
  std::optional<at::Tensor> cu_seqlens;
  std::optional<at::Tensor> cache_seqlens;
  int64_t num_sequences = 0;
};

// Checks every argument of the forward op; throws c10::Error naming the argument on bad input.
// check_index_values = false skips the checks that read index tensors' values (seq_start,
// cache_seqlens): on a GPU they synchronize, which a CUDA graph capture does not allow (the
// kernels then clamp the values instead of failing).
IndexTensors check_forward_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& log_fgate,
                                const std::optional<at::Tensor>& seq_start,
                                const std::optional<at::Tensor>& cu_seqlens,
                                std::optional<double> sm_scale,
                                std::optional<double> adaptive_threshold,
                                const std::optional<at::Tensor>& cache_seqlens = std::nullopt,
                                bool check_index_values = true);

// Checks the extra arguments of the backward op (grad_out, out, lse) against q.
void check_backward_args(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& out,
                         const at::Tensor& lse);

double resolve_scale(std::optional<double> sm_scale, int64_t head_dim);

// A view of x whose last dimension has stride 1 (a copy only when it has not).
at::Tensor with_unit_last_stride(const at::Tensor& x);

// Fill params from tensors that already passed the checks. Tensor data pointers are taken as is:
// callers pass tensors in the dtype the kernel reads.
void fill_forward_params(ForwardParams& p, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& log_fgate, const at::Tensor& out,
                         const at::Tensor& lse, const IndexTensors& idx, double scale,
                         std::optional<double> adaptive_threshold);

void fill_backward_params(BackwardParams& p, const at::Tensor& grad_out, const at::Tensor& dq,
                          const at::Tensor& dk, const at::Tensor& dv,
                          const at::Tensor& dlog_fgate);

}  // namespace fox::detail
