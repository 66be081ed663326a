// Argument checks, params construction and the C++ entry points of the Forgetting Attention op.
#include "forgetting_attention.h"

#include <cmath>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <fox/ops.h>

namespace fox {
namespace detail {

namespace {

void check_floating(const at::Tensor& x, const char* name) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16 || dt == at::kDouble,
              name, " must be float16, bfloat16, float32 or float64, got ", dt);
}

at::Tensor checked_index_tensor(const at::Tensor& x, const char* name, const at::Tensor& q) {
  TORCH_CHECK(!at::isFloatingType(x.scalar_type()) && !at::isComplexType(x.scalar_type()) &&
                  x.scalar_type() != at::kBool,
              name, " must be an integer tensor, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 1, name, " must be one-dimensional, got shape ", x.sizes());
  TORCH_CHECK(x.device() == q.device(), name, " must be on the same device as q (", q.device(),
              "), got ", x.device());
  return x.to(at::kLong).contiguous();
}

// checked_index_tensor for a per-row tensor (batch entries); with check_values, also (min, max)
// of its values, read back in one transfer (none when B == 0 or under CUDA graph capture).
std::pair<at::Tensor, std::optional<std::pair<int64_t, int64_t>>> checked_row_tensor(
    const at::Tensor& x, const char* name, const at::Tensor& q, int64_t B, bool check_values) {
  auto t = checked_index_tensor(x, name, q);
  TORCH_CHECK(t.numel() == B, name, " must have batch=", B, " entries, got ", t.numel());
  if (B == 0 || !check_values) return {t, std::nullopt};
  auto [lo, hi] = at::aminmax(t);
  const auto host = at::stack({lo, hi}).cpu();
  return {t, std::make_pair(host[0].item<int64_t>(), host[1].item<int64_t>())};
}

}  // namespace

IndexTensors check_forward_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& log_fgate,
                                const std::optional<at::Tensor>& seq_start,
                                const std::optional<at::Tensor>& cu_seqlens,
                                std::optional<double> sm_scale,
                                std::optional<double> adaptive_threshold,
                                const std::optional<at::Tensor>& cache_seqlens,
                                bool check_index_values) {
  TORCH_CHECK(q.dim() == 4, "q must be (batch, seqlen_q, num_heads, head_dim), got shape ",
              q.sizes());
  TORCH_CHECK(k.dim() == 4, "k must be (batch, seqlen_k, num_kv_heads, head_dim), got shape ",
              k.sizes());
  TORCH_CHECK(v.dim() == 4, "v must be (batch, seqlen_k, num_kv_heads, head_dim), got shape ",
              v.sizes());
  TORCH_CHECK(log_fgate.dim() == 3, "log_fgate must be (batch, seqlen_k, num_heads), got shape ",
              log_fgate.sizes());
  check_floating(q, "q");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "k must have the dtype of q (",
              q.scalar_type(), "), got ", k.scalar_type());
  TORCH_CHECK(v.scalar_type() == q.scalar_type(), "v must have the dtype of q (",
              q.scalar_type(), "), got ", v.scalar_type());
  // float16 gates: a compact decoding cache (half the gate bytes); the kernels sum them in
  // float32. bfloat16 keeps too few bits of log f to be offered.
  TORCH_CHECK(log_fgate.scalar_type() == at::kFloat ||
                  (log_fgate.scalar_type() == at::kHalf && q.scalar_type() != at::kDouble) ||
                  (log_fgate.scalar_type() == at::kDouble && q.scalar_type() == at::kDouble),
              "log_fgate must be float32 or float16 (float64 only with float64 q), got ",
              log_fgate.scalar_type());
  for (const auto* t : {&k, &v, &log_fgate}) {
    TORCH_CHECK(t->device() == q.device(),
                "q, k, v and log_fgate must be on one device; q is on ", q.device(), ", ",
                (t == &k ? "k" : t == &v ? "v" : "log_fgate"), " on ", t->device());
  }

  const int64_t B = q.size(0), Tq = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t Tk = k.size(1), Hkv = k.size(2);
  TORCH_CHECK(D >= 1 && D <= 256, "head_dim (last dim of q) must be in [1, 256], got ", D);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D,
              "k must be (batch=", B, ", seqlen_k, num_kv_heads, head_dim=", D, "), got ",
              k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), "v must have the shape of k (", k.sizes(), "), got ",
              v.sizes());
  TORCH_CHECK(Hkv >= 1 && H % Hkv == 0, "num_heads of q (", H,
              ") must be a multiple of num_kv_heads of k and v (", Hkv, ")");
  TORCH_CHECK(log_fgate.size(0) == B && log_fgate.size(1) == Tk && log_fgate.size(2) == H,
              "log_fgate must be (batch=", B, ", seqlen_k=", Tk, ", num_heads=", H, "), got ",
              log_fgate.sizes());
  TORCH_CHECK(Tq <= Tk, "seqlen_q (", Tq, ") must not exceed seqlen_k (", Tk, ")");
  if (sm_scale.has_value()) {
    TORCH_CHECK(std::isfinite(*sm_scale), "sm_scale must be finite, got ", *sm_scale);
  }
  if (adaptive_threshold.has_value()) {
    TORCH_CHECK(!std::isnan(*adaptive_threshold), "adaptive_threshold must not be NaN");
  }

  IndexTensors idx;
  idx.num_sequences = B;
  if (seq_start.has_value()) {
    TORCH_CHECK(!cu_seqlens.has_value(),
                "seq_start and cu_seqlens cannot be combined: pack only the valid tokens instead");
    auto [t, range] = checked_row_tensor(*seq_start, "seq_start", q, B, check_index_values);
    idx.seq_start = t;
    if (range) {
      const auto [lo, hi] = *range;
      TORCH_CHECK(lo >= 0 && hi < std::max<int64_t>(Tk, 1),
                  "seq_start values must lie in [0, seqlen_k=", Tk, "), got min ", lo, " max ",
                  hi);
    }
  }
  if (cu_seqlens.has_value()) {
    TORCH_CHECK(B == 1, "with cu_seqlens the batch must be packed into batch size 1, got batch ",
                B);
    TORCH_CHECK(Tq == Tk, "with cu_seqlens seqlen_q (", Tq, ") must equal seqlen_k (", Tk, ")");
    idx.cu_seqlens = checked_index_tensor(*cu_seqlens, "cu_seqlens", q);
    const int64_t n = idx.cu_seqlens->numel();
    TORCH_CHECK(n >= 2, "cu_seqlens must have at least 2 entries (num_seqs + 1), got ", n);
    const auto host = idx.cu_seqlens->cpu();
    const int64_t* c = host.data_ptr<int64_t>();
    TORCH_CHECK(c[0] == 0, "cu_seqlens must start at 0, got ", c[0]);
    for (int64_t i = 1; i < n; ++i) {
      TORCH_CHECK(c[i] >= c[i - 1], "cu_seqlens must be non-decreasing, got ", c[i - 1],
                  " then ", c[i], " at index ", i);
    }
    TORCH_CHECK(c[n - 1] == Tk, "cu_seqlens must end at the packed length ", Tk, ", got ",
                c[n - 1]);
    idx.num_sequences = n - 1;
  }
  if (cache_seqlens.has_value()) {
    TORCH_CHECK(!cu_seqlens.has_value(),
                "cache_seqlens and cu_seqlens cannot be combined: cache_seqlens describes a padded "
                "(batch, seqlen_k) cache, cu_seqlens a packed batch");
    auto [t, range] =
        checked_row_tensor(*cache_seqlens, "cache_seqlens", q, B, check_index_values);
    idx.cache_seqlens = t;
    if (range) {
      const auto [lo, hi] = *range;
      TORCH_CHECK(lo >= Tq && hi <= Tk, "cache_seqlens values must lie in [seqlen_q=", Tq,
                  ", seqlen_k=", Tk, "] (every row holds its seqlen_q queries), got min ", lo,
                  " max ", hi);
    }
  }
  return idx;
}

