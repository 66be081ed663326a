// Inference cache of the FoX model.
//
// Per layer it keeps what new queries need to see the past exactly as a full forward would:
//   k, v        (B, T, Hkv, D)  keys (after KV-shift, QK-norm, RoPE) and values of all past tokens
//   log_fgate   (B, T, H) fp32  log forget gates of all past tokens: the op rebuilds the bias
//                               d_ij = sum_{l=j+1..i} log f_l of a new query i from them
//   key_shift, value_shift (B, Hkv*D)  the pre-shift projections W x of the last token (KV-shift)
// and, for the whole model, seq_start (B,): left padding of the prompt (keys before it are
// ignored), set by the first forward that sees it and reused by every later one.
//
// Chunked prefill and one-token decoding both just append; the result equals the full forward.
#pragma once

#include <optional>
#include <vector>

#include <torch/types.h>

namespace fox::nn {

struct LayerCache {
  torch::Tensor k, v, log_fgate;        // undefined until the first update
  torch::Tensor key_shift, value_shift;  // undefined without KV-shift or before the first update

  /// Number of cached tokens.
  int64_t length() const { return k.defined() ? k.size(1) : 0; }
  /// Appends (B, T, ...) tensors along time and returns the full (B, T_total, ...) tensors.
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> update(const torch::Tensor& k_new,
                                                                 const torch::Tensor& v_new,
                                                                 const torch::Tensor& lf_new);
};

struct KVCache {
  KVCache() = default;
  explicit KVCache(int64_t num_layers) : layers(num_layers) {}

  std::vector<LayerCache> layers;
  /// (B,) long: first non-padding position of each sequence (left padding); nullopt: none.
  std::optional<torch::Tensor> seq_start;

  /// Number of cached tokens (those of layer 0).
  int64_t length() const { return layers.empty() ? 0 : layers[0].length(); }
  /// Forgets everything (keeps the number of layers).
  void reset();
  /// Keeps only the batch rows in `index` (e.g. for beam search or dropping finished rows).
  void select_batch(const torch::Tensor& index);
};

}  // namespace fox::nn
