// The model's elementwise building blocks as functions with their own autograd. On CUDA each is
// one fused kernel forward and one backward (float32 math, one rounding to the output dtype); on
// CPU and in float64 they are the plain ATen formulas. Inputs may be slices of a larger tensor
// (e.g. of one concatenated projection) as long as their last dimension is contiguous.
#pragma once

#include <cstdint>
#include <optional>

#include <torch/types.h>

namespace fox::nn::functional {

/// RMSNorm over groups of `group_size` channels of the last dimension, times `weight` (C,) when
/// defined: y = x / sqrt(mean(x^2) + eps) * weight. The output has x's dtype, except that a
/// float32 x under autocast gives the autocast dtype (what the next projection reads anyway).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, int64_t group_size,
                       double eps);

/// The KV-shift mix: out[:, t] = a_t * cur[:, t-1] + (1 - a_t) * cur[:, t] with
/// a_t = sigmoid(shift_logits[:, t, head]), cur (B, T, H*D), shift_logits (B, T, H); the row
/// before t = 0 is `first` (B, H*D) when given, zeros otherwise.
torch::Tensor shift_mix(const torch::Tensor& cur, const torch::Tensor& shift_logits,
                        const std::optional<torch::Tensor>& first = std::nullopt);

/// act(gate) * value with act "swish" (silu) or "sigmoid": SwiGLU, and the attention output gate.
torch::Tensor gated(const torch::Tensor& gate, const torch::Tensor& value, const std::string& act);

/// Per-token cross entropy (float32, the shape of labels) of logits (..., V) against labels
/// (...) int64; tokens labelled `ignore_index` give 0. Logits are read in their own dtype.
torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& labels,
                            int64_t ignore_index = -100);

}  // namespace fox::nn::functional
