#include <fox/nn/mlp.h>

#include <torch/nn/init.h>

#include <fox/nn/functional.h>

namespace fox::nn {

int64_t mlp_intermediate_size(int64_t hidden_size, double hidden_ratio) {
  auto size = static_cast<int64_t>(static_cast<double>(hidden_size) * hidden_ratio * 2.0 / 3.0);
  return 256 * ((size + 255) / 256);
}

GatedMLPImpl::GatedMLPImpl(const GatedMLPOptions& options_) : options(options_) { reset(); }

int64_t GatedMLPImpl::intermediate_size() const {
  return options.intermediate_size().value_or(
      mlp_intermediate_size(options.hidden_size(), options.hidden_ratio()));
}

void GatedMLPImpl::reset() {
  TORCH_CHECK(options.hidden_act() == "swish" || options.hidden_act() == "sigmoid",
              "GatedMLP: hidden_act must be swish or sigmoid, got '", options.hidden_act(), "'");
  const int64_t I = intermediate_size();
  TORCH_CHECK(I > 0, "GatedMLP: intermediate size must be positive, got ", I);
  gate_proj = register_module(
      "gate_proj",
      torch::nn::Linear(torch::nn::LinearOptions(options.hidden_size(), 2 * I).bias(false)));
  down_proj = register_module(
      "down_proj",
      torch::nn::Linear(torch::nn::LinearOptions(I, options.hidden_size()).bias(false)));
  reset_parameters();
}

void GatedMLPImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  torch::nn::init::normal_(gate_proj->weight, 0.0, options.initializer_range());
  torch::nn::init::normal_(down_proj->weight, 0.0, options.initializer_range());
}

void GatedMLPImpl::pretty_print(std::ostream& stream) const {
  stream << "fox::nn::GatedMLP(" << options.hidden_size() << ", " << intermediate_size() << ", "
         << options.hidden_act() << ")";
}

torch::Tensor GatedMLPImpl::forward(const torch::Tensor& x) {
  return forward_with_residual(x, torch::Tensor());
}

torch::Tensor GatedMLPImpl::forward_with_residual(const torch::Tensor& x,
                                                  const torch::Tensor& residual) {
  return functional::split_gated_linear(functional::linear(x, gate_proj->weight, gate_proj->bias),
                                        options.hidden_act(), down_proj->weight, down_proj->bias,
                                        residual);
}

}  // namespace fox::nn
