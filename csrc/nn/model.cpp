#include <fox/nn/model.h>

#include <cstdlib>
#include <string>

#include <torch/nn/functional/linear.h>
#include <torch/nn/init.h>

#include <fox/nn/functional.h>

namespace fox::nn {

// ---- config -------------------------------------------------------------------------------------

namespace {
void set_pro(ForgettingTransformerConfig& c, bool pro) {
  c.qk_norm(pro).use_output_gate(pro).use_output_norm(pro).use_k_shift(pro).use_v_shift(pro);
  c.hidden_ratio(pro ? 3.5 : 4.0);
  c.qk_norm_share_param_across_head(false);
}
void set_fox(ForgettingTransformerConfig& c, bool fox) {
  c.fgate_type(fox ? "full" : "none").use_rope(!fox).fgate_bias_init(false);
  c.decay_time_min(std::nullopt).decay_time_max(std::nullopt);
}
}  // namespace

ForgettingTransformerConfig& ForgettingTransformerConfig::fox_llama() {
  set_fox(*this, true);
  set_pro(*this, false);
  return *this;
}
ForgettingTransformerConfig& ForgettingTransformerConfig::fox_pro() {
  set_fox(*this, true);
  set_pro(*this, true);
  return *this;
}
ForgettingTransformerConfig& ForgettingTransformerConfig::transformer_llama() {
  set_fox(*this, false);
  set_pro(*this, false);
  return *this;
}
ForgettingTransformerConfig& ForgettingTransformerConfig::transformer_pro() {
  set_fox(*this, false);
  set_pro(*this, true);
  return *this;
}

ForgettingTransformerConfig ForgettingTransformerConfig::preset(
    const std::string& architecture) const {
  ForgettingTransformerConfig c = *this;
  if (architecture == "fox_llama") return c.fox_llama();
  if (architecture == "fox_pro") return c.fox_pro();
  if (architecture == "transformer_llama") return c.transformer_llama();
  if (architecture == "transformer_pro") return c.transformer_pro();
  TORCH_CHECK(false, "ForgettingTransformerConfig::preset: unknown architecture '", architecture,
              "' (expected fox_llama, fox_pro, transformer_llama or transformer_pro)");
}

ForgettingAttentionLayerOptions ForgettingTransformerConfig::attention_options() const {
  return ForgettingAttentionLayerOptions(hidden_size(), num_heads())
      .num_kv_heads(num_kv_heads())
      .use_rope(use_rope())
      .rope_base(rope_base())
      .use_output_gate(use_output_gate())
      .ogate_act(ogate_act())
      .fgate_type(fgate_type())
      .fgate_bias_init(fgate_bias_init())
      .decay_time_min(decay_time_min())
      .decay_time_max(decay_time_max())
      .use_output_norm(use_output_norm())
      .norm_eps(norm_eps())
      .qk_norm(qk_norm())
      .qk_norm_share_param_across_head(qk_norm_share_param_across_head())
      .use_k_shift(use_k_shift())
      .use_v_shift(use_v_shift())
      .log_pruning_tolerance(log_pruning_tolerance())
      .initializer_range(initializer_range());
}

GatedMLPOptions ForgettingTransformerConfig::mlp_options() const {
  return GatedMLPOptions(hidden_size())
      .hidden_ratio(hidden_ratio())
      .intermediate_size(intermediate_size())
      .hidden_act(hidden_act())
      .initializer_range(initializer_range());
}

// ---- block --------------------------------------------------------------------------------------

ForgettingTransformerBlockImpl::ForgettingTransformerBlockImpl(
    const ForgettingTransformerConfig& config_)
    : config(config_) {
  reset();
}

void ForgettingTransformerBlockImpl::reset() {
  auto norm_opts = RMSNormOptions(config.hidden_size()).eps(config.norm_eps());
  attn_norm = register_module("attn_norm", RMSNorm(norm_opts));
  attn = register_module("attn", ForgettingAttentionLayer(config.attention_options()));
  mlp_norm = register_module("mlp_norm", RMSNorm(norm_opts));
  mlp = register_module("mlp", GatedMLP(config.mlp_options()));
}

torch::Tensor ForgettingTransformerBlockImpl::forward(
    const torch::Tensor& x, LayerCache* cache, const std::optional<torch::Tensor>& seq_start) {
  // The residual adds are fused into the next norm and into the MLP's last projection.
  auto [h, normed] = functional::add_rms_norm(x, attn->forward(attn_norm(x), cache, seq_start),
                                              mlp_norm->weight, mlp_norm->options.eps());
  return mlp->forward_with_residual(normed, h);
}

std::pair<torch::Tensor, torch::Tensor> ForgettingTransformerBlockImpl::forward_deferred(
    const torch::Tensor& x_in, const torch::Tensor& pending,
    const std::optional<torch::Tensor>& seq_start) {
  torch::Tensor x = x_in, normed;
  if (pending.defined())
    std::tie(x, normed) = functional::add_rms_norm(x_in, pending, attn_norm->weight,
                                                   attn_norm->options.eps());
  else
    normed = attn_norm(x_in);
  auto [h, mlp_in] = functional::add_rms_norm(x, attn->forward(normed, nullptr, seq_start),
                                              mlp_norm->weight, mlp_norm->options.eps());
  return {h, mlp->forward(mlp_in)};
}

// ---- decoder ------------------------------------------------------------------------------------

ForgettingTransformerModelImpl::ForgettingTransformerModelImpl(
    const ForgettingTransformerConfig& config_)
    : config(config_) {
  reset();
}

void ForgettingTransformerModelImpl::reset() {
  auto eopts = torch::nn::EmbeddingOptions(config.vocab_size(), config.hidden_size());
  if (config.pad_token_id()) eopts.padding_idx(*config.pad_token_id());
  embeddings = register_module("embeddings", torch::nn::Embedding(eopts));
  {
    torch::NoGradGuard no_grad;
    torch::nn::init::normal_(embeddings->weight, 0.0, config.initializer_range());
    if (config.pad_token_id()) embeddings->weight[*config.pad_token_id()].zero_();
  }
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.num_hidden_layers(); ++i) {
    layers->push_back(ForgettingTransformerBlock(config));
  }
  norm = register_module("norm", RMSNorm(RMSNormOptions(config.hidden_size())
                                             .eps(config.norm_eps())));
}

