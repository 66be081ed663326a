// Public C++ API of the Forgetting Attention op.
//
//   #include <fox/fox.h>
//   auto out = fox::forgetting_attention(q, k, v, log_fgate);                 // (B, T, H, D)
//   auto out = fox::forgetting_attention(q, k, v, log_fgate,
//                                        fox::AttentionOptions().head_first(true).sm_scale(0.1));
//
// The functions go through the dispatcher (torch.ops.fox.*), so they work on every backend the
// library was built with and record gradients for q, k, v and log_fgate.
#pragma once

#include <optional>
#include <tuple>

#include <ATen/Tensor.h>
#include <torch/arg.h>

namespace fox {

struct AttentionOptions {
  /// Tensors are (B, H, T, D) and log_fgate (B, H, T) instead of (B, T, H, D) and (B, T, H).
  TORCH_ARG(bool, head_first) = false;
  /// (B,) integer tensor: keys before seq_start[b] are masked out (left padding).
  TORCH_ARG(std::optional<at::Tensor>, seq_start) = std::nullopt;
  /// (num_seqs + 1,) integer tensor of sequence offsets into a packed batch of size 1
  /// (FlashAttention's varlen convention); each sequence attends causally within itself.
  TORCH_ARG(std::optional<at::Tensor>, cu_seqlens) = std::nullopt;
  /// Scale of q.k before the softmax; default 1/sqrt(head_dim).
  TORCH_ARG(std::optional<double>, sm_scale) = std::nullopt;
  /// Adaptive computation pruning: key tiles whose largest gate bias d_ij (the log of the forget
  /// gates' product) lies below this threshold are skipped. Default: no pruning.
  TORCH_ARG(std::optional<double>, adaptive_threshold) = std::nullopt;
  /// (B,) integer tensor: row b holds cache_seqlens[b] valid keys (a preallocated cache filled to
  /// different lengths); its queries are the last seqlen_q of them, later keys are ignored.
  TORCH_ARG(std::optional<at::Tensor>, cache_seqlens) = std::nullopt;
};

/// Forgetting Attention: softmax(scale * q k^T + D) v with D_ij = sum_{l=j+1..i} log_fgate_l,
/// causal, the seqlen_q queries at the last seqlen_q key positions. q: (B, Tq, H, D);
/// k, v: (B, Tk, Hkv, D) with H % Hkv == 0; log_fgate: (B, Tk, H) float32
/// (or float16: a compact decoding cache, summed in float32). Returns (B, Tq, H, D).
at::Tensor forgetting_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& log_fgate,
                                const AttentionOptions& options = AttentionOptions());

/// The forward op without autograd: returns (out, lse), lse of shape (B, H, Tq) in float32.
/// Layout is always (B, T, H, D) here.
std::tuple<at::Tensor, at::Tensor> forgetting_attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& log_fgate,
    const std::optional<at::Tensor>& seq_start, const std::optional<at::Tensor>& cu_seqlens,
    std::optional<double> sm_scale, std::optional<double> adaptive_threshold,
    const std::optional<at::Tensor>& cache_seqlens = std::nullopt);

/// The backward op: returns (dq, dk, dv, dlog_fgate) for the forward above.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forgetting_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& log_fgate, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& seq_start, const std::optional<at::Tensor>& cu_seqlens,
    std::optional<double> sm_scale, std::optional<double> adaptive_threshold,
    const std::optional<at::Tensor>& cache_seqlens = std::nullopt);

/// True when this build contains the CUDA kernels.
bool built_with_cuda();

}  // namespace fox
