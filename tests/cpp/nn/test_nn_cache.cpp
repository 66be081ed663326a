// fox::nn cache and generation: chunked prefill and decoding equal the full forward (with
// KV-shift, RoPE, left padding), generation (greedy, sampling filters, stop tokens).
#include "helpers.h"  // LibTorch first: Catch2 must own CHECK

#include "../catch.h"

using namespace fox::nn;
using fox_test::close;

namespace {
// Runs ids through the model in the given chunk sizes and returns all logits.
torch::Tensor incremental(ForgettingTransformerForCausalLM& lm, const torch::Tensor& ids,
                          const std::vector<int64_t>& chunks,
                          const std::optional<torch::Tensor>& seq_start = std::nullopt) {
  KVCache cache = lm->new_cache();
  std::vector<torch::Tensor> out;
  int64_t s = 0;
  for (auto n : chunks) {
    out.push_back(lm->forward(ids.narrow(1, s, n), std::nullopt, &cache, s == 0 ? seq_start : std::nullopt));
    s += n;
    CHECK(cache.length() == s);
  }
  return torch::cat(out, 1);
}
}  // namespace

TEST_CASE("Chunked prefill and decoding equal the full forward", "[nn][cache]") {
  for (const char* arch : {"fox_llama", "fox_pro", "transformer_llama", "transformer_pro"}) {
    SECTION(arch) {
      torch::manual_seed(8);
      auto cfg = fox_test::tiny_config(arch);
      ForgettingTransformerForCausalLM lm(cfg);
      lm->to(torch::kFloat64);
      fox_test::randomize(*lm, 0.1);
      auto ids = torch::randint(0, 61, {3, 13});
      auto full = lm(ids);
      CHECK(close(incremental(lm, ids, {5, 1, 1, 4, 1, 1}), full, 1e-9));
      CHECK(close(incremental(lm, ids, std::vector<int64_t>(13, 1)), full, 1e-9));
    }
  }
}

TEST_CASE("Cache holds gates, shift states and GQA keys", "[nn][cache]") {
  auto cfg = fox_test::tiny_config("fox_pro");
  cfg.num_kv_heads(2);
  ForgettingTransformerForCausalLM lm(cfg);
  lm->to(torch::kFloat64);
  auto ids = torch::randint(0, 61, {2, 7});
  auto full = lm(ids);
  KVCache cache = lm->new_cache();
  auto a = lm->forward(ids.narrow(1, 0, 4), std::nullopt, &cache);
  auto& l0 = cache.layers[0];
  CHECK(l0.k.sizes() == torch::IntArrayRef({2, 4, 2, 8}));
  CHECK(l0.log_fgate.sizes() == torch::IntArrayRef({2, 4, 4}));
  CHECK(l0.key_shift.sizes() == torch::IntArrayRef({2, 16}));
  CHECK(l0.value_shift.sizes() == torch::IntArrayRef({2, 16}));
  auto b = lm->forward(ids.narrow(1, 4, 3), std::nullopt, &cache);
  CHECK(close(torch::cat({a, b}, 1), full, 1e-9));
  // select_batch keeps rows
  cache.select_batch(torch::tensor({1}));
  CHECK(cache.layers[1].v.size(0) == 1);
  cache.reset();
  CHECK(cache.length() == 0);
}

TEST_CASE("Left padding via seq_start: padded rows equal unpadded ones, also when decoding",
          "[nn][cache]") {
  for (const char* arch : {"fox_pro", "transformer_pro"}) {
    SECTION(arch) {
      torch::manual_seed(9);
      ForgettingTransformerForCausalLM lm(fox_test::tiny_config(arch));
      lm->to(torch::kFloat64);
      fox_test::randomize(*lm, 0.1);
      const int64_t T = 10;
      auto ids = torch::randint(1, 61, {2, T});
      ids.narrow(1, 0, 3)[0].fill_(0);  // row 0: 3 pad tokens
      auto seq_start = torch::tensor({3, 0}, torch::kLong);
      auto full = lm->forward(ids, std::nullopt, nullptr, seq_start);
      // row 0's real tokens alone give the same logits
      auto alone = lm(ids.narrow(1, 3, T - 3).narrow(0, 0, 1));
      CHECK(close(full.narrow(1, 3, T - 3).narrow(0, 0, 1), alone, 1e-8));
      CHECK(close(full.narrow(0, 1, 1), lm(ids.narrow(0, 1, 1)), 1e-9));
      // incremental with the padding given once at prefill
      auto inc = incremental(lm, ids, {4, 1, 2, 1, 1, 1}, seq_start);
      CHECK(close(inc.narrow(1, 3, T - 3), full.narrow(1, 3, T - 3), 1e-9));
    }
  }
}

