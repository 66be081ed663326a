#include <fox/nn/norm.h>

#include <fox/nn/functional.h>

namespace fox::nn {

RMSNormImpl::RMSNormImpl(const RMSNormOptions& options_) : options(options_) { reset(); }

void RMSNormImpl::reset() {
  TORCH_CHECK(options.hidden_size() > 0, "RMSNorm: hidden_size must be positive, got ",
              options.hidden_size());
  if (options.elementwise_affine()) {
    weight = register_parameter("weight", torch::ones({options.hidden_size()}));
  } else {
    weight = torch::Tensor();
  }
}

void RMSNormImpl::reset_parameters() {
  if (weight.defined()) {
    torch::NoGradGuard g;
    weight.fill_(1.0);
  }
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  TORCH_CHECK(x.size(-1) == options.hidden_size(), "RMSNorm: last dimension must be ",
              options.hidden_size(), ", got input of shape ", x.sizes());
  return functional::rms_norm(x, weight, options.hidden_size(), options.eps());
}

void RMSNormImpl::pretty_print(std::ostream& stream) const {
  stream << "fox::nn::RMSNorm(" << options.hidden_size() << ", eps=" << options.eps() << ")";
}

GroupRMSNormImpl::GroupRMSNormImpl(const GroupRMSNormOptions& options_) : options(options_) {
  reset();
}

void GroupRMSNormImpl::reset() {
  TORCH_CHECK(options.num_groups() > 0 && options.hidden_size() % options.num_groups() == 0,
              "GroupRMSNorm: hidden_size (", options.hidden_size(),
              ") must be a positive multiple of num_groups (", options.num_groups(), ")");
  if (options.elementwise_affine()) {
    weight = register_parameter("weight", torch::ones({options.hidden_size()}));
  } else {
    weight = torch::Tensor();
  }
}

void GroupRMSNormImpl::reset_parameters() {
  if (weight.defined()) {
    torch::NoGradGuard g;
    weight.fill_(1.0);
  }
}

torch::Tensor GroupRMSNormImpl::forward(const torch::Tensor& x) {
  TORCH_CHECK(x.size(-1) == options.hidden_size(), "GroupRMSNorm: last dimension must be ",
              options.hidden_size(), ", got input of shape ", x.sizes());
  return functional::rms_norm(x, weight, options.hidden_size() / options.num_groups(),
                              options.eps());
}

void GroupRMSNormImpl::pretty_print(std::ostream& stream) const {
  stream << "fox::nn::GroupRMSNorm(" << options.num_groups() << ", " << options.hidden_size()
         << ", eps=" << options.eps() << ")";
}

}  // namespace fox::nn
