#include <fox/nn/attention.h>

#include <algorithm>
#include <cmath>

#include <torch/nn/functional/activation.h>
#include <torch/nn/init.h>

#include <fox/nn/functional.h>
#include <fox/ops.h>

namespace fox::nn {

namespace F = torch::nn::functional;

// Rows of input up to which project_input, without autograd, keeps its weight concatenation
// (decoding steps of up to 256 sequences; a long prefill amortizes a fresh one).
constexpr int64_t kFewRows = 256;

torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& positions, double base) {
  TORCH_CHECK(x.dim() == 4, "apply_rotary: x must be (batch, seqlen, heads, head_dim), got ",
              x.sizes());
  const int64_t D = x.size(3);
  TORCH_CHECK(D % 2 == 0, "apply_rotary: head_dim must be even, got ", D);
  auto fdt = x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  auto fopt = torch::TensorOptions().dtype(fdt).device(x.device());
  auto inv_freq = torch::pow(base, -torch::arange(0, D, 2, fopt) / static_cast<double>(D));
  auto pos = positions.to(fopt);
  if (pos.dim() == 1) pos = pos.unsqueeze(0);                   // (1|B, T)
  auto freqs = pos.unsqueeze(-1) * inv_freq;                     // (1|B, T, D/2)
  auto cos = freqs.cos().unsqueeze(2), sin = freqs.sin().unsqueeze(2);  // (., T, 1, D/2)
  auto xf = x.to(fdt);
  auto x1 = xf.narrow(-1, 0, D / 2), x2 = xf.narrow(-1, D / 2, D / 2);
  return torch::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1).to(x.scalar_type());
}

ForgettingAttentionLayerImpl::ForgettingAttentionLayerImpl(
    const ForgettingAttentionLayerOptions& options_)
    : options(options_) {
  reset();
}

void ForgettingAttentionLayerImpl::reset() {
  const auto& o = options;
  const int64_t hidden = o.hidden_size(), H = o.num_heads(), Hkv = num_kv_heads();
  TORCH_CHECK(H > 0 && hidden % H == 0, "ForgettingAttentionLayer: hidden_size (", hidden,
              ") must be a positive multiple of num_heads (", H, ")");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "ForgettingAttentionLayer: num_heads (", H,
              ") must be a multiple of num_kv_heads (", Hkv, ")");
  const int64_t D = hidden / H, kv_dim = Hkv * D;
  auto lin = [](int64_t in, int64_t out, bool bias = false) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
  };
  q_proj = register_module("q_proj", lin(hidden, hidden));
  if (o.use_k_shift()) {
    k_shift_proj = register_module("k_proj", ShiftLinear(ShiftLinearOptions(hidden, kv_dim, Hkv)));
  } else {
    k_proj = register_module("k_proj", lin(hidden, kv_dim));
  }
  if (o.use_v_shift()) {
    v_shift_proj = register_module("v_proj", ShiftLinear(ShiftLinearOptions(hidden, kv_dim, Hkv)));
  } else {
    v_proj = register_module("v_proj", lin(hidden, kv_dim));
  }
  o_proj = register_module("o_proj", lin(hidden, hidden));

  const auto& ft = o.fgate_type();
  TORCH_CHECK(ft == "full" || ft == "bias_only" || ft == "fixed" || ft == "none",
              "ForgettingAttentionLayer: fgate_type must be one of full, bias_only, fixed, none; "
              "got '", ft, "'");
  TORCH_CHECK(!(ft == "full" || ft == "none") || !o.fgate_bias_init(),
              "ForgettingAttentionLayer: fgate_bias_init is only for fgate_type bias_only/fixed");
  TORCH_CHECK(ft != "fixed" || o.fgate_bias_init(),
              "ForgettingAttentionLayer: fgate_type 'fixed' requires fgate_bias_init=true");
  if (o.fgate_bias_init()) {
    TORCH_CHECK(o.decay_time_min() && o.decay_time_max() && *o.decay_time_min() > 0 &&
                    *o.decay_time_max() > 0,
                "ForgettingAttentionLayer: fgate_bias_init needs positive decay_time_min and "
                "decay_time_max");
  }
  if (ft == "full") {
    fgate_proj = register_module("fgate_proj", lin(hidden, H, /*bias=*/true));
  } else if (ft == "bias_only") {
    fgate_bias = register_parameter("fgate_bias", torch::zeros({H}));
  } else if (ft == "fixed") {
    fgate_bias = register_buffer("fgate_bias", torch::zeros({H}));
  }
  if (o.use_output_gate()) {
    TORCH_CHECK(o.ogate_act() == "sigmoid" || o.ogate_act() == "silu",
                "ForgettingAttentionLayer: ogate_act must be sigmoid or silu, got '",
                o.ogate_act(), "'");
    ogate_proj = register_module("ogate_proj", lin(hidden, hidden));
  }
  if (o.use_output_norm()) {
    output_norm = register_module(
        "output_norm", GroupRMSNorm(GroupRMSNormOptions(H, hidden).eps(o.norm_eps())));
  }
  if (o.qk_norm()) {
    if (o.qk_norm_share_param_across_head()) {
      q_norm_shared = register_module("q_norm", RMSNorm(RMSNormOptions(D).eps(o.qk_norm_eps())));
      k_norm_shared = register_module("k_norm", RMSNorm(RMSNormOptions(D).eps(o.qk_norm_eps())));
    } else {
      q_norm = register_module("q_norm", GroupRMSNorm(GroupRMSNormOptions(H, hidden)
                                                          .eps(o.qk_norm_eps())));
      k_norm = register_module("k_norm", GroupRMSNorm(GroupRMSNormOptions(Hkv, kv_dim)
                                                          .eps(o.qk_norm_eps())));
    }
  }
  reset_parameters();
}

void ForgettingAttentionLayerImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  const double std = options.initializer_range();
  for (auto& m : modules(/*include_self=*/false)) {
    if (auto* l = m->as<torch::nn::Linear>()) {
      torch::nn::init::normal_(l->weight, 0.0, std);
      if (l->bias.defined()) l->bias.zero_();
    } else if (auto* n = m->as<GroupRMSNorm>()) {
      n->reset_parameters();
    } else if (auto* n = m->as<RMSNorm>()) {
      n->reset_parameters();
    }
  }
  if (fgate_bias.defined()) {
    if (options.fgate_bias_init()) {
      const int64_t H = options.num_heads();
      auto log_t = torch::linspace(std::log(*options.decay_time_min()),
                                   std::log(*options.decay_time_max()), H, torch::kFloat64);
      // decay time t = -1 / log(sigmoid(b))  <=>  b = -log(expm1(1 / t))
      auto bias = -torch::log(torch::expm1(1.0 / torch::exp(log_t)));
      fgate_bias.copy_(bias.to(fgate_bias.scalar_type()));
    } else {
      fgate_bias.zero_();
    }
  }
}

void ForgettingAttentionLayerImpl::pretty_print(std::ostream& stream) const {
  stream << "fox::nn::ForgettingAttentionLayer(hidden_size=" << options.hidden_size()
         << ", num_heads=" << options.num_heads() << ", num_kv_heads=" << num_kv_heads()
         << ", fgate_type=" << options.fgate_type() << ")";
}

torch::Tensor ForgettingAttentionLayerImpl::log_forget_gate(const torch::Tensor& x) {
  return log_forget_gate_from(x, fgate_proj ? fgate_proj(x) : torch::Tensor());
}

torch::Tensor ForgettingAttentionLayerImpl::log_forget_gate_from(const torch::Tensor& x,
                                                                 const torch::Tensor& logits,
                                                                 const torch::Tensor& bias) {
  const int64_t B = x.size(0), T = x.size(1), H = options.num_heads();
  auto fdt = x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  const auto& ft = options.fgate_type();
  if (ft == "full") return functional::log_forget_gate(logits, bias);
  if (ft == "none") return torch::zeros({B, T, H}, x.options().dtype(fdt));
  return F::logsigmoid(fgate_bias.to(fdt)).expand({B, T, H}).contiguous();
}

