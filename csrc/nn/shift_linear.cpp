#include <fox/nn/shift_linear.h>

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
  const int64_t B = x.size(0), T = x.size(1), H = options.num_heads();
  const int64_t D = options.out_features() / H;
  auto out = linear(x);                                                 // (B, T, out)
  auto gate_dtype = x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  auto alpha = torch::sigmoid(shift_proj(x).to(gate_dtype)).unsqueeze(-1);  // (B, T, H, 1)
  torch::Tensor first;
  if (prev.has_value() && prev->defined()) {
    TORCH_CHECK(prev->dim() == 2 && prev->size(0) == B && prev->size(1) == options.out_features(),
                "ShiftLinear: state must be (", B, ", ", options.out_features(), "), got ",
                prev->sizes());
    first = prev->to(out.scalar_type()).unsqueeze(1);
  } else {
    first = torch::zeros({B, 1, options.out_features()}, out.options());
  }
  auto out_prev = torch::cat({first, out.narrow(1, 0, T - 1)}, 1);
  auto cur = out.view({B, T, H, D}).to(gate_dtype);
  auto pre = out_prev.view({B, T, H, D}).to(gate_dtype);
  auto result = (alpha * pre + (1 - alpha) * cur).to(out.scalar_type()).view({B, T, -1});
  auto state = out.select(1, T - 1);
  return {result, state};
}

torch::Tensor ShiftLinearImpl::forward(const torch::Tensor& x,
                                       const std::optional<torch::Tensor>& prev) {
  return std::get<0>(forward_with_state(x, prev));
}

}  // namespace fox::nn
