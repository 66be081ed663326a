#include <fox/nn/norm.h>

#include <torch/nn/init.h>

namespace fox::nn {

namespace {
torch::Tensor rms_normalize(const torch::Tensor& x, double eps) {
  auto xf = x.scalar_type() == torch::kFloat64 ? x : x.to(torch::kFloat32);
  return xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
}
}  // namespace

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
  auto y = rms_normalize(x, options.eps());
  if (weight.defined()) y = y * weight.to(y.scalar_type());
  return y.to(x.scalar_type());
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
  auto sizes = x.sizes().vec();
  std::vector<int64_t> grouped(sizes.begin(), sizes.end() - 1);
  grouped.push_back(options.num_groups());
  grouped.push_back(options.hidden_size() / options.num_groups());
  auto y = rms_normalize(x.reshape(grouped), options.eps()).reshape(sizes);
  if (weight.defined()) y = y * weight.to(y.scalar_type());
  return y.to(x.scalar_type());
}

void GroupRMSNormImpl::pretty_print(std::ostream& stream) const {
  stream << "fox::nn::GroupRMSNorm(" << options.num_groups() << ", " << options.hidden_size()
         << ", eps=" << options.eps() << ")";
}

}  // namespace fox::nn
