// ForgettingAttentionLayer: the time-mixing layer of FoX (and, with fgate_type "none" plus RoPE,
// of the Transformer baselines). Module and parameter names are the authors' (seed 002):
//   q_proj, k_proj, v_proj, o_proj      Linear, no bias (k_proj/v_proj are ShiftLinear with KV-shift)
//   fgate_proj                          Linear(hidden, num_heads, bias) for fgate_type "full"
//   fgate_bias                          (num_heads,) parameter ("bias_only") or buffer ("fixed")
//   ogate_proj                          Linear(hidden, hidden), output gate
//   output_norm                         GroupRMSNorm(num_heads, hidden, eps=norm_eps)
//   q_norm, k_norm                      GroupRMSNorm(heads, heads*head_dim, eps=1e-5) (QK-norm)
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <fox/nn/cache.h>
#include <fox/nn/norm.h>
#include <fox/nn/shift_linear.h>

namespace fox::nn {

struct ForgettingAttentionLayerOptions {
  ForgettingAttentionLayerOptions(int64_t hidden_size, int64_t num_heads)
      : hidden_size_(hidden_size), num_heads_(num_heads) {}
  /// Model width; head_dim = hidden_size / num_heads. Required.
  TORCH_ARG(int64_t, hidden_size);
  /// Number of query heads (and of forget gates). Required.
  TORCH_ARG(int64_t, num_heads);
  /// Number of key/value heads (GQA/MQA); must divide num_heads. Default: num_heads.
  TORCH_ARG(std::optional<int64_t>, num_kv_heads) = std::nullopt;
  /// Rotary position embedding on q and k (Transformer baselines). Default false.
  TORCH_ARG(bool, use_rope) = false;
  /// RoPE theta. Default 500000.
  TORCH_ARG(double, rope_base) = 500000.0;
  /// Output gate o * act(ogate_proj(x)) before o_proj. Default false.
  TORCH_ARG(bool, use_output_gate) = false;
  /// Output gate activation: "sigmoid" or "silu". Default "sigmoid".
  TORCH_ARG(std::string, ogate_act) = "sigmoid";
  /// "full" (data-dependent, fgate_proj), "bias_only" (learned per-head constant, fgate_bias),
  /// "fixed" (constant buffer fgate_bias, ALiBi-like) or "none" (no forgetting). Default "full".
  TORCH_ARG(std::string, fgate_type) = "full";
  /// Initialize fgate_bias from decay times T_min..T_max (required for "fixed"). Default false.
  TORCH_ARG(bool, fgate_bias_init) = false;
  /// T_min: the fastest head's decay time -1/log(sigmoid(b)). Default none.
  TORCH_ARG(std::optional<double>, decay_time_min) = std::nullopt;
  /// T_max: the slowest head's decay time (log-spaced between). Default none.
  TORCH_ARG(std::optional<double>, decay_time_max) = std::nullopt;
  /// Per-head RMSNorm of the attention output (output_norm). Default false.
  TORCH_ARG(bool, use_output_norm) = false;
  /// eps of output_norm. Default 1e-6.
  TORCH_ARG(double, norm_eps) = 1e-6;
  /// Per-head RMSNorm of q and k (q_norm, k_norm). Default false.
  TORCH_ARG(bool, qk_norm) = false;
  /// eps of q_norm and k_norm. Default 1e-5.
  TORCH_ARG(double, qk_norm_eps) = 1e-5;
  /// Authors' legacy QK-norm: one RMSNorm(head_dim) shared by all heads. Default false.
  TORCH_ARG(bool, qk_norm_share_param_across_head) = false;
  /// Data-dependent token shift of the keys (k_proj becomes ShiftLinear). Default false.
  TORCH_ARG(bool, use_k_shift) = false;
  /// Data-dependent token shift of the values (v_proj becomes ShiftLinear). Default false.
  TORCH_ARG(bool, use_v_shift) = false;
  /// log(eps) of adaptive computation pruning (the authors recommend -10); the layer derives the
  /// op's adaptive_threshold from it. Default none (exact attention).
  TORCH_ARG(std::optional<double>, log_pruning_tolerance) = std::nullopt;
  /// Standard deviation of the normal init of the linear weights. Default 0.02.
  TORCH_ARG(double, initializer_range) = 0.02;
};

/// A member that clone() leaves empty: it refers to the host (a Python callback, a process
/// group), not to the module's state, so a copy must not call into it.
template <typename T>
struct NotCopied {
  T value{};
  NotCopied() = default;
  NotCopied(const NotCopied&) {}
  NotCopied& operator=(const NotCopied&) { return *this; }
};

/// Context parallelism: the tokens a forward sees are pieces of one sequence split across the
/// ranks of a process group (one contiguous chunk a rank, or the zigzag layout's two). The host
/// (Python: forgetting_transformer.distributed.set_context_parallel) supplies the communication;
/// a layer needs it where the sequence crosses a piece boundary: the KV-shift's previous token,
/// RoPE positions, the pruning threshold's sequence length, and attention itself.
struct SequenceShard {
  /// Called by the model once a forward, with the local length and device: fills the fields below.
  std::function<void(SequenceShard*, int64_t, torch::Device)> prepare;
  /// Global positions of the local tokens, (T,) int64 on the forward's device.
  torch::Tensor positions;
  /// Lengths of the local pieces in local order (they sum to T).
  std::vector<int64_t> piece_lengths;
  /// Length of the whole sequence.
  int64_t sequence_length = 0;
  /// y (B, T, C) -> (B, pieces, C): the token of y before each local piece's first one (zeros
  /// where a piece starts the sequence); its gradient flows back to the owner.
  std::function<torch::Tensor(const torch::Tensor&)> previous_tokens;
  /// (q, k, v, log_fgate, sm_scale, adaptive_threshold) of the local tokens -> their output
  /// (B, T, H, D) of attention over the whole sequence (the threshold agreed over the ranks).
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                              const torch::Tensor&, double, std::optional<double>)>
      attention;
};