namespace {

// (data_ptr, version) of every tensor a concatenation was built from: a changed parameter (an
// optimizer step, load_state_dict, .to()) invalidates it.
std::vector<std::pair<const void*, uint32_t>> sources_of(
    const std::vector<torch::nn::Linear>& linears) {
  std::vector<std::pair<const void*, uint32_t>> sources;
  for (const auto& l : linears) {
    for (const auto* t : {&l->weight, &l->bias}) {
      if (t->defined()) sources.emplace_back(t->data_ptr(), t->_version());
    }
  }
  return sources;
}

}  // namespace

ForgettingAttentionLayerImpl::ConcatenatedProjection
ForgettingAttentionLayerImpl::concatenate_projections(
    const std::vector<torch::nn::Linear>& linears, bool bias_in_gemm) const {
  ConcatenatedProjection c;
  std::vector<torch::Tensor> weights, biases;
  bool any_bias = false;
  for (const auto& l : linears) {
    weights.push_back(l->weight);
    biases.push_back(l->bias);
    c.widths.push_back(l->weight.size(0));
    any_bias = any_bias || l->bias.defined();
  }
  int64_t width = 0;
  for (auto w : c.widths) width += w;
  const int64_t padding = (64 - width % 64) % 64;
  if (padding) {
    const auto& w = weights[0];
    if (!padding_rows_.defined() || padding_rows_.size(0) != padding ||
        padding_rows_.size(1) != w.size(1) || padding_rows_.scalar_type() != w.scalar_type() ||
        padding_rows_.device() != w.device()) {
      c10::InferenceMode normal_tensor(false);  // made under inference_mode, read by training too
      padding_rows_ = torch::zeros({padding, w.size(1)}, w.options());
    }
    weights.push_back(padding_rows_);
    biases.push_back(torch::Tensor());
    c.widths.push_back(padding);
  }
  if (any_bias && !bias_in_gemm) {
    c.part_biases = std::move(biases);
  } else if (any_bias) {
    for (size_t i = 0; i < biases.size(); ++i) {
      if (!biases[i].defined()) biases[i] = torch::zeros({c.widths[i]}, weights[i].options());
    }
    c.bias = torch::cat(biases);
  }
  c.weight = torch::cat(weights);
  return c;
}

