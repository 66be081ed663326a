#include <fox/nn/generation.h>

#include <limits>

namespace fox::nn {

torch::Tensor sample_next_token(const torch::Tensor& logits_in, const GenerationOptions& o) {
  TORCH_CHECK(logits_in.dim() == 2, "sample_next_token: logits must be (batch, vocab), got ",
              logits_in.sizes());
  if (!o.do_sample() || o.temperature() <= 0) return logits_in.argmax(-1);
  auto logits = logits_in.to(torch::kFloat32) / o.temperature();
  const double neg_inf = -std::numeric_limits<double>::infinity();
  const int64_t V = logits.size(-1);
  if (o.top_k() > 0 && o.top_k() < V) {
    auto kth = std::get<0>(logits.topk(o.top_k(), -1)).narrow(-1, o.top_k() - 1, 1);
    logits = logits.masked_fill(logits < kth, neg_inf);
  }
  if (o.top_p() < 1.0) {
    auto [sorted, idx] = logits.sort(-1, /*descending=*/true);
    auto probs = sorted.softmax(-1);
    // Drop a token when the tokens before it already reach top_p (the first one always stays).
    auto remove = (probs.cumsum(-1) - probs) >= o.top_p();
    auto mask = torch::zeros_like(remove).scatter(-1, idx, remove);
    logits = logits.masked_fill(mask, neg_inf);
  }
  return torch::multinomial(logits.softmax(-1), 1).squeeze(-1);
}

torch::Tensor generate(ForgettingTransformerForCausalLM& model, const torch::Tensor& input_ids,
                       const GenerationOptions& o) {
  TORCH_CHECK(input_ids.dim() == 2 && input_ids.size(1) > 0,
              "generate: input_ids must be a non-empty (batch, seqlen) tensor, got ",
              input_ids.sizes());
  torch::NoGradGuard no_grad;
  const auto& cfg = model->config;
  std::vector<int64_t> stops = o.stop_tokens();
  if (stops.empty() && cfg.eos_token_id()) stops.push_back(*cfg.eos_token_id());
  const int64_t pad = o.pad_token_id().value_or(cfg.pad_token_id().value_or(0));
  const int64_t B = input_ids.size(0), T = input_ids.size(1);

  KVCache cache = model->new_cache();
  std::optional<torch::Tensor> seq_start;
  if (o.seq_start() && o.seq_start()->defined()) seq_start = o.seq_start();
  const int64_t chunk = o.prefill_chunk_size() > 0 ? o.prefill_chunk_size() : T;
  torch::Tensor logits;
  for (int64_t s = 0; s < T; s += chunk) {
    auto ids = input_ids.narrow(1, s, std::min(chunk, T - s));
    logits = model->forward(ids, std::nullopt, &cache, seq_start);
  }
  std::vector<torch::Tensor> out{input_ids};
  auto finished = torch::zeros({B}, input_ids.options().dtype(torch::kBool));
  auto stop_t = torch::tensor(stops, torch::kLong).to(input_ids.device());
  for (int64_t step = 0; step < o.max_new_tokens(); ++step) {
    auto next = sample_next_token(logits.select(1, logits.size(1) - 1), o).to(torch::kLong);
    next = torch::where(finished, torch::full_like(next, pad), next);
    out.push_back(next.unsqueeze(1).to(input_ids.scalar_type()));
    if (!stops.empty()) finished = finished | torch::isin(next, stop_t);
    if (step + 1 == o.max_new_tokens() || finished.all().item<bool>()) break;
    logits = model->forward(next.unsqueeze(1).to(input_ids.scalar_type()), std::nullopt, &cache);
  }
  return torch::cat(out, 1);
}

}  // namespace fox::nn
