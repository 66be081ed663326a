// The FoX language model: config, pre-norm block, decoder stack and causal LM head, with the
// module and parameter names of the authors' ForgettingTransformerForCausalLM (seed 002), e.g.
//   model.embeddings.weight
//   model.layers.0.attn_norm.weight
//   model.layers.0.attn.{q_proj,o_proj,fgate_proj,ogate_proj}.weight, .attn.fgate_proj.bias
//   model.layers.0.attn.k_proj.weight            (or k_proj.linear.weight, k_proj.shift_proj.weight
//                                                 with KV-shift)
//   model.layers.0.attn.{q_norm,k_norm,output_norm}.weight
//   model.layers.0.mlp_norm.weight, model.layers.0.mlp.{gate_proj,down_proj}.weight
//   model.norm.weight, lm_head.weight
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <fox/nn/attention.h>
#include <fox/nn/cache.h>
#include <fox/nn/mlp.h>
#include <fox/nn/norm.h>

namespace fox::nn {

/// The authors' ForgettingTransformerConfig (same field names, as in their config.json).
struct ForgettingTransformerConfig {
  /// Vocabulary size. Default 32768.
  TORCH_ARG(int64_t, vocab_size) = 32768;
  /// Model width. Default 2048.
  TORCH_ARG(int64_t, hidden_size) = 2048;
  /// MLP width ratio (see mlp_intermediate_size). Default 4.
  TORCH_ARG(double, hidden_ratio) = 4.0;
  /// Explicit MLP width, overriding hidden_ratio. Default none.
  TORCH_ARG(std::optional<int64_t>, intermediate_size) = std::nullopt;
  /// Number of blocks. Default 24.
  TORCH_ARG(int64_t, num_hidden_layers) = 24;
  /// Number of attention heads. Default 32.
  TORCH_ARG(int64_t, num_heads) = 32;
  /// Number of key/value heads (GQA). Default none (= num_heads).
  TORCH_ARG(std::optional<int64_t>, num_kv_heads) = std::nullopt;
  /// MLP activation: "swish" or "sigmoid". Default "swish".
  TORCH_ARG(std::string, hidden_act) = "swish";
  /// Std of the normal init of linear and embedding weights. Default 0.02.
  TORCH_ARG(double, initializer_range) = 0.02;
  /// eps of the block/final RMSNorms and of output_norm. Default 1e-6.
  TORCH_ARG(double, norm_eps) = 1e-6;
  /// Padding token (its embedding row is zero and gets no gradient). Default none.
  TORCH_ARG(std::optional<int64_t>, pad_token_id) = std::nullopt;
  /// Beginning-of-sequence token. Default none.
  TORCH_ARG(std::optional<int64_t>, bos_token_id) = std::nullopt;
  /// End-of-sequence token (a default stop token of generate). Default none.
  TORCH_ARG(std::optional<int64_t>, eos_token_id) = std::nullopt;
  /// lm_head shares model.embeddings.weight (then there is no lm_head.weight). Default false.
  TORCH_ARG(bool, tie_word_embeddings) = false;
  /// RoPE theta. Default 500000.
  TORCH_ARG(double, rope_base) = 500000.0;
  /// RoPE on q/k. Default false.
  TORCH_ARG(bool, use_rope) = false;
  /// Output gate. Default false.
  TORCH_ARG(bool, use_output_gate) = false;
  /// Output gate activation: "sigmoid" or "silu". Default "sigmoid".
  TORCH_ARG(std::string, ogate_act) = "sigmoid";
  /// Forget gate: "full", "bias_only", "fixed" or "none". Default "full".
  TORCH_ARG(std::string, fgate_type) = "full";
  /// Initialize the gate biases from decay_time_min/max. Default false.
  TORCH_ARG(bool, fgate_bias_init) = false;
  /// T_min of the gate bias init. Default none.
  TORCH_ARG(std::optional<double>, decay_time_min) = std::nullopt;
  /// T_max of the gate bias init. Default none.
  TORCH_ARG(std::optional<double>, decay_time_max) = std::nullopt;
  /// Output normalization. Default false.
  TORCH_ARG(bool, use_output_norm) = false;
  /// QK-norm. Default false.
  TORCH_ARG(bool, qk_norm) = false;
  /// Authors' legacy shared QK-norm parameters. Default false.
  TORCH_ARG(bool, qk_norm_share_param_across_head) = false;
  /// log(eps) of adaptive computation pruning. Default none (exact attention).
  TORCH_ARG(std::optional<double>, log_pruning_tolerance) = std::nullopt;
  /// KV-shift of the keys. Default false.
  TORCH_ARG(bool, use_k_shift) = false;
  /// KV-shift of the values. Default false.
  TORCH_ARG(bool, use_v_shift) = false;

public:
  // ---- the paper's four architectures (only the architecture flags change) ----
  /// FoX (LLaMA): LLaMA with RoPE replaced by the data-dependent forget gate.
  ForgettingTransformerConfig& fox_llama();
  /// FoX (Pro): FoX + QK-norm, output gate, output norm, KV-shift; hidden_ratio 3.5.
  ForgettingTransformerConfig& fox_pro();
  /// Transformer (LLaMA): RoPE, no forget gate.
  ForgettingTransformerConfig& transformer_llama();
  /// Transformer (Pro): the Pro components with RoPE and no forget gate; hidden_ratio 3.5.
  ForgettingTransformerConfig& transformer_pro();
  /// One of "fox_llama", "fox_pro", "transformer_llama", "transformer_pro" applied to a copy.
  ForgettingTransformerConfig preset(const std::string& architecture) const;

