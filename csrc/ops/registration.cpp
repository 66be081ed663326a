// The one op registry of fox_torch: every schema of the `fox` namespace is declared here.
// Backends register their kernels with TORCH_LIBRARY_IMPL next to their code (cpu/, cuda/),
// the autograd kernel lives in autograd/, fake (meta) kernels in forgetting_transformer/ops.py.
#include <torch/library.h>

#include <fox/ops.h>

TORCH_LIBRARY(fox, m) {
  // Forgetting Attention, differentiable in q, k, v and log_fgate.
  //   q (B, Tq, H, D); k, v (B, Tk, Hkv, D) with H % Hkv == 0; log_fgate (B, Tk, H) float32.
  //   seq_start (B,): keys before it are masked. cu_seqlens (S+1,): packed batch (B == 1, Tq == Tk).
  //   sm_scale: default 1/sqrt(D). adaptive_threshold: prune key tiles whose gate bias is below it.
  //   cache_seqlens (B,): valid keys of each row (a preallocated cache filled to different
  //   lengths); row b's queries are the last Tq of its cache_seqlens[b] keys, later keys ignored.
  //   Returns out (B, Tq, H, D) in the dtype of q.
  m.def(
      "forgetting_attention(Tensor q, Tensor k, Tensor v, Tensor log_fgate, Tensor? seq_start=None, "
      "Tensor? cu_seqlens=None, float? sm_scale=None, float? adaptive_threshold=None, "
      "Tensor? cache_seqlens=None) -> Tensor");
  // Forward without autograd; lse (B, H, Tq) float32 is what the backward needs.
  m.def(
      "forgetting_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor log_fgate, "
      "Tensor? seq_start=None, Tensor? cu_seqlens=None, float? sm_scale=None, "
      "float? adaptive_threshold=None, Tensor? cache_seqlens=None) -> (Tensor out, Tensor lse)");
  // Backward: gradients of q, k, v (their dtypes) and log_fgate (float32).
  m.def(
      "forgetting_attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor log_fgate, "
      "Tensor out, Tensor lse, Tensor? seq_start=None, Tensor? cu_seqlens=None, "
      "float? sm_scale=None, float? adaptive_threshold=None, Tensor? cache_seqlens=None) "
      "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dlog_fgate)");
}

namespace fox {

bool built_with_cuda() {
#ifdef FOX_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace fox
