// CPU backend of the fox ops: the only CPU file that touches tensors. bfloat16 inputs of even head
// dim run the bf16 GEMM (blas.h) on copies packed here; other float16/bfloat16 inputs are converted
// to float32 (O(N*D) extra memory either way), and the kernels accumulate in float32 or float64.
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

// bf16 inputs stay bf16 when the bf16 GEMM runs here and the head-dim pairs of its layouts exist.
bool use_bf16_gemm(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
         v.scalar_type() == at::kBFloat16 && q.size(3) % 2 == 0 && bf16_gemm_available();
}

// Leading dimensions of the packed copies are rounded up so that few distinct GEMM shapes (each
// one a JIT-compiled kernel, cached per thread) arise across sequence lengths.
int64_t padded_ld(int64_t n) { return (n + 255) / 256 * 256; }

// x (batch, rows, heads, D) -> (batch, heads, D/2, ld, 2): x^T with head-dim pairs interleaved.
at::Tensor pack_transposed(const at::Tensor& x) {
  const int64_t B = x.size(0), N = x.size(1), H = x.size(2), D = x.size(3);
  auto out = at::zeros({B, H, D / 2, padded_ld(N), 2}, x.options());
  out.narrow(3, 0, N).copy_(x.unflatten(3, {D / 2, 2}).permute({0, 2, 3, 1, 4}));
  return out;
}

// x (batch, rows, heads, D) -> (batch, heads, pairs, D, 2): row pairs interleaved, zero rows after
// the end (at least one, for tiles that end at an odd row).
at::Tensor pack_row_pairs(const at::Tensor& x, int64_t pairs) {
  const int64_t B = x.size(0), N = x.size(1), H = x.size(2), D = x.size(3);
  auto rows = at::zeros({B, 2 * pairs, H, D}, x.options());
  rows.narrow(1, 0, N).copy_(x);
  return rows.view({B, pairs, 2, H, D}).permute({0, 3, 1, 4, 2}).contiguous();
}

// x (batch, rows, heads, D) -> (batch, heads, D, ld): x^T, zero columns after the end.
at::Tensor pack_columns(const at::Tensor& x, int64_t ld) {
  const int64_t B = x.size(0), N = x.size(1), H = x.size(2), D = x.size(3);
  auto out = at::zeros({B, H, D, ld}, x.options());
  out.narrow(3, 0, N).copy_(x.permute({0, 2, 3, 1}));
  return out;
}

// x (batch, rows, heads, D) -> (batch, heads, rows, D, 2): each element twice.
at::Tensor pack_doubled_rows(const at::Tensor& x) {
  return x.permute({0, 2, 1, 3}).unsqueeze(-1).expand({-1, -1, -1, -1, 2}).contiguous();
}

// x (batch, rows, heads, D) -> (batch, heads, D, 2 * ld): x^T with each element twice, zero
// columns after the end.
at::Tensor pack_doubled_columns(const at::Tensor& x, int64_t ld) {
  const int64_t B = x.size(0), N = x.size(1), H = x.size(2), D = x.size(3);
  auto out = at::zeros({B, H, D, ld, 2}, x.options());
  out.narrow(3, 0, N).copy_(x.permute({0, 2, 3, 1}).unsqueeze(-1).expand({-1, -1, -1, -1, 2}));
  return out.view({B, H, D, 2 * ld});
}

const BFloat16* bf16_ptr(const at::Tensor& x) {
  return reinterpret_cast<const BFloat16*>(x.const_data_ptr<at::BFloat16>());
}

