#include <fox/nn/generation.h>

#include <fox/nn/functional.h>

#include <ATen/autocast_mode.h>

#include <algorithm>
#include <limits>

#ifdef FOX_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fox::nn {

torch::Tensor sample_next_token(const torch::Tensor& logits_in, const GenerationOptions& o) {
  TORCH_CHECK(logits_in.dim() == 2, "sample_next_token: logits must be (batch, vocab), got ",
              logits_in.sizes());
  if (!o.do_sample() || o.temperature() <= 0) return functional::argmax(logits_in);
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
  // Gumbel-max: argmax(logits + G), G = -log(-log U), is a draw from softmax(logits).
  auto u = torch::rand_like(logits).clamp_min_(std::numeric_limits<float>::min());
  return functional::argmax(logits - torch::log(-torch::log(u)));
}

// ---- GenerationSession --------------------------------------------------------------------------

struct GenerationSession::Graph {
#ifdef FOX_WITH_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif
  bool enabled = false;
};

namespace {

std::vector<int64_t> stop_tokens_of(const ForgettingTransformerForCausalLM& model,
                                    const GenerationOptions& o) {
  std::vector<int64_t> stops = o.stop_tokens();
  if (stops.empty() && model->config.eos_token_id()) stops.push_back(*model->config.eos_token_id());
  return stops;
}

int64_t pad_id_of(const ForgettingTransformerForCausalLM& model, const GenerationOptions& o) {
  return o.pad_token_id().value_or(model->config.pad_token_id().value_or(0));
}

}  // namespace

GenerationSession::GenerationSession(ForgettingTransformerForCausalLM model,
                                     const torch::Tensor& input_ids,
                                     const GenerationOptions& options)
    : model_(std::move(model)), options_(options), input_ids_(input_ids),
      graph_(std::make_unique<Graph>()) {
  TORCH_CHECK(input_ids.dim() == 2 && input_ids.size(1) > 0,
              "generate: input_ids must be a non-empty (batch, seqlen) tensor, got ",
              input_ids.sizes());
  TORCH_CHECK(options.max_new_tokens() >= 0, "generate: max_new_tokens must be >= 0, got ",
              options.max_new_tokens());
  const int64_t B = input_ids.size(0), T = input_ids.size(1);
  const int64_t max_length =
      options.max_length() > 0 ? options.max_length()
                               : T + std::max<int64_t>(options.max_new_tokens(), 1);
  TORCH_CHECK(T <= max_length, "generate: the prompt (", T, " tokens) is longer than max_length (",
              max_length, ")");
  if (options.prompt_lengths() && options.prompt_lengths()->defined()) {
    const auto& lengths = *options.prompt_lengths();
    TORCH_CHECK(!(options.seq_start() && options.seq_start()->defined()),
                "generate: give either prompt_lengths (right padding) or seq_start (left padding)");
    TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == B, "generate: prompt_lengths must be (",
                B, ",), got ", lengths.sizes());
    const auto host = lengths.to(torch::kCPU, torch::kLong);
    const int64_t lo = host.min().item<int64_t>(), hi = host.max().item<int64_t>();
    TORCH_CHECK(lo >= 1 && hi <= T, "generate: prompt_lengths must lie in [1, ", T,
                "] (the prompt's length), got min ", lo, " max ", hi);
  }
  const auto& weight = model_->model->embeddings->weight;
  const auto device = weight.device();
  // A float32 model under autocast computes K and V in the autocast dtype: the cache keeps them
  // so (half the bytes, the decoding kernel, no conversion per step).
  std::optional<torch::ScalarType> cache_dtype;
  if (weight.scalar_type() == torch::kFloat32 && at::autocast::is_autocast_enabled(device.type()))
    cache_dtype = at::autocast::get_autocast_dtype(device.type());
  cache_ = model_->new_static_cache(B, max_length, cache_dtype, options.gate_cache_dtype());
  const auto long_opts = torch::TensorOptions().dtype(torch::kLong).device(device);
  tokens_ = torch::zeros({B}, long_opts);
  finished_ = torch::zeros({B}, long_opts.dtype(torch::kBool));
  stop_tokens_ = torch::tensor(stop_tokens_of(model_, options), torch::kLong).to(device);
  pad_id_ = pad_id_of(model_, options);
  pad_ = torch::full({}, pad_id_, long_opts);
  vocab_ = model_->lm_head_weight().size(0);
  head_weight_ = functional::aligned_head_weight(model_->lm_head_weight());
