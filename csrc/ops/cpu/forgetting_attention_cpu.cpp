// CPU backend of the fox ops: the only CPU file that touches tensors. float16/bfloat16 inputs are
// converted to float32 here (O(N*D) extra memory), so the kernels compute in float32 or float64.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../forgetting_attention.h"
#include "forgetting_attention_cpu_kernel.h"

namespace fox::cpu {
namespace {

at::ScalarType compute_dtype(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

at::Tensor as_compute(const at::Tensor& x, at::ScalarType dtype) {
  return detail::with_unit_last_stride(x.to(dtype));
}

std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, const at::Tensor& log_fgate,
                                           const std::optional<at::Tensor>& seq_start,
                                           const std::optional<at::Tensor>& cu_seqlens,
                                           std::optional<double> sm_scale,
                                           std::optional<double> adaptive_threshold) {
  const auto idx = detail::check_forward_args(q, k, v, log_fgate, seq_start, cu_seqlens, sm_scale,
                                              adaptive_threshold);
  const auto dtype = compute_dtype(q);
  const auto qc = as_compute(q, dtype), kc = as_compute(k, dtype), vc = as_compute(v, dtype);
  const auto gc = log_fgate.to(dtype);
  auto out = at::empty(q.sizes(), q.options().dtype(dtype));
  auto lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(dtype));
  if (out.numel() > 0) {
    ForwardParams p;
    detail::fill_forward_params(p, qc, kc, vc, gc, out, lse, idx,
                                detail::resolve_scale(sm_scale, q.size(3)), adaptive_threshold);
    if (dtype == at::kDouble) {
      forward_kernel<double>(p);
    } else {
      forward_kernel<float>(p);
    }
  } else {
    lse.fill_(-std::numeric_limits<double>::infinity());
  }
  return {out.to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& log_fgate, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& seq_start, const std::optional<at::Tensor>& cu_seqlens,
    std::optional<double> sm_scale, std::optional<double> adaptive_threshold) {
  const auto idx = detail::check_forward_args(q, k, v, log_fgate, seq_start, cu_seqlens, sm_scale,
                                              adaptive_threshold);
  detail::check_backward_args(grad_out, q, out, lse);
  const auto dtype = compute_dtype(q);
  const auto qc = as_compute(q, dtype), kc = as_compute(k, dtype), vc = as_compute(v, dtype);
  const auto oc = as_compute(out, dtype), doc = as_compute(grad_out, dtype);
  const auto gc = log_fgate.to(dtype);
  auto dq = at::empty(q.sizes(), q.options().dtype(dtype));
  auto dk = at::empty(k.sizes(), k.options().dtype(dtype));
  auto dv = at::empty(v.sizes(), v.options().dtype(dtype));
  auto dg = at::empty(log_fgate.sizes(), log_fgate.options().dtype(dtype));
  if (q.numel() == 0 || k.numel() == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    dg.zero_();
  } else {
    BackwardParams p;
    detail::fill_forward_params(p, qc, kc, vc, gc, oc, lse, idx,
                                detail::resolve_scale(sm_scale, q.size(3)), adaptive_threshold);
    detail::fill_backward_params(p, doc, dq, dk, dv, dg);
    auto dc = at::empty({q.size(0), q.size(2), k.size(1)}, q.options().dtype(dtype));
    auto delta = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(dtype));
    auto rowsum = at::empty_like(delta);
    if (dtype == at::kDouble) {
      backward_kernel<double>(p, dc.data_ptr<double>(), delta.data_ptr<double>(),
                              rowsum.data_ptr<double>());
    } else {
      backward_kernel<float>(p, dc.data_ptr<float>(), delta.data_ptr<float>(),
                             rowsum.data_ptr<float>());
    }
  }
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type()),
          dg.to(log_fgate.scalar_type())};
}

at::Tensor forgetting_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& log_fgate,
                                const std::optional<at::Tensor>& seq_start,
                                const std::optional<at::Tensor>& cu_seqlens,
                                std::optional<double> sm_scale,
                                std::optional<double> adaptive_threshold) {
  return std::get<0>(
      forward(q, k, v, log_fgate, seq_start, cu_seqlens, sm_scale, adaptive_threshold));
}

}  // namespace
}  // namespace fox::cpu

TORCH_LIBRARY_IMPL(fox, CPU, m) {
  m.impl("forgetting_attention", &fox::cpu::forgetting_attention);
  m.impl("forgetting_attention_fwd", &fox::cpu::forward);
  m.impl("forgetting_attention_bwd", &fox::cpu::backward);
}
