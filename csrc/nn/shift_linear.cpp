#include <fox/nn/shift_linear.h>

#include <fox/nn/functional.h>

namespace fox::nn {

ShiftLinearImpl::ShiftLinearImpl(const ShiftLinearOptions& options_) : options(options_) {
  reset();
}

void ShiftLinearImpl::reset() {
  TORCH_CHECK(options.num_heads() > 0 && options.out_features() % options.num_heads() == 0,
              "ShiftLinear: out_features (", options.out_features(),
              ") must be a positive multiple of num_heads (", options.num_heads(), ")");
  linear = register_module(
      "linear", torch::nn::Linear(torch::nn::LinearOptions(options.in_features(),
                                                           options.out_features())
                                      .bias(options.bias())));
  shift_proj = register_module(
      "shift_proj",
      torch::nn::Linear(torch::nn::LinearOptions(options.in_features(), options.num_heads())
                            .bias(options.shift_bias())));
}

void ShiftLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "fox::nn::ShiftLinear(" << options.in_features() << ", " << options.out_features()
         << ")";
}

std::tuple<torch::Tensor, torch::Tensor> ShiftLinearImpl::forward_with_state(
    const torch::Tensor& x, const std::optional<torch::Tensor>& prev) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) == options.in_features(),
              "ShiftLinear: x must be (batch, seqlen, ", options.in_features(), "), got ",
              x.sizes());
  return shift(linear(x), shift_proj(x), prev);
}

std::tuple<torch::Tensor, torch::Tensor> ShiftLinearImpl::shift(
    const torch::Tensor& projected, const torch::Tensor& shift_logits,
    const std::optional<torch::Tensor>& prev) const {
  const int64_t B = projected.size(0), T = projected.size(1);
  if (prev.has_value() && prev->defined()) {
    TORCH_CHECK(prev->dim() == 2 && prev->size(0) == B && prev->size(1) == options.out_features(),
                "ShiftLinear: state must be (", B, ", ", options.out_features(), "), got ",
                prev->sizes());
  }
  auto result = functional::shift_mix(projected, shift_logits, prev);
  return {result, projected.select(1, T - 1)};
}

torch::Tensor ShiftLinearImpl::forward(const torch::Tensor& x,
                                       const std::optional<torch::Tensor>& prev) {
  return std::get<0>(forward_with_state(x, prev));
}

}  // namespace fox::nn