void check_backward_args(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& out,
                         const at::Tensor& lse) {
  TORCH_CHECK(grad_out.sizes() == q.sizes(), "grad_out must have the shape of q (", q.sizes(),
              "), got ", grad_out.sizes());
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have the shape of q (", q.sizes(), "), got ",
              out.sizes());
  TORCH_CHECK(grad_out.device() == q.device() && out.device() == q.device() &&
                  lse.device() == q.device(),
              "grad_out, out and lse must be on the device of q (", q.device(), ")");
  const auto lse_dtype = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(2) &&
                  lse.size(2) == q.size(1) && lse.scalar_type() == lse_dtype,
              "lse must be ", lse_dtype, " (batch, num_heads, seqlen_q) = (", q.size(0), ", ",
              q.size(2), ", ", q.size(1), "), got ", lse.scalar_type(), " ", lse.sizes());
  TORCH_CHECK(lse.is_contiguous(), "lse must be contiguous");
}

double resolve_scale(std::optional<double> sm_scale, int64_t head_dim) {
  return sm_scale.has_value() ? *sm_scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

at::Tensor with_unit_last_stride(const at::Tensor& x) {
  return (x.size(-1) <= 1 || x.stride(-1) == 1) ? x : x.contiguous();
}

void fill_forward_params(ForwardParams& p, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& log_fgate, const at::Tensor& out,
                         const at::Tensor& lse, const IndexTensors& idx, double scale,
                         std::optional<double> adaptive_threshold) {
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.log_fgate = log_fgate.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr();
  auto strides = [](const at::Tensor& t, int64_t& b, int64_t& r, int64_t& h) {
    b = t.stride(0);
    r = t.stride(1);
    h = t.stride(2);
  };
  strides(q, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
  strides(k, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  strides(v, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  strides(log_fgate, p.g_batch_stride, p.g_row_stride, p.g_head_stride);
  strides(out, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
  p.batch = idx.num_sequences;
  p.seqlen_q = q.size(1);
  p.seqlen_k = k.size(1);
  p.num_heads = q.size(2);
  p.num_kv_heads = k.size(2);
  p.head_dim = q.size(3);
  p.seq_start = idx.seq_start ? idx.seq_start->data_ptr<int64_t>() : nullptr;
  p.cu_seqlens = idx.cu_seqlens ? idx.cu_seqlens->data_ptr<int64_t>() : nullptr;
  p.cache_seqlens = idx.cache_seqlens ? idx.cache_seqlens->data_ptr<int64_t>() : nullptr;
  p.scale = scale;
  p.prune_threshold =
      adaptive_threshold.has_value() ? static_cast<float>(*adaptive_threshold) : -INFINITY;
}

void fill_backward_params(BackwardParams& p, const at::Tensor& grad_out, const at::Tensor& dq,
                          const at::Tensor& dk, const at::Tensor& dv,
                          const at::Tensor& dlog_fgate) {
  p.dout = grad_out.data_ptr();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dlog_fgate = dlog_fgate.data_ptr();
  p.do_batch_stride = grad_out.stride(0);
  p.do_row_stride = grad_out.stride(1);
  p.do_head_stride = grad_out.stride(2);
  p.dq_batch_stride = dq.stride(0);
  p.dq_row_stride = dq.stride(1);
  p.dq_head_stride = dq.stride(2);
  p.dk_batch_stride = dk.stride(0);
  p.dk_row_stride = dk.stride(1);
  p.dk_head_stride = dk.stride(2);
  p.dv_batch_stride = dv.stride(0);
  p.dv_row_stride = dv.stride(1);
  p.dv_head_stride = dv.stride(2);
  p.dg_batch_stride = dlog_fgate.stride(0);
  p.dg_row_stride = dlog_fgate.stride(1);
  p.dg_head_stride = dlog_fgate.stride(2);
}

}  // namespace detail

// ---- C++ entry points: thin calls into the dispatcher -------------------------------------

at::Tensor forgetting_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& log_fgate, const AttentionOptions& options) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fox::forgetting_attention", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const std::optional<at::Tensor>&,
                                         const std::optional<at::Tensor>&,
                                         std::optional<double>, std::optional<double>,
                                         const std::optional<at::Tensor>&)>();
  if (options.head_first()) {
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && log_fgate.dim() == 3,
                "head_first expects q, k, v of rank 4 (B, H, T, D) and log_fgate of rank 3 "
                "(B, H, T), got ranks ", q.dim(), ", ", k.dim(), ", ", v.dim(), ", ",
                log_fgate.dim());
    auto out = op.call(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                       log_fgate.transpose(1, 2), options.seq_start(), options.cu_seqlens(),
                       options.sm_scale(), options.adaptive_threshold(), options.cache_seqlens());
    return out.transpose(1, 2);
  }
  return op.call(q, k, v, log_fgate, options.seq_start(), options.cu_seqlens(),
                 options.sm_scale(), options.adaptive_threshold(), options.cache_seqlens());
}

std::tuple<at::Tensor, at::Tensor> forgetting_attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& log_fgate,
    const std::optional<at::Tensor>& seq_start, const std::optional<at::Tensor>& cu_seqlens,
    std::optional<double> sm_scale, std::optional<double> adaptive_threshold,
    const std::optional<at::Tensor>& cache_seqlens) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fox::forgetting_attention_fwd", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, std::optional<double>,
                           std::optional<double>, const std::optional<at::Tensor>&)>();
  return op.call(q, k, v, log_fgate, seq_start, cu_seqlens, sm_scale, adaptive_threshold,
                 cache_seqlens);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forgetting_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& log_fgate, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& seq_start, const std::optional<at::Tensor>& cu_seqlens,
    std::optional<double> sm_scale, std::optional<double> adaptive_threshold,
    const std::optional<at::Tensor>& cache_seqlens) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fox::forgetting_attention_bwd", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
              std::optional<double>, std::optional<double>, const std::optional<at::Tensor>&)>();
  return op.call(grad_out, q, k, v, log_fgate, out, lse, seq_start, cu_seqlens, sm_scale,
                 adaptive_threshold, cache_seqlens);
}

}  // namespace fox
