// Autoregressive generation with the KV cache: prefill the prompt (whole or in chunks), then
// decode one token at a time; greedy, or sampling with temperature, top-k and top-p.
//
// By default generation runs on a static cache (cache.h): the decoding step (model forward,
// sampling, stop tokens, the cache's lengths) has fixed shapes and addresses, and on a GPU it is
// captured once as a CUDA graph and replayed for every token, so a small model's token costs its
// kernels' time and not the host's launch overhead.
#pragma once

#include <functional>
#include <memory>
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
  /// (B,) lengths of prompts of different lengths, right-padded in input_ids (each row prefilled
  /// alone, then decoded at its own position: no padding work). Default: every row is full.
  TORCH_ARG(std::optional<torch::Tensor>, prompt_lengths) = std::nullopt;
  /// Decode on a preallocated (static) cache. Default true; false: the growing cache.
  TORCH_ARG(bool, static_cache) = true;
  /// On a GPU, capture the decoding step as a CUDA graph and replay it (static cache only; not
  /// with pruning, whose threshold is computed on the host). Default true.
  TORCH_ARG(bool, cuda_graph) = true;
  /// Capacity of the static cache per row; 0: prompt length + max_new_tokens. Default 0.
  TORCH_ARG(int64_t, max_length) = 0;
  /// dtype of the static cache's log forget gates: float32 (default) or float16, which halves
  /// the gate bytes of every decoding step (log f rounded to 11 bits, the sums still float32).
  /// The decoding kernel reads float16 gates as they are where a KV group has an even number of
  /// query heads (GQA); otherwise they are converted each step, which costs more than it saves.
  TORCH_ARG(std::optional<torch::ScalarType>, gate_cache_dtype) = std::nullopt;
  /// Called after every step with that step's tokens (B,) (streaming). Default none.
  TORCH_ARG(std::function<void(const torch::Tensor&)>, on_tokens) = nullptr;
};

/// Picks the next token (B,) from last-position logits (B, vocab) as options say. Sampling is
/// the Gumbel-max trick (argmax of logits / temperature plus Gumbel noise): an exact draw from the
/// softmax that needs no host synchronization, so it runs inside a captured CUDA graph.
torch::Tensor sample_next_token(const torch::Tensor& logits, const GenerationOptions& options);

/// Generation on a static cache, one step at a time (what generate() uses; also the streaming
/// interface: prefill once, then call step() for each new token).
class GenerationSession {
 public:
  /// Allocates the cache for input_ids' batch; options as for generate().
  GenerationSession(ForgettingTransformerForCausalLM model, const torch::Tensor& input_ids,
                    const GenerationOptions& options = GenerationOptions());
  ~GenerationSession();

  /// Prefills the prompt (left-padded by options.seq_start, or right-padded rows of
  /// options.prompt_lengths) and returns the first new tokens (B,).
  torch::Tensor prefill();
  /// Decodes one token per row (B,): replays the captured step on a GPU (captured on the first
  /// call that can), else runs it eagerly. Errors when the cache is full.
  torch::Tensor step();
  /// Rows that produced a stop token (B,) bool.
  const torch::Tensor& finished() const { return finished_; }
  /// Steps left before the cache is full.
  int64_t steps_left() const;
  /// Whether step() replays a CUDA graph.
  bool uses_cuda_graph() const;

 private:
  void decode_step();  // the captured body: reads and writes only the static tensors below
  torch::Tensor select_next(const torch::Tensor& logits);
  torch::Tensor logits_of(const torch::Tensor& hidden);  // (B, hidden) -> (B, vocab)

  ForgettingTransformerForCausalLM model_;
  GenerationOptions options_;
  torch::Tensor input_ids_;
  KVCache cache_;
  torch::Tensor tokens_, finished_, stop_tokens_, pad_;
  // The LM head's weight as the session multiplies it (functional::aligned_head_weight: an odd
  // vocabulary's padded copy, made once, so weight updates during a session do not reach it).
  torch::Tensor head_weight_;
  int64_t vocab_ = 0;
  int64_t pad_id_ = 0;
  bool prefilled_ = false;
  struct Graph;
  std::unique_ptr<Graph> graph_;
};

/// Returns (B, T + n) token ids: the prompt followed by the generated tokens (n <= max_new_tokens;
/// generation ends early once every row has stopped). Runs without gradients.
torch::Tensor generate(ForgettingTransformerForCausalLM& model, const torch::Tensor& input_ids,
                       const GenerationOptions& options = GenerationOptions());

}  // namespace fox::nn