class ForgettingAttentionLayerImpl : public torch::nn::Cloneable<ForgettingAttentionLayerImpl> {
 public:
  explicit ForgettingAttentionLayerImpl(const ForgettingAttentionLayerOptions& options);
  ForgettingAttentionLayerImpl(int64_t hidden_size, int64_t num_heads)
      : ForgettingAttentionLayerImpl(ForgettingAttentionLayerOptions(hidden_size, num_heads)) {}
  void reset() override;
  /// The authors' init: normal(0, initializer_range) linear weights, zero biases, norms at one,
  /// fgate_bias from the decay times (fgate_bias_init) or zero.
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;

  /// x: (B, T, hidden). cache: appends this chunk's keys/values/gates/shift states and attends
  /// over everything cached (chunked prefill, decoding). seq_start: (B,) left padding in absolute
  /// positions (0 = first cached token); padded positions are zeroed before the projections so
  /// they never leak into real tokens through the KV-shift. Returns (B, T, hidden).
  torch::Tensor forward(const torch::Tensor& x, LayerCache* cache = nullptr,
                        const std::optional<torch::Tensor>& seq_start = std::nullopt);

  /// The log forget gates (B, T, num_heads) in float32 for input x (zeros for "none").
  torch::Tensor log_forget_gate(const torch::Tensor& x);
  /// log_forget_gate from fgate_proj(x) computed elsewhere (undefined for the other gate types).
  /// With fgate_bias, the logits come without the bias, which is added here (functional::log_forget_gate).
  torch::Tensor log_forget_gate_from(const torch::Tensor& x, const torch::Tensor& fgate_logits,
                                     const torch::Tensor& fgate_bias = {});
  /// Every projection of x, computed in one GEMM (views of its output; absent ones undefined).
  /// With `transform`, q, k and v come KV-shifted and normed as the layer uses them where the
  /// layer allows (functional::attention_inputs: on CUDA under autograd one node, whose backward
  /// makes the projection's gradient as one tensor); `transformed` says whether they do.
  struct InputProjections {
    torch::Tensor q, k, v, k_shift_logits, v_shift_logits, fgate_logits, ogate_logits;
    // Under autograd the forget gate's bias, not added to fgate_logits: log_forget_gate_from adds
    // it in the gate's one kernel.
    torch::Tensor fgate_bias;
    bool transformed = false;
  };
  InputProjections project_input(const torch::Tensor& x, bool transform = false);

  /// Run context-parallel over `shard` (null: the whole sequence is local again).
  void set_sequence_shard(std::shared_ptr<SequenceShard> shard) { shard_.value = std::move(shard); }
  const SequenceShard* sequence_shard() const { return shard_.value.get(); }

 private:
  NotCopied<std::shared_ptr<SequenceShard>> shard_;

  /// The input projections' weights and biases concatenated into one GEMM operand, the width
  /// padded to a multiple of 64 (zero rows) so that every wide slice starts 16-byte aligned.
  struct ConcatenatedProjection {
    torch::Tensor weight, bias;                   // bias undefined when no projection has one
    std::vector<torch::Tensor> part_biases;       // without bias_in_gemm: each part's own
    std::vector<int64_t> widths;                  // output widths in order, padding last
    std::vector<std::pair<const void*, uint32_t>> sources;  // (data_ptr, version) of each input
  };
  /// bias_in_gemm: the biases concatenated (zeros where a projection has none) for the GEMM's
  /// epilogue; otherwise added to their parts, so that a backward sums the bias gradient over
  /// the parts that have one only (the forget gate's few columns, not the whole width).
  ConcatenatedProjection concatenate_projections(const std::vector<torch::nn::Linear>& linears,
                                                 bool bias_in_gemm) const;
  /// Few-row inference (decoding) keeps the concatenation while the parameters are unchanged.
  ConcatenatedProjection inference_projection_;
  /// The zero rows of the padding, made once per shape, dtype and device (a training step's
  /// forward waits on the host's launches: each one saved counts).
  mutable torch::Tensor padding_rows_;

 public:

  int64_t head_dim() const { return options.hidden_size() / options.num_heads(); }
  int64_t num_kv_heads() const { return options.num_kv_heads().value_or(options.num_heads()); }

  ForgettingAttentionLayerOptions options;
  torch::nn::Linear q_proj{nullptr}, o_proj{nullptr};
  torch::nn::Linear k_proj{nullptr}, v_proj{nullptr};  // without KV-shift
  ShiftLinear k_shift_proj{nullptr}, v_shift_proj{nullptr};  // with KV-shift (named k_proj/v_proj)
  torch::nn::Linear fgate_proj{nullptr}, ogate_proj{nullptr};
  torch::Tensor fgate_bias;
  GroupRMSNorm output_norm{nullptr}, q_norm{nullptr}, k_norm{nullptr};
  RMSNorm q_norm_shared{nullptr}, k_norm_shared{nullptr};  // legacy shared QK-norm (named q_norm/k_norm)
};
TORCH_MODULE(ForgettingAttentionLayer);

/// Rotary embedding (non-interleaved halves, as flash-attn/fla): x (B, T, H, D), positions (T,)
/// or (B, T) integer. Computed in float32, returned in x's dtype.
torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& positions, double base);

}  // namespace fox::nn