#ifdef FOX_WITH_CUDA
  graph_->enabled = options.cuda_graph() && device.is_cuda() &&
                    !model_->config.log_pruning_tolerance().has_value();
#endif
}

GenerationSession::~GenerationSession() = default;

bool GenerationSession::uses_cuda_graph() const { return graph_->enabled; }

int64_t GenerationSession::steps_left() const { return cache_.max_length - cache_.length_bound; }

torch::Tensor GenerationSession::select_next(const torch::Tensor& logits) {
  auto next = sample_next_token(logits, options_).to(torch::kLong);
  next = torch::where(finished_, pad_, next);  // rows that have stopped emit padding
  if (stop_tokens_.numel() > 0)
    finished_.logical_or_((next.unsqueeze(1) == stop_tokens_.unsqueeze(0)).any(1));
  tokens_.copy_(next);
  return tokens_;
}

torch::Tensor GenerationSession::logits_of(const torch::Tensor& hidden) {
  if (head_weight_.size(0) == vocab_) return model_->logits(hidden);
  return functional::linear(hidden, head_weight_).narrow(-1, 0, vocab_);  // strided rows
}

torch::Tensor GenerationSession::prefill() {
  TORCH_CHECK(!prefilled_, "GenerationSession: prefill() runs once");
  torch::NoGradGuard no_grad;
  const int64_t T = input_ids_.size(1);
  const int64_t chunk = options_.prefill_chunk_size() > 0 ? options_.prefill_chunk_size() : T;
  const auto ids = input_ids_.to(cache_.lengths.device(), torch::kLong);
  // Only each row's last position takes the LM head: a chunk's whole logits would be chunk x
  // vocab of memory and of GEMM (3.3 GB at 32k tokens of a 50k vocabulary) for one row's use.
  auto last_row = [](const torch::Tensor& hidden) { return hidden.select(1, hidden.size(1) - 1); };
  torch::Tensor last_logits;  // (B, vocab)
  if (options_.prompt_lengths() && options_.prompt_lengths()->defined()) {
    // Prompts of different lengths: each row is prefilled alone into its rows of the cache.
    const auto lengths = options_.prompt_lengths()->to(torch::kCPU, torch::kLong);
    std::vector<torch::Tensor> rows;
    int64_t longest = 0;
    for (int64_t b = 0; b < ids.size(0); ++b) {
      const int64_t n = lengths[b].item<int64_t>();
      longest = std::max(longest, n);
      KVCache row = cache_.row(b);
      torch::Tensor hidden;
      for (int64_t s = 0; s < n; s += chunk)
        hidden = model_->model->forward(ids.narrow(0, b, 1).narrow(1, s, std::min(chunk, n - s)),
                                        &row, std::nullopt);
      rows.push_back(last_row(hidden));
    }
    cache_.length_bound = longest;
    last_logits = logits_of(torch::cat(rows));
  } else {
    std::optional<torch::Tensor> seq_start;
    if (options_.seq_start() && options_.seq_start()->defined()) seq_start = options_.seq_start();
    torch::Tensor hidden;
    for (int64_t s = 0; s < T; s += chunk)
      hidden = model_->model->forward(ids.narrow(1, s, std::min(chunk, T - s)), &cache_, seq_start);
    last_logits = logits_of(last_row(hidden));
  }
  prefilled_ = true;
  return select_next(last_logits).clone();
}

void GenerationSession::decode_step() {
  auto hidden = model_->model->forward(tokens_.unsqueeze(1), &cache_, std::nullopt);  // (B, 1, C)
  select_next(logits_of(hidden.select(1, 0)));
}

