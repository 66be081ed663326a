// GatedMLP: the SwiGLU feed-forward of FoX (the authors' ForgettingTransformerMLP).
//   gate, y = gate_proj(x).chunk(2, -1);  out = down_proj(act(gate) * y)
// gate_proj: Linear(hidden, 2 * intermediate), down_proj: Linear(intermediate, hidden), no bias.
// Under autograd the product act(gate) * y is not kept for the backward but computed again there
// (functional::gated_linear; the same gradients).
#pragma once

#include <optional>
#include <string>

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

namespace fox::nn {

/// The authors' MLP width: int(hidden * hidden_ratio * 2/3) rounded up to a multiple of 256
/// (hidden 1536, ratio 3.5 -> 4096; ratio 4 -> 4096).
int64_t mlp_intermediate_size(int64_t hidden_size, double hidden_ratio);

struct GatedMLPOptions {
  GatedMLPOptions(int64_t hidden_size) : hidden_size_(hidden_size) {}
  /// Model width. Required.
  TORCH_ARG(int64_t, hidden_size);
  /// MLP width relative to hidden_size (see mlp_intermediate_size). Default 4.
  TORCH_ARG(double, hidden_ratio) = 4.0;
  /// Explicit MLP width; overrides hidden_ratio. Default none.
  TORCH_ARG(std::optional<int64_t>, intermediate_size) = std::nullopt;
  /// Gate activation: "swish" (SwiGLU) or "sigmoid" (GLU). Default "swish".
  TORCH_ARG(std::string, hidden_act) = "swish";
  /// Standard deviation of the normal init of the weights. Default 0.02.
  TORCH_ARG(double, initializer_range) = 0.02;
};

class GatedMLPImpl : public torch::nn::Cloneable<GatedMLPImpl> {
 public:
  explicit GatedMLPImpl(const GatedMLPOptions& options);
  void reset() override;
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  torch::Tensor forward(const torch::Tensor& x);
  /// forward(x) + residual, the add done by the last projection (one kernel when decoding).
  torch::Tensor forward_with_residual(const torch::Tensor& x, const torch::Tensor& residual);
  int64_t intermediate_size() const;

  GatedMLPOptions options;
  torch::nn::Linear gate_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(GatedMLP);

}  // namespace fox::nn