torch::Tensor ForgettingTransformerModelImpl::forward(const torch::Tensor& input_ids,
                                                      KVCache* cache,
                                                      const std::optional<torch::Tensor>& seq_start) {
  TORCH_CHECK(input_ids.dim() == 2, "ForgettingTransformerModel: input_ids must be (batch, seqlen), got ",
              input_ids.sizes());
  return forward_embeds(
      functional::embedding(input_ids, embeddings->weight, embeddings->options.padding_idx()),
      cache, seq_start);
}

void ForgettingTransformerModelImpl::set_sequence_shard(std::shared_ptr<SequenceShard> shard) {
  TORCH_CHECK(!shard || (shard->prepare && shard->previous_tokens && shard->attention),
              "ForgettingTransformerModel: a SequenceShard needs prepare, previous_tokens and "
              "attention");
  for (const auto& m : layers->children())
    m->as<ForgettingTransformerBlockImpl>()->attn->set_sequence_shard(shard);
  shard_.value = std::move(shard);
}

torch::Tensor ForgettingTransformerModelImpl::forward_embeds(
    const torch::Tensor& inputs_embeds, KVCache* cache,
    const std::optional<torch::Tensor>& seq_start) {
  std::optional<torch::Tensor> start;
  // On the embeddings' device and as int64 once, here: a copy inside every layer would be a
  // host-to-device copy in each decoding step (not allowed while a CUDA graph captures it).
  if (seq_start.has_value() && seq_start->defined())
    start = seq_start->to(inputs_embeds.device(), torch::kLong);
  if (cache) {
    if (cache->layers.size() != layers->size()) {
      TORCH_CHECK(cache->length() == 0, "KVCache has ", cache->layers.size(),
                  " layers, the model ", layers->size());
      cache->layers.resize(layers->size());
    }
    if (start && !cache->seq_start) cache->seq_start = *start;
    if (!start && cache->seq_start) start = cache->seq_start;
  }
  const int64_t T = inputs_embeds.size(1);
  if (auto* shard = shard_.value.get()) {
    TORCH_CHECK(!cache && !start, "ForgettingTransformerModel: a context-parallel forward takes "
                "neither a cache nor seq_start");
    shard->prepare(shard, T, inputs_embeds.device());  // a pointer: Python fills this object
  }
  if (cache) cache->begin_update(T);
  auto h = inputs_embeds;
  if (!cache && !block_runner_.value) {
    // Training and whole-sequence forwards: each block's MLP branch is added to the stream inside
    // the next norm (forward_deferred). With a cache the blocks keep the add in the MLP's down
    // projection (one GEMV with it in a decoding step); a block runner calls whole blocks.
    torch::Tensor pending;
    for (size_t i = 0; i < layers->size(); ++i) {
      auto* block = layers[i]->as<ForgettingTransformerBlockImpl>();
      std::tie(h, pending) = block->forward_deferred(h, pending, start);
    }
    if (pending.defined())
      return functional::add_rms_norm(h, pending, norm->weight, norm->options.eps()).second;
    return norm(h);
  }
  for (size_t i = 0; i < layers->size(); ++i) {
    auto* layer_cache = cache ? &cache->layers[i] : nullptr;
    auto* block = layers[i]->as<ForgettingTransformerBlockImpl>();
    h = block_runner_.value ? block_runner_.value(static_cast<int64_t>(i), h, layer_cache, start)
                         : block->forward(h, layer_cache, start);
  }
  if (cache) cache->finish_update(T);
  return norm(h);
}