ForgettingAttentionLayerImpl::InputProjections ForgettingAttentionLayerImpl::project_input(
    const torch::Tensor& x, bool transform) {
  // One GEMM for every projection of x: the weights are concatenated (the parameters keep the
  // authors' names) and the backward of split_with_sizes is one concatenation (with `transform`,
  // attention_inputs writes the parts' gradients into one tensor instead). The wide outputs
  // come first. With autograd the concatenation is redone every call (it is part of the graph);
  // few-row inference (decoding) keeps it while the parameters are unchanged, so a decoding step
  // is one GEMV instead of one per projection. Under autograd the biases (the forget gate's) are
  // added to their parts: a bias in the GEMM would sum its gradient over the whole width
  // (0.66 ms of a 125M model's training step at 16k tokens).
  InputProjections out;
  std::vector<torch::nn::Linear> linears = {q_proj, k_shift_proj ? k_shift_proj->linear : k_proj,
                                            v_shift_proj ? v_shift_proj->linear : v_proj};
  std::vector<torch::Tensor*> targets = {&out.q, &out.k, &out.v};
  auto add = [&](const torch::nn::Linear& l, torch::Tensor* target) {
    linears.push_back(l);
    targets.push_back(target);
  };
  if (ogate_proj) add(ogate_proj, &out.ogate_logits);
  if (k_shift_proj) add(k_shift_proj->shift_proj, &out.k_shift_logits);
  if (v_shift_proj) add(v_shift_proj->shift_proj, &out.v_shift_logits);
  if (fgate_proj) add(fgate_proj, &out.fgate_logits);

  ConcatenatedProjection fresh;
  const ConcatenatedProjection* c = &fresh;
  if (x.numel() / x.size(-1) <= kFewRows && !torch::GradMode::is_enabled()) {
    auto sources = sources_of(linears);
    if (!inference_projection_.weight.defined() || inference_projection_.sources != sources ||
        inference_projection_.weight.device() != x.device()) {
      inference_projection_ = concatenate_projections(linears, true);
      inference_projection_.sources = std::move(sources);
    }
    c = &inference_projection_;
  } else {
    fresh = concatenate_projections(linears, !torch::GradMode::is_enabled());
  }
  auto y = functional::linear(x, c->weight, c->bias);
  auto has_bias = [&](size_t i) {
    return i < c->part_biases.size() && c->part_biases[i].defined();
  };
  std::vector<int64_t> first(targets.size());
  for (size_t i = 1; i < targets.size(); ++i) first[i] = first[i - 1] + c->widths[i - 1];
  auto index_of = [&](const torch::Tensor* target) {
    return int64_t(std::find(targets.begin(), targets.end(), target) - targets.begin());
  };
  const int64_t ks = k_shift_proj ? index_of(&out.k_shift_logits) : -1;
  const int64_t vs = v_shift_proj ? index_of(&out.v_shift_logits) : -1;
  // The parts the transform reads must come as they are (a bias would be added first).
  const bool whole = !(has_bias(0) || has_bias(1) || has_bias(2) || (ks >= 0 && has_bias(ks)) ||
                       (vs >= 0 && has_bias(vs)));
  std::vector<torch::Tensor> parts;
  if (transform && whole && !q_norm_shared) {
    functional::AttentionInputLayout l;
    l.q = first[0], l.k = first[1], l.v = first[2];
    l.q_width = c->widths[0], l.kv_width = c->widths[1];
    l.k_shift = ks >= 0 ? first[ks] : -1, l.v_shift = vs >= 0 ? first[vs] : -1;
    l.shift_heads = ks >= 0 ? c->widths[ks] : vs >= 0 ? c->widths[vs] : 0;
    l.q_group = l.k_group = q_norm ? head_dim() : 0;
    l.norm_eps = options.qk_norm_eps();
    for (size_t i = 3; i < targets.size(); ++i) {
      if (int64_t(i) != ks && int64_t(i) != vs) l.passed.emplace_back(first[i], c->widths[i]);
    }
    auto outs = functional::attention_inputs(y, l, q_norm ? q_norm->weight : torch::Tensor(),
                                             k_norm ? k_norm->weight : torch::Tensor());
    parts.assign(targets.size(), torch::Tensor());
    parts[0] = outs[0], parts[1] = outs[1], parts[2] = outs[2];
    for (size_t i = 3, j = 3; i < targets.size(); ++i) {
      if (int64_t(i) != ks && int64_t(i) != vs) parts[i] = outs[j++];
    }
    out.transformed = true;
  } else {
    parts = y.split_with_sizes(c->widths, -1);
  }
  for (size_t i = 0; i < targets.size(); ++i) {
    *targets[i] = parts[i];
    if (!has_bias(i)) continue;
    if (targets[i] == &out.fgate_logits) out.fgate_bias = c->part_biases[i];
    else *targets[i] = parts[i] + c->part_biases[i].to(parts[i].scalar_type());
  }
  return out;
}

