// Autocast for fox::forgetting_attention: under torch.autocast the projections give q, k, v in
// the autocast dtype while a normalization (QK-norm) may leave some in float32. The op runs in the
// autocast dtype (log_fgate stays float32), as attention does under autocast.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include <fox/ops.h>

namespace fox {
namespace {

template <c10::DeviceType kDevice, c10::DispatchKey kAutocastKey>
at::Tensor forgetting_attention_autocast(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& log_fgate,
                                         const std::optional<at::Tensor>& seq_start,
                                         const std::optional<at::Tensor>& cu_seqlens,
                                         std::optional<double> sm_scale,
                                         std::optional<double> adaptive_threshold,
                                         const std::optional<at::Tensor>& cache_seqlens) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(kAutocastKey);
  const auto dtype = at::autocast::get_autocast_dtype(kDevice);
  auto cast = [&](const at::Tensor& x) {
    return at::isFloatingType(x.scalar_type()) && x.scalar_type() != at::kDouble ? x.to(dtype) : x;
  };
  const auto gate = log_fgate.scalar_type() == at::kDouble ? log_fgate : log_fgate.to(at::kFloat);
  return forgetting_attention(cast(q), cast(k), cast(v), gate,
                              AttentionOptions()
                                  .seq_start(seq_start)
                                  .cu_seqlens(cu_seqlens)
                                  .sm_scale(sm_scale)
                                  .adaptive_threshold(adaptive_threshold)
                                  .cache_seqlens(cache_seqlens));
}

}  // namespace
}  // namespace fox

TORCH_LIBRARY_IMPL(fox, AutocastCUDA, m) {
  m.impl("forgetting_attention",
         &fox::forgetting_attention_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>);
}

TORCH_LIBRARY_IMPL(fox, AutocastCPU, m) {
  m.impl("forgetting_attention",
         &fox::forgetting_attention_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>);
}