std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, const at::Tensor& log_fgate,
                                           const std::optional<at::Tensor>& seq_start,
                                           const std::optional<at::Tensor>& cu_seqlens,
                                           std::optional<double> sm_scale,
                                           std::optional<double> adaptive_threshold,
                                           const std::optional<at::Tensor>& cache_seqlens) {
  const auto idx = detail::check_forward_args(q, k, v, log_fgate, seq_start, cu_seqlens, sm_scale,
                                              adaptive_threshold, cache_seqlens);
  const auto dtype = compute_dtype(q);
  const bool bf16 = use_bf16_gemm(q, k, v);
  const auto in_dtype = bf16 ? at::kBFloat16 : dtype;
  const auto qc = as_compute(q, in_dtype), kc = as_compute(k, in_dtype), vc = as_compute(v, in_dtype);
  const auto gc = log_fgate.to(dtype);
  auto out = at::empty(q.sizes(), q.options().dtype(in_dtype));
  auto lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(dtype));
  if (out.numel() > 0) {
    ForwardParams p;
    detail::fill_forward_params(p, qc, kc, vc, gc, out, lse, idx,
                                detail::resolve_scale(sm_scale, q.size(3)), adaptive_threshold);
    if (bf16) {
      const auto kt = pack_transposed(kc), vp = pack_row_pairs(vc, k.size(1) / 2 + 1);
      PackedBf16 packed;
      packed.kt = bf16_ptr(kt);
      packed.vp = bf16_ptr(vp);
      packed.ld_t = kt.size(3);
      packed.pairs = vp.size(2);
      forward_kernel<BFloat16>(p, &packed);
    } else if (dtype == at::kDouble) {
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
    std::optional<double> sm_scale, std::optional<double> adaptive_threshold,
    const std::optional<at::Tensor>& cache_seqlens) {
  const auto idx = detail::check_forward_args(q, k, v, log_fgate, seq_start, cu_seqlens, sm_scale,
                                              adaptive_threshold, cache_seqlens);
  detail::check_backward_args(grad_out, q, out, lse);
  const auto dtype = compute_dtype(q);
  const bool bf16 = use_bf16_gemm(q, k, v);
  const auto in_dtype = bf16 ? at::kBFloat16 : dtype;
  const auto qc = as_compute(q, in_dtype), kc = as_compute(k, in_dtype), vc = as_compute(v, in_dtype);
  const auto oc = as_compute(out, in_dtype), doc = as_compute(grad_out, in_dtype);
  const auto gc = log_fgate.to(dtype);
  auto dq = at::empty(q.sizes(), q.options().dtype(in_dtype));
  // Keys past a row's cache_seqlens get no gradient: the kernels skip them, so start from zeros.
  const auto alloc = [&](const at::Tensor& x, at::ScalarType type) {
    return cache_seqlens.has_value() ? at::zeros(x.sizes(), x.options().dtype(type))
                                     : at::empty(x.sizes(), x.options().dtype(type));
  };
  auto dk = alloc(k, in_dtype);
  auto dv = alloc(v, in_dtype);
  auto dg = alloc(log_fgate, dtype);
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
    if (bf16) {
      const auto kt = pack_transposed(kc), vt = pack_transposed(vc), kd = pack_doubled_rows(kc);
      const auto ld_qt = padded_ld(q.size(1) + 1);
      const auto qtd = pack_doubled_columns(qc, ld_qt), dot = pack_columns(doc, ld_qt);
      PackedBf16 packed;
      packed.kt = bf16_ptr(kt);
      packed.vt = bf16_ptr(vt);
      packed.kd = bf16_ptr(kd);
      packed.qtd = bf16_ptr(qtd);
      packed.dot = bf16_ptr(dot);
      packed.ld_t = kt.size(3);
      packed.ld_qt = ld_qt;
      backward_kernel<BFloat16>(p, dc.data_ptr<float>(), delta.data_ptr<float>(),
                                rowsum.data_ptr<float>(), &packed);
    } else if (dtype == at::kDouble) {
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
                                std::optional<double> adaptive_threshold,
                                const std::optional<at::Tensor>& cache_seqlens) {
  return std::get<0>(forward(q, k, v, log_fgate, seq_start, cu_seqlens, sm_scale,
                             adaptive_threshold, cache_seqlens));
}

}  // namespace
}  // namespace fox::cpu

TORCH_LIBRARY_IMPL(fox, CPU, m) {
  m.impl("forgetting_attention", &fox::cpu::forgetting_attention);
  m.impl("forgetting_attention_fwd", &fox::cpu::forward);
  m.impl("forgetting_attention_bwd", &fox::cpu::backward);
}
