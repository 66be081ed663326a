// RMS normalizations of the FoX model: RMSNorm over the last dimension and GroupRMSNorm (one
// RMS per group of channels, i.e. per attention head), both computed in float32 and returned in
// the input's dtype (a float32 input under autocast: in the autocast dtype, see
// functional::rms_norm). Parameter: `weight` (ones at init), as in the authors' modules.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

namespace fox::nn {

struct RMSNormOptions {
  RMSNormOptions(int64_t hidden_size) : hidden_size_(hidden_size) {}
  /// Size of the normalized (last) dimension. Required.
  TORCH_ARG(int64_t, hidden_size);
  /// Added to the mean square before the square root. Default 1e-6.
  TORCH_ARG(double, eps) = 1e-6;
  /// Learnable per-channel scale `weight`. Default true.
  TORCH_ARG(bool, elementwise_affine) = true;
};

/// y = x / sqrt(mean(x^2) + eps) * weight over the last dimension.
class RMSNormImpl : public torch::nn::Cloneable<RMSNormImpl> {
 public:
  explicit RMSNormImpl(const RMSNormOptions& options);
  void reset() override;
  void reset_parameters();
  torch::Tensor forward(const torch::Tensor& x);
  void pretty_print(std::ostream& stream) const override;

  RMSNormOptions options;
  torch::Tensor weight;  // (hidden_size,), undefined without elementwise_affine
};
TORCH_MODULE(RMSNorm);

struct GroupRMSNormOptions {
  GroupRMSNormOptions(int64_t num_groups, int64_t hidden_size)
      : num_groups_(num_groups), hidden_size_(hidden_size) {}
  /// Number of groups (heads); hidden_size must be a multiple of it. Required.
  TORCH_ARG(int64_t, num_groups);
  /// Size of the last dimension (num_groups * group size). Required.
  TORCH_ARG(int64_t, hidden_size);
  /// Added to each group's mean square. Default 1e-5 (the authors' default).
  TORCH_ARG(double, eps) = 1e-5;
  /// Learnable per-channel scale `weight` of size hidden_size. Default true.
  TORCH_ARG(bool, elementwise_affine) = true;
};

/// Per-group RMSNorm: the last dimension is split into num_groups groups, each normalized by its
/// own RMS, then scaled by weight (hidden_size,).
class GroupRMSNormImpl : public torch::nn::Cloneable<GroupRMSNormImpl> {
 public:
  explicit GroupRMSNormImpl(const GroupRMSNormOptions& options);
  void reset() override;
  void reset_parameters();
  torch::Tensor forward(const torch::Tensor& x);
  void pretty_print(std::ostream& stream) const override;

  GroupRMSNormOptions options;
  torch::Tensor weight;
};
TORCH_MODULE(GroupRMSNorm);

}  // namespace fox::nn
