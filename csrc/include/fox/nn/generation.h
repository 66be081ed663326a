// Autoregressive generation with the KV cache: prefill the prompt (whole or in chunks), then
// decode one token at a time; greedy, or sampling with temperature, top-k and top-p.
#pragma once

#include <optional>
#include <vector>

#include <torch/types.h>

#include <fox/nn/model.h>

namespace fox::nn {

struct GenerationOptions {
  /// Number of tokens to generate at most. Default 32.
  TORCH_ARG(int64_t, max_new_tokens) = 32;
  /// Sample (true) or take the argmax (false, greedy). Default false.
  TORCH_ARG(bool, do_sample) = false;
  /// Softmax temperature of sampling; 0 means greedy. Default 1.
  TORCH_ARG(double, temperature) = 1.0;
  /// Keep only the k most likely tokens when sampling; 0 disables. Default 0.
  TORCH_ARG(int64_t, top_k) = 0;
  /// Nucleus sampling: keep the smallest set of tokens with probability >= top_p. Default 1 (off).
  TORCH_ARG(double, top_p) = 1.0;
  /// A row stops after producing any of these tokens. Default: the config's eos_token_id if set.
  TORCH_ARG(std::vector<int64_t>, stop_tokens) = {};
  /// Written after a row has stopped. Default: the config's pad_token_id, else 0.
  TORCH_ARG(std::optional<int64_t>, pad_token_id) = std::nullopt;
  /// (B,) left padding of the prompt: tokens before seq_start[b] are ignored. Default none.
  TORCH_ARG(std::optional<torch::Tensor>, seq_start) = std::nullopt;
  /// Prefill the prompt in chunks of this many tokens; 0: all at once. Default 0.
  TORCH_ARG(int64_t, prefill_chunk_size) = 0;
};

/// Picks the next token (B,) from last-position logits (B, vocab) as options say.
torch::Tensor sample_next_token(const torch::Tensor& logits, const GenerationOptions& options);

/// Returns (B, T + n) token ids: the prompt followed by the generated tokens (n <= max_new_tokens;
/// generation ends early once every row has stopped). Runs without gradients.
torch::Tensor generate(ForgettingTransformerForCausalLM& model, const torch::Tensor& input_ids,
                       const GenerationOptions& options = GenerationOptions());

}  // namespace fox::nn
