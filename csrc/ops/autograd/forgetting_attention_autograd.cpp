// Autograd for fox::forgetting_attention, in C++ so C++ callers get gradients too.
// Registered under the Autograd key: the forward runs the fwd op below autograd and saves the
// softmax statistics (lse); the backward runs the bwd op.
#include <torch/autograd.h>
#include <torch/library.h>

#include <fox/ops.h>

#include "../forgetting_attention.h"

namespace fox {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class ForgettingAttentionFunction : public torch::autograd::Function<ForgettingAttentionFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& log_fgate,
                            const std::optional<at::Tensor>& seq_start,
                            const std::optional<at::Tensor>& cu_seqlens,
                            std::optional<double> sm_scale,
                            std::optional<double> adaptive_threshold,
                            const std::optional<at::Tensor>& cache_seqlens) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = forgetting_attention_forward(q, k, v, log_fgate, seq_start, cu_seqlens,
                                                   sm_scale, adaptive_threshold, cache_seqlens);
    ctx->save_for_backward({q, k, v, log_fgate, out, lse});
    ctx->saved_data["seq_start"] = seq_start;
    ctx->saved_data["cu_seqlens"] = cu_seqlens;
    ctx->saved_data["sm_scale"] = sm_scale;
    ctx->saved_data["adaptive_threshold"] = adaptive_threshold;
    ctx->saved_data["cache_seqlens"] = cache_seqlens;
    ctx->mark_non_differentiable({lse});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto& grad_out = grad_outputs[0];
    auto [dq, dk, dv, dg] = forgetting_attention_backward(
        grad_out, saved[0], saved[1], saved[2], saved[3], saved[4], saved[5],
        ctx->saved_data["seq_start"].toOptional<at::Tensor>(),
        ctx->saved_data["cu_seqlens"].toOptional<at::Tensor>(),
        ctx->saved_data["sm_scale"].toOptional<double>(),
        ctx->saved_data["adaptive_threshold"].toOptional<double>(),
        ctx->saved_data["cache_seqlens"].toOptional<at::Tensor>());
    return {dq, dk, dv, dg, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor forgetting_attention_autograd(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& log_fgate,
                                         const std::optional<at::Tensor>& seq_start,
                                         const std::optional<at::Tensor>& cu_seqlens,
                                         std::optional<double> sm_scale,
                                         std::optional<double> adaptive_threshold,
                                         const std::optional<at::Tensor>& cache_seqlens) {
  return ForgettingAttentionFunction::apply(q, k, v, log_fgate, seq_start, cu_seqlens, sm_scale,
                                            adaptive_threshold, cache_seqlens);
}

}  // namespace
}  // namespace fox

TORCH_LIBRARY_IMPL(fox, Autograd, m) {
  m.impl("forgetting_attention", &fox::forgetting_attention_autograd);
}