torch::Tensor GenerationSession::step() {
  TORCH_CHECK(prefilled_, "GenerationSession: call prefill() before step()");
  TORCH_CHECK(steps_left() > 0, "GenerationSession: the cache is full (max_length ",
              cache_.max_length, " tokens per row); allocate a larger max_length");
  torch::NoGradGuard no_grad;
#ifdef FOX_WITH_CUDA
  if (graph_->enabled) {
    if (!graph_->graph) {
      // This step runs eagerly on a side stream (it warms up cuBLAS and the kernels' one-time
      // setup there), then the same body is captured; capturing runs nothing, so the host's
      // bound of the lengths is put back afterwards.
      auto current = c10::cuda::getCurrentCUDAStream();
      auto side = c10::cuda::getStreamFromPool();
      at::cuda::CUDAEvent ready;
      ready.record(current);
      ready.block(side);
      graph_->graph = std::make_unique<at::cuda::CUDAGraph>();
      {
        c10::cuda::CUDAStreamGuard guard(side);
        decode_step();
        const int64_t bound = cache_.length_bound;
        graph_->graph->capture_begin();
        decode_step();
        graph_->graph->capture_end();
        cache_.length_bound = bound;
      }
      at::cuda::CUDAEvent done;
      done.record(side);
      done.block(current);
      return tokens_.clone();
    }
    graph_->graph->replay();
    cache_.length_bound += 1;
    return tokens_.clone();
  }
#endif
  decode_step();
  return tokens_.clone();
}

// ---- generate -----------------------------------------------------------------------------------

namespace {

// The growing-cache path (static_cache(false)).
torch::Tensor generate_dynamic(ForgettingTransformerForCausalLM& model,
                               const torch::Tensor& input_ids, const GenerationOptions& o) {
  TORCH_CHECK(!(o.prompt_lengths() && o.prompt_lengths()->defined()),
              "generate: prompt_lengths needs the static cache (static_cache(true))");
  const std::vector<int64_t> stops = stop_tokens_of(model, o);
  const int64_t pad = pad_id_of(model, o);
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
    if (o.on_tokens()) o.on_tokens()(next);
    if (!stops.empty()) finished = finished | torch::isin(next, stop_t);
    if (step + 1 == o.max_new_tokens() || finished.all().item<bool>()) break;
    logits = model->forward(next.unsqueeze(1).to(input_ids.scalar_type()), std::nullopt, &cache);
  }
  return torch::cat(out, 1);
}

}  // namespace

torch::Tensor generate(ForgettingTransformerForCausalLM& model, const torch::Tensor& input_ids,
                       const GenerationOptions& o) {
  TORCH_CHECK(input_ids.dim() == 2 && input_ids.size(1) > 0,
              "generate: input_ids must be a non-empty (batch, seqlen) tensor, got ",
              input_ids.sizes());
  torch::NoGradGuard no_grad;
  if (!o.static_cache()) return generate_dynamic(model, input_ids, o);
  if (o.max_new_tokens() == 0) return input_ids.clone();
  GenerationSession session(model, input_ids, o);
  const bool has_stops = !stop_tokens_of(model, o).empty();
  // Generated tokens go into one device buffer; the host looks at `finished` only every
  // kCheckEvery steps, so the replayed steps queue up without a synchronization per token.
  constexpr int64_t kCheckEvery = 16;
  const int64_t n_max = o.max_new_tokens();
  auto generated = torch::empty({input_ids.size(0), n_max},
                                input_ids.options().dtype(torch::kLong).device(
                                    session.finished().device()));
  int64_t n = 0;
  auto emit = [&](const torch::Tensor& next) {
    generated.select(1, n++).copy_(next);
    if (o.on_tokens()) o.on_tokens()(next);
  };
  emit(session.prefill());
  TORCH_CHECK(n_max - 1 <= session.steps_left(), "generate: max_new_tokens=", n_max,
              " does not fit the cache: max_length=", o.max_length(), " holds the prompt and ",
              session.steps_left() + 1, " new tokens");
  while (n < n_max) {
    if (has_stops && n % kCheckEvery == 0 && session.finished().all().item<bool>()) break;
    emit(session.step());
  }
  auto gen = generated.narrow(1, 0, n);
  if (has_stops) {
    // Keep tokens up to the first step after which every row had stopped (what a loop that
    // checked every step would have produced).
    const auto stops = torch::tensor(stop_tokens_of(model, o), torch::kLong).to(gen.device());
    auto stopped = std::get<0>(torch::isin(gen, stops).to(torch::kInt).cummax(1)).to(torch::kBool);
    auto all_done = stopped.all(0).nonzero();
    if (all_done.numel() > 0) gen = gen.narrow(1, 0, all_done[0].item<int64_t>() + 1);
  }
  return torch::cat({input_ids, gen.to(input_ids.device(), input_ids.scalar_type())}, 1);
}

}  // namespace fox::nn