TEST_CASE("sample_next_token: greedy, top-k, top-p, temperature", "[nn][generate]") {
  torch::manual_seed(10);
  auto logits = torch::randn({4, 50});
  auto greedy = logits.argmax(-1);
  CHECK(sample_next_token(logits, GenerationOptions()).equal(greedy));
  CHECK(sample_next_token(logits, GenerationOptions().do_sample(true).top_k(1)).equal(greedy));
  CHECK(sample_next_token(logits, GenerationOptions().do_sample(true).top_p(1e-6)).equal(greedy));
  CHECK(sample_next_token(logits, GenerationOptions().do_sample(true).temperature(0)).equal(greedy));
  // top-k 3: every sample is among the 3 best
  auto top3 = std::get<1>(logits.topk(3, -1));
  for (int i = 0; i < 20; ++i) {
    auto s = sample_next_token(logits, GenerationOptions().do_sample(true).top_k(3));
    CHECK(top3.eq(s.unsqueeze(-1)).any(-1).all().item<bool>());
  }
  // top-p: with one dominant token (p > 0.9) sampling at top_p 0.9 always returns it
  auto peaked = torch::zeros({2, 10});
  peaked.select(1, 7).fill_(10.0);
  for (int i = 0; i < 10; ++i) {
    CHECK(sample_next_token(peaked, GenerationOptions().do_sample(true).top_p(0.9)).eq(7).all().item<bool>());
  }
}

TEST_CASE("generate: greedy equals the argmax rollout of full forwards; stop tokens",
          "[nn][generate]") {
  torch::manual_seed(11);
  ForgettingTransformerForCausalLM lm(fox_test::tiny_config("fox_pro"));
  lm->to(torch::kFloat64);
  fox_test::randomize(*lm, 0.2);
  auto prompt = torch::randint(0, 61, {2, 5});
  auto out = generate(lm, prompt, GenerationOptions().max_new_tokens(6).prefill_chunk_size(2));
  REQUIRE(out.sizes() == torch::IntArrayRef({2, 11}));
  CHECK(out.narrow(1, 0, 5).equal(prompt));
  auto seq = prompt;
  {
    torch::NoGradGuard g;
    for (int i = 0; i < 6; ++i) {
      auto next = lm(seq).select(1, seq.size(1) - 1).argmax(-1, true);
      seq = torch::cat({seq, next}, 1);
    }
  }
  CHECK(out.equal(seq));
  // stop at the first generated token of every row: one step, then done
  std::vector<int64_t> stops = {out[0][5].item<int64_t>(), out[1][5].item<int64_t>()};
  auto stopped = generate(lm, prompt, GenerationOptions().max_new_tokens(6).stop_tokens(stops));
  CHECK(stopped.sizes() == torch::IntArrayRef({2, 6}));
  // only row 0 stops: row 0 is padded afterwards
  auto one = generate(lm, prompt, GenerationOptions().max_new_tokens(6).stop_tokens({stops[0]})
                                       .pad_token_id(60));
  if (stops[0] != stops[1] && !out[1].narrow(0, 5, 6).eq(stops[0]).any().item<bool>()) {
    CHECK(one.sizes() == torch::IntArrayRef({2, 11}));
    CHECK(one[0].narrow(0, 6, 5).eq(60).all().item<bool>());
    CHECK(one[1].equal(out[1]));
  }
  // sampling runs and keeps the prompt
  auto sampled = generate(lm, prompt, GenerationOptions().max_new_tokens(4).do_sample(true)
                                          .temperature(0.8).top_k(10).top_p(0.9));
  CHECK(sampled.sizes() == torch::IntArrayRef({2, 9}));
  CHECK(sampled.narrow(1, 0, 5).equal(prompt));
}
