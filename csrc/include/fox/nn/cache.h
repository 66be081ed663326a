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
//
// Two modes. Dynamic (default): the tensors grow by concatenation. Static (KVCache::allocate):
// k, v and log_fgate are preallocated (B, max_length, ...) buffers, the KV-shift states (B, Hkv*D)
// buffers, and `lengths` (B,) int64 on the device counts each row's tokens. New tokens are written
// in place at each row's own position and attention reads the whole buffer with per-row lengths
// (the op's cache_seqlens), so every decoding step has the same shapes and addresses: it can be
// captured once as a CUDA graph and replayed. Rows may hold different lengths.
#pragma once

#include <optional>
#include <vector>

#include <torch/types.h>

namespace fox::nn {

struct LayerCache {
  torch::Tensor k, v, log_fgate;        // undefined until the first update (dynamic mode)
  torch::Tensor key_shift, value_shift;  // undefined without KV-shift or before the first update
  // Static mode only, set by the model for the forward in progress: the positions of the new
  // tokens (B, T) (each row's length before the call, plus 0..T-1) and the lengths after it (B,).
  torch::Tensor positions, seqlens;

  bool is_static() const { return positions.defined(); }
  /// Number of cached tokens (dynamic mode).
  int64_t length() const { return k.defined() ? k.size(1) : 0; }
  /// Appends (B, T, ...) tensors along time and returns the full (B, T_total, ...) tensors; in
  /// static mode writes them at `positions` and returns the whole buffers.
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> update(const torch::Tensor& k_new,
                                                                 const torch::Tensor& v_new,
                                                                 const torch::Tensor& lf_new);
  /// update() with the gates given as the forget gate's logits (B, T, H): log f = logsigmoid of
  /// them in float32 (float64 for float64 logits). A static cache on CUDA computes it while writing
  /// them, in the same kernel.
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> update_from_gate_logits(
      const torch::Tensor& k_new, const torch::Tensor& v_new, const torch::Tensor& fgate_logits);
  /// Keeps the KV-shift state of the last token: replaced (dynamic) or copied in place (static).
  void set_state(torch::Tensor& state, const torch::Tensor& last) const;
};

/// Shapes of one layer's cache (for KVCache::allocate).
struct LayerCacheShape {
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  bool key_shift = false, value_shift = false;
};

struct KVCache {
  KVCache() = default;
  explicit KVCache(int64_t num_layers) : layers(num_layers) {}

  std::vector<LayerCache> layers;
  /// (B,) long: first non-padding position of each sequence (left padding); nullopt: none.
  std::optional<torch::Tensor> seq_start;

  /// A static cache for `batch` rows of at most `max_length` tokens (K and V in `dtype`, gates in
  /// `gate_dtype`: float32 by default, float64 with a float64 dtype; float16 halves the gate bytes
  /// a decoding step reads), all rows empty.
  static KVCache allocate(const std::vector<LayerCacheShape>& shapes, int64_t batch,
                          int64_t max_length, torch::ScalarType dtype, torch::Device device,
                          std::optional<torch::ScalarType> gate_dtype = std::nullopt);

  /// Static mode: tokens of each row (B,) int64 on the cache's device; undefined: dynamic mode.
  torch::Tensor lengths;
  /// Static mode: the capacity, and an upper bound of `lengths` kept on the host (so that a write
  /// past the end is an error before any kernel runs, without reading `lengths` back).
  int64_t max_length = 0;
  int64_t length_bound = 0;
  bool is_static() const { return lengths.defined(); }

  /// Number of cached tokens (those of layer 0; static mode: the host bound).
  int64_t length() const {
    if (is_static()) return length_bound;
    return layers.empty() ? 0 : layers[0].length();
  }
  /// Static mode: prepares a forward of T new tokens per row (positions and lengths for every
  /// layer); checks the capacity. finish_update(T) then advances the lengths in place.
  void begin_update(int64_t T);
  void finish_update(int64_t T);
  /// Static mode: the cache of row b alone (views: writes go to this cache).
  KVCache row(int64_t b) const;
  /// Forgets everything (keeps the number of layers).
  void reset();
  /// Keeps only the batch rows in `index` (e.g. for beam search or dropping finished rows).
  void select_batch(const torch::Tensor& index);
};

}  // namespace fox::nn