  ForgettingAttentionLayerOptions attention_options() const;
  GatedMLPOptions mlp_options() const;
};

class ForgettingTransformerBlockImpl
    : public torch::nn::Cloneable<ForgettingTransformerBlockImpl> {
 public:
  explicit ForgettingTransformerBlockImpl(const ForgettingTransformerConfig& config);
  void reset() override;
  /// Pre-norm residual block: h = x + attn(attn_norm(x)); out = h + mlp(mlp_norm(h)).
  torch::Tensor forward(const torch::Tensor& x, LayerCache* cache = nullptr,
                        const std::optional<torch::Tensor>& seq_start = std::nullopt);
  /// The same block with its last residual add deferred: takes the stream without the previous
  /// block's MLP branch (`pending`, undefined for the first block) and returns {h, mlp branch},
  /// h + branch being forward's result. The pending add happens inside this block's first norm
  /// (add_rms_norm), so that a training step runs no separate add, cast or gradient
  /// accumulation for it. Bitwise the same values and gradients as forward. No cache.
  std::pair<torch::Tensor, torch::Tensor> forward_deferred(
      const torch::Tensor& x, const torch::Tensor& pending,
      const std::optional<torch::Tensor>& seq_start = std::nullopt);

  ForgettingTransformerConfig config;
  RMSNorm attn_norm{nullptr}, mlp_norm{nullptr};
  ForgettingAttentionLayer attn{nullptr};
  GatedMLP mlp{nullptr};
};
TORCH_MODULE(ForgettingTransformerBlock);

class ForgettingTransformerModelImpl
    : public torch::nn::Cloneable<ForgettingTransformerModelImpl> {
 public:
  explicit ForgettingTransformerModelImpl(const ForgettingTransformerConfig& config);
  void reset() override;
  /// input_ids (B, T) -> final hidden states (B, T, hidden). cache: see KVCache. seq_start: (B,)
  /// left padding (stored in the cache by the first call that has one).
  torch::Tensor forward(const torch::Tensor& input_ids, KVCache* cache = nullptr,
                        const std::optional<torch::Tensor>& seq_start = std::nullopt);
  /// Same from embeddings (B, T, hidden).
  torch::Tensor forward_embeds(const torch::Tensor& inputs_embeds, KVCache* cache = nullptr,
                               const std::optional<torch::Tensor>& seq_start = std::nullopt);

  /// Runs block i on h: block_runner(i, h, cache_layer_or_null, seq_start).
  using BlockRunner = std::function<torch::Tensor(int64_t, const torch::Tensor&, LayerCache*,
                                                  const std::optional<torch::Tensor>&)>;
  /// When set, forward calls it for every block instead of calling the block itself, so that a
  /// host can wrap each block call: Python runs the blocks through their nn.Module wrappers, where
  /// forward hooks (FSDP2's per-block unshard/reshard) fire. Copies (clone()) start without it:
  /// it calls back into the original's host.
  void set_block_runner(BlockRunner runner) { block_runner_.value = std::move(runner); }
  /// Context parallelism (see SequenceShard): every forward prepares `shard` for its local length,
  /// and every attention layer runs over it; null turns it off. Not with a cache or seq_start.
  void set_sequence_shard(std::shared_ptr<SequenceShard> shard);
  const std::shared_ptr<SequenceShard>& sequence_shard() const { return shard_.value; }

  ForgettingTransformerConfig config;
  torch::nn::Embedding embeddings{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};

 private:
  NotCopied<BlockRunner> block_runner_;
  NotCopied<std::shared_ptr<SequenceShard>> shard_;
};
TORCH_MODULE(ForgettingTransformerModel);

class ForgettingTransformerForCausalLMImpl
    : public torch::nn::Cloneable<ForgettingTransformerForCausalLMImpl> {
 public:
  explicit ForgettingTransformerForCausalLMImpl(const ForgettingTransformerConfig& config);
  void reset() override;
  /// The authors' init of every weight: normal(0, initializer_range) for linear and embedding
  /// weights (padding row zero), zero biases, ones for norms, gate biases from the decay times.
  void reset_parameters();

  /// Without labels: logits (B, T, vocab). With labels (B, T): the per-token cross-entropy loss
  /// (B, T), no shift (labels[t] is the target of position t, as the authors), 0 where the label
  /// is -100 (ignore index); reduced to a scalar with `reduction` "sum" or "mean" (over the
  /// tokens not ignored), whose gradients are cheaper (functional::linear_cross_entropy).
  torch::Tensor forward(const torch::Tensor& input_ids,
                        const std::optional<torch::Tensor>& labels = std::nullopt,
                        KVCache* cache = nullptr,
                        const std::optional<torch::Tensor>& seq_start = std::nullopt,
                        const std::string& reduction = "none");
  /// logits of hidden states (B, T, hidden).
  torch::Tensor logits(const torch::Tensor& hidden_states);
  /// The LM head's weight (vocab, hidden): lm_head's, or the embeddings' when they are tied.
  const torch::Tensor& lm_head_weight() const {
    return lm_head ? lm_head->weight : model->embeddings->weight;
  }
  /// The per-token loss (B, T) of hidden states (B, T, hidden) against labels (B, T), as forward
  /// with labels: under autograd through functional::linear_cross_entropy, whose backward makes
  /// the logits again chunk by chunk instead of keeping them. FOX_LOSS_CHUNK_ROWS (read at each
  /// call): 0 keeps the whole logits instead (comparisons), N > 0 takes N rows per chunk.
  torch::Tensor loss(const torch::Tensor& hidden_states, const torch::Tensor& labels,
                     const std::string& reduction = "none");
  /// A fresh, empty cache for this model.
  KVCache new_cache() const { return KVCache(config.num_hidden_layers()); }
  /// A static cache (see cache.h) for `batch` rows of up to `max_length` tokens; K and V in
  /// `dtype` (default: the dtype of the weights), the gates in `gate_dtype` (default float32),
  /// on the weights' device.
  KVCache new_static_cache(int64_t batch, int64_t max_length,
                           std::optional<torch::ScalarType> dtype = std::nullopt,
                           std::optional<torch::ScalarType> gate_dtype = std::nullopt) const;

  ForgettingTransformerConfig config;
  ForgettingTransformerModel model{nullptr};
  torch::nn::Linear lm_head{nullptr};  // null with tie_word_embeddings
};
TORCH_MODULE(ForgettingTransformerForCausalLM);

}  // namespace fox::nn