// ---- causal LM ----------------------------------------------------------------------------------

ForgettingTransformerForCausalLMImpl::ForgettingTransformerForCausalLMImpl(
    const ForgettingTransformerConfig& config_)
    : config(config_) {
  reset();
}

void ForgettingTransformerForCausalLMImpl::reset() {
  model = register_module("model", ForgettingTransformerModel(config));
  if (!config.tie_word_embeddings()) {
    lm_head = register_module(
        "lm_head", torch::nn::Linear(torch::nn::LinearOptions(config.hidden_size(),
                                                              config.vocab_size())
                                         .bias(false)));
  }
  reset_parameters();
}

void ForgettingTransformerForCausalLMImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  const double std = config.initializer_range();
  torch::nn::init::normal_(model->embeddings->weight, 0.0, std);
  if (config.pad_token_id()) model->embeddings->weight[*config.pad_token_id()].zero_();
  for (auto& m : model->layers->children()) {
    auto* block = m->as<ForgettingTransformerBlockImpl>();
    block->attn_norm->reset_parameters();
    block->mlp_norm->reset_parameters();
    block->attn->reset_parameters();
    block->mlp->reset_parameters();
  }
  model->norm->reset_parameters();
  if (lm_head) torch::nn::init::normal_(lm_head->weight, 0.0, std);
}

KVCache ForgettingTransformerForCausalLMImpl::new_static_cache(
    int64_t batch, int64_t max_length, std::optional<torch::ScalarType> dtype,
    std::optional<torch::ScalarType> gate_dtype) const {
  std::vector<LayerCacheShape> shapes;
  for (const auto& m : model->layers->children()) {
    const auto& attn = m->as<ForgettingTransformerBlockImpl>()->attn;
    LayerCacheShape sh;
    sh.num_heads = attn->options.num_heads();
    sh.num_kv_heads = attn->num_kv_heads();
    sh.head_dim = attn->head_dim();
    sh.key_shift = static_cast<bool>(attn->k_shift_proj);
    sh.value_shift = static_cast<bool>(attn->v_shift_proj);
    shapes.push_back(sh);
  }
  const auto& w = model->embeddings->weight;
  return KVCache::allocate(shapes, batch, max_length, dtype.value_or(w.scalar_type()), w.device(),
                           gate_dtype);
}

torch::Tensor ForgettingTransformerForCausalLMImpl::logits(const torch::Tensor& hidden_states) {
  return functional::logits(hidden_states, lm_head_weight());
}

torch::Tensor ForgettingTransformerForCausalLMImpl::forward(
    const torch::Tensor& input_ids, const std::optional<torch::Tensor>& labels, KVCache* cache,
    const std::optional<torch::Tensor>& seq_start, const std::string& reduction) {
  functional::check_loss_reduction(reduction, "ForgettingTransformerForCausalLM");
  auto hidden = model->forward(input_ids, cache, seq_start);
  if (!labels.has_value() || !labels->defined()) return logits(hidden);
  TORCH_CHECK(labels->sizes() == input_ids.sizes(), "ForgettingTransformerForCausalLM: labels ",
              labels->sizes(), " must have the shape of input_ids ", input_ids.sizes());
  return loss(hidden, *labels, reduction);
}

torch::Tensor ForgettingTransformerForCausalLMImpl::loss(const torch::Tensor& hidden_states,
                                                         const torch::Tensor& labels,
                                                         const std::string& reduction) {
  const auto& weight = lm_head_weight();
  auto targets = labels.to(hidden_states.device(), torch::kLong);
  // FOX_LOSS_CHUNK_ROWS (read at each call): 0 keeps the whole logits for the backward (for
  // comparisons), N > 0 makes them N rows at a time; unset, chunks of about 256 MiB.
  int64_t chunk_rows = 0;
  if (const char* v = std::getenv("FOX_LOSS_CHUNK_ROWS"); v != nullptr && *v != '\0') {
    char* end = nullptr;
    chunk_rows = std::strtoll(v, &end, 10);
    TORCH_CHECK(*end == '\0' && chunk_rows >= 0, "FOX_LOSS_CHUNK_ROWS must be a count >= 0, got '",
                v, "'");
    if (chunk_rows == 0) {
      auto per_token = functional::cross_entropy(logits(hidden_states), targets, -100);
      return functional::reduce_loss(per_token, targets, -100, reduction);
    }
  }
  return functional::linear_cross_entropy(hidden_states, weight, targets, -100, chunk_rows,
                                          reduction);
}

}  // namespace fox::nn
