// ShiftLinear: the data-dependent token shift ("KV-shift") of FoX (Pro).
//
//   k~_t = W x_t,  alpha_t = sigmoid(w_h^T x_t) (one scalar per head h),
//   k_t  = alpha_t * k~_{t-1} + (1 - alpha_t) * k~_t,  with k~_{-1} = 0 (or the cached state).
//
// Parameter names follow the authors' ShiftLinear: `linear.weight` (out, in) and
// `shift_proj.weight` (num_heads, in), so their checkpoints load unchanged
// (e.g. `model.layers.0.attn.k_proj.linear.weight`).
#pragma once

#include <optional>
#include <tuple>

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

namespace fox::nn {

struct ShiftLinearOptions {
  ShiftLinearOptions(int64_t in_features, int64_t out_features, int64_t num_heads)
      : in_features_(in_features), out_features_(out_features), num_heads_(num_heads) {}
  /// Input size. Required.
  TORCH_ARG(int64_t, in_features);
  /// Output size (num_heads * head_dim). Required.
  TORCH_ARG(int64_t, out_features);
  /// Number of heads: one shift gate alpha per head. Required.
  TORCH_ARG(int64_t, num_heads);
  /// Bias of the main projection `linear`. Default false.
  TORCH_ARG(bool, bias) = false;
  /// Bias of the gate projection `shift_proj`. Default false.
  TORCH_ARG(bool, shift_bias) = false;
};

class ShiftLinearImpl : public torch::nn::Cloneable<ShiftLinearImpl> {
 public:
  explicit ShiftLinearImpl(const ShiftLinearOptions& options);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;

  /// x: (B, T, in). prev: (B, out), the pre-shift projection W x of the token before x[:, 0]
  /// (zeros when absent: start of the sequence). Returns the shifted projection (B, T, out).
  torch::Tensor forward(const torch::Tensor& x,
                        const std::optional<torch::Tensor>& prev = std::nullopt);
  /// As forward, also returning the new state: the pre-shift projection of the last token (B, out).
  std::tuple<torch::Tensor, torch::Tensor> forward_with_state(
      const torch::Tensor& x, const std::optional<torch::Tensor>& prev = std::nullopt);
  /// The shift alone, from the two projections computed elsewhere (e.g. in one GEMM with others):
  /// projected = linear(x) (B, T, out), shift_logits = shift_proj(x) (B, T, num_heads).
  std::tuple<torch::Tensor, torch::Tensor> shift(
      const torch::Tensor& projected, const torch::Tensor& shift_logits,
      const std::optional<torch::Tensor>& prev = std::nullopt) const;

  ShiftLinearOptions options;
  torch::nn::Linear linear{nullptr};
  torch::nn::Linear shift_proj{nullptr};
};
TORCH_MODULE(ShiftLinear);

}  // namespace fox::nn