namespace {
// The KV-shift of a context-parallel shard: every local piece starts from the token before it,
// which another rank may hold.
torch::Tensor shard_shift_mix(const torch::Tensor& projected, const torch::Tensor& logits,
                              const SequenceShard& shard) {
  auto first = shard.previous_tokens(projected);  // (B, pieces, C)
  std::vector<torch::Tensor> pieces;
  int64_t offset = 0;
  for (size_t i = 0; i < shard.piece_lengths.size(); ++i) {
    const int64_t n = shard.piece_lengths[i];
    pieces.push_back(functional::shift_mix(projected.narrow(1, offset, n),
                                           logits.narrow(1, offset, n),
                                           first.select(1, static_cast<int64_t>(i))));
    offset += n;
  }
  TORCH_CHECK(offset == projected.size(1), "ForgettingAttentionLayer: the SequenceShard's pieces "
              "cover ", offset, " tokens, the input has ", projected.size(1));
  return pieces.size() == 1 ? pieces[0] : torch::cat(pieces, 1);
}
}  // namespace

torch::Tensor ForgettingAttentionLayerImpl::forward(const torch::Tensor& x_in, LayerCache* cache,
                                                    const std::optional<torch::Tensor>& seq_start) {
  const auto& o = options;
  TORCH_CHECK(x_in.dim() == 3 && x_in.size(2) == o.hidden_size(),
              "ForgettingAttentionLayer: x must be (batch, seqlen, ", o.hidden_size(), "), got ",
              x_in.sizes());
  const int64_t B = x_in.size(0), T = x_in.size(1), H = o.num_heads(), Hkv = num_kv_heads();
  const int64_t D = head_dim();
  TORCH_CHECK(T > 0, "ForgettingAttentionLayer: empty sequence");
  const SequenceShard* shard = shard_.value.get();
  TORCH_CHECK(!shard || (!cache && !(seq_start.has_value() && seq_start->defined())),
              "ForgettingAttentionLayer: a context-parallel forward takes neither a cache nor "
              "seq_start");
  TORCH_CHECK(!shard || (shard->positions.defined() && shard->positions.numel() == T),
              "ForgettingAttentionLayer: the SequenceShard was prepared for ",
              shard && shard->positions.defined() ? shard->positions.numel() : 0,
              " tokens, the input has ", T);
  // Positions of the new tokens: (T,) after a dynamic cache or in a context-parallel shard, (B, T)
  // per row in a static cache. Made only where read (RoPE, seq_start): a layer's launch costs the
  // host more than the GPU, and a training step's forward waits on the host.
  const bool static_cache = cache && cache->is_static();
  const int64_t offset = cache && !static_cache ? cache->length() : 0;
  const bool need_positions = o.use_rope() || (seq_start.has_value() && seq_start->defined());
  auto positions = static_cache ? cache->positions
                   : shard      ? shard->positions
                   : need_positions
                       ? torch::arange(offset, offset + T, x_in.options().dtype(torch::kLong))
                       : torch::Tensor();

  std::optional<torch::Tensor> start;
  auto x = x_in;
  if (seq_start.has_value() && seq_start->defined()) {
    TORCH_CHECK(seq_start->dim() == 1 && seq_start->size(0) == B,
                "ForgettingAttentionLayer: seq_start must be (", B, ",), got ",
                seq_start->sizes());
    start = seq_start->to(x.device(), torch::kLong);
    // Padded positions contribute nothing, not even through the KV-shift of the first real token.
    auto valid = (positions.dim() == 1 ? positions.unsqueeze(0) : positions) >=
                 start->unsqueeze(1);  // (B, T)
    x = x * valid.unsqueeze(-1).to(x.scalar_type());
  }

  // Without a cache or a shard the KV-shifts start from zeros: project_input applies them and the
  // norms (one autograd node for the layer's whole input side).
  auto p = project_input(x, /*transform=*/!cache && !shard);
  auto shifted = [&](ShiftLinear& shift, const torch::Tensor& projected,
                     const torch::Tensor& logits, torch::Tensor* state) {
    // A static cache's state is updated in place (one kernel with the mix in a decoding step).
    if (static_cache && state->defined())
      return functional::shift_mix_update(projected, logits, *state);
    if (shard) return shard_shift_mix(projected, logits, *shard);
    std::optional<torch::Tensor> prev;
    if (cache && state->defined()) prev = *state;
    auto [out, last] = shift->shift(projected, logits, prev);
    if (cache) cache->set_state(*state, last);
    return out;
  };
  auto q = p.q;
  auto k = k_shift_proj && !p.transformed
               ? shifted(k_shift_proj, p.k, p.k_shift_logits, cache ? &cache->key_shift : nullptr)
               : p.k;
  auto v = v_shift_proj && !p.transformed
               ? shifted(v_shift_proj, p.v, p.v_shift_logits, cache ? &cache->value_shift : nullptr)
               : p.v;
  if (q_norm && !p.transformed) {
    q = q_norm(q);
    k = k_norm(k);
  }
  q = q.view({B, T, H, D});
  k = k.view({B, T, Hkv, D});
  v = v.view({B, T, Hkv, D});
  if (q_norm_shared) {
    q = q_norm_shared(q);
    k = k_norm_shared(k);
  }
  if (o.use_rope()) {
    q = apply_rotary(q, positions, o.rope_base());
    k = apply_rotary(k, positions, o.rope_base());
  }
  torch::Tensor log_fgate;  // (B, T, H) fp32 (fp64 models: fp64)
  if (static_cache && o.fgate_type() == "full") {
    // The log-sigmoid of the gate logits is computed while they are written to the cache.
    auto logits = p.fgate_bias.defined()
                      ? p.fgate_logits + p.fgate_bias.to(p.fgate_logits.scalar_type())
                      : p.fgate_logits;
    std::tie(k, v, log_fgate) = cache->update_from_gate_logits(k, v, logits);
  } else {
    log_fgate = log_forget_gate_from(x, p.fgate_logits, p.fgate_bias);
    if (cache) std::tie(k, v, log_fgate) = cache->update(k, v, log_fgate);
  }
  // The pruning threshold's log(Tk) is that of the whole sequence under context parallelism.
  const int64_t Tk = shard ? shard->sequence_length : k.size(1);

  AttentionOptions aopts;
  const double sm_scale = 1.0 / std::sqrt(static_cast<double>(D));
  aopts.sm_scale(sm_scale);
  if (start) aopts.seq_start(*start);
  if (static_cache) aopts.cache_seqlens(cache->seqlens);
  if (o.log_pruning_tolerance()) {
    torch::NoGradGuard no_grad;
    double bound;
    if (o.qk_norm()) {
      // |scale q.k| <= max|w_q| max|w_k| D scale = max|w_q| max|w_k| sqrt(D)
      auto wq = q_norm ? q_norm->weight : q_norm_shared->weight;
      auto wk = k_norm ? k_norm->weight : k_norm_shared->weight;
      bound = (wq.abs().max() * wk.abs().max()).item<double>() * std::sqrt(double(D));
    } else {
      auto qn = torch::linalg_vector_norm(q.to(torch::kFloat32), 2, {-1}).max();
      auto kn = torch::linalg_vector_norm(k.to(torch::kFloat32), 2, {-1}).max();
      bound = (qn * kn).item<double>() / std::sqrt(double(D));
    }
    aopts.adaptive_threshold(-(2 * bound + std::log(double(Tk))) + *o.log_pruning_tolerance());
  }
  auto out = shard ? shard->attention(q, k, v, log_fgate, sm_scale, aopts.adaptive_threshold())
                   : fox::forgetting_attention(q, k, v, log_fgate, aopts);  // (B, T, H, D)
  out = out.reshape({B, T, H * D});
  if (output_norm) out = output_norm(out);
  // The gated output is not kept for the backward (gated_linear computes it again there).
  if (ogate_proj)
    return functional::gated_linear(p.ogate_logits, out, o.ogate_act(), o_proj->weight,
                                    o_proj->bias);
  return functional::linear(out, o_proj->weight, o_proj->bias);
}

}  // namespace fox::nn
