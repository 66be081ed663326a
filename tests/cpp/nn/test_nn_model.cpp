// fox::nn model: presets, authors' parameter names, losses, gradients, save/load.
#include <cstdio>
#include <cstdlib>
#include <set>

#include "helpers.h"  // LibTorch first: Catch2 must own CHECK

#include <fox/ops.h>

#include "../catch.h"

using namespace fox::nn;
using fox_test::close;

TEST_CASE("Presets set the paper's architectures", "[nn][model]") {
  ForgettingTransformerConfig c;
  auto fp = c.preset("fox_pro");
  CHECK((fp.fgate_type() == "full" && !fp.use_rope() && fp.qk_norm() && fp.use_output_gate() &&
         fp.use_output_norm() && fp.use_k_shift() && fp.use_v_shift() && fp.hidden_ratio() == 3.5));
  auto fl = c.preset("fox_llama");
  CHECK((fl.fgate_type() == "full" && !fl.use_rope() && !fl.qk_norm() && !fl.use_k_shift() &&
         fl.hidden_ratio() == 4.0));
  auto tl = c.preset("transformer_llama");
  CHECK((tl.fgate_type() == "none" && tl.use_rope() && !tl.use_output_gate()));
  auto tp = c.preset("transformer_pro");
  CHECK((tp.fgate_type() == "none" && tp.use_rope() && tp.qk_norm() && tp.use_v_shift()));
  CHECK(tp.rope_base() == 500000.0);
  CHECK_THROWS_WITH(c.preset("mamba"), fox_test::HasSubstring("unknown architecture"));
}

TEST_CASE("Parameter names match the authors' FoX (Pro) 760M module tree", "[nn][model]") {
  // The seed's printed tree, shrunk to 1 layer and a small vocabulary (same widths).
  ForgettingTransformerConfig c;
  c.vocab_size(100).hidden_size(1536).num_hidden_layers(1).num_heads(24);
  c.fox_pro();
  c.hidden_ratio(4.0);  // the seed's printed tree has gate_proj 8192 = 2 * 4096 (ratio 4)
  ForgettingTransformerForCausalLM lm(c);
  auto p = lm->named_parameters();
  std::set<std::string> names;
  for (auto& kv : p) names.insert(kv.key());
  std::set<std::string> expect = {
      "model.embeddings.weight",
      "model.layers.0.attn_norm.weight",
      "model.layers.0.attn.q_proj.weight",
      "model.layers.0.attn.k_proj.linear.weight",
      "model.layers.0.attn.k_proj.shift_proj.weight",
      "model.layers.0.attn.v_proj.linear.weight",
      "model.layers.0.attn.v_proj.shift_proj.weight",
      "model.layers.0.attn.o_proj.weight",
      "model.layers.0.attn.fgate_proj.weight",
      "model.layers.0.attn.fgate_proj.bias",
      "model.layers.0.attn.ogate_proj.weight",
      "model.layers.0.attn.output_norm.weight",
      "model.layers.0.attn.q_norm.weight",
      "model.layers.0.attn.k_norm.weight",
      "model.layers.0.mlp_norm.weight",
      "model.layers.0.mlp.gate_proj.weight",
      "model.layers.0.mlp.down_proj.weight",
      "model.norm.weight",
      "lm_head.weight"};
  CHECK(names == expect);
  CHECK(p["model.layers.0.attn.q_proj.weight"].sizes() == torch::IntArrayRef({1536, 1536}));
  CHECK(p["model.layers.0.attn.k_proj.linear.weight"].sizes() == torch::IntArrayRef({1536, 1536}));
  CHECK(p["model.layers.0.attn.fgate_proj.weight"].sizes() == torch::IntArrayRef({24, 1536}));
  CHECK(p["model.layers.0.mlp.gate_proj.weight"].sizes() == torch::IntArrayRef({8192, 1536}));
  CHECK(p["model.layers.0.mlp.down_proj.weight"].sizes() == torch::IntArrayRef({1536, 4096}));
  CHECK(p["lm_head.weight"].sizes() == torch::IntArrayRef({100, 1536}));
  // init: normal(0, 0.02) weights, ones for norms, zero gate bias
  CHECK(std::abs(p["model.embeddings.weight"].std().item<double>() - 0.02) < 1e-3);
  CHECK(p["model.norm.weight"].eq(1).all().item<bool>());
  CHECK(p["model.layers.0.attn.fgate_proj.bias"].eq(0).all().item<bool>());

  // Transformer (LLaMA): plain projections, no gate
  auto t = ForgettingTransformerForCausalLM(fox_test::tiny_config("transformer_llama"));
  auto tn = t->named_parameters();
  CHECK(tn.find("model.layers.1.attn.k_proj.weight") != nullptr);
  CHECK(tn.find("model.layers.1.attn.fgate_proj.weight") == nullptr);
}

TEST_CASE("Causal LM: logits, per-token loss and gradients to every parameter", "[nn][model]") {
  for (const char* arch : {"fox_llama", "fox_pro", "transformer_llama", "transformer_pro"}) {
    SECTION(arch) {
      torch::manual_seed(5);
      ForgettingTransformerForCausalLM lm(fox_test::tiny_config(arch));
      lm->to(torch::kFloat64);
      auto ids = torch::randint(0, 61, {2, 11});
      auto labels = torch::randint(0, 61, {2, 11});
      labels[0][3] = -100;
      auto logits = lm(ids);
      CHECK(logits.sizes() == torch::IntArrayRef({2, 11, 61}));
      auto loss = lm(ids, labels);
      REQUIRE(loss.sizes() == torch::IntArrayRef({2, 11}));
      auto ref = -logits.log_softmax(-1).gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1);
      ref[0][3] = 0;
      CHECK(close(loss, ref));
      loss.mean().backward();
      for (auto& p : lm->named_parameters()) {
        INFO(p.key());
        REQUIRE(p.value().grad().defined());
        CHECK(p.value().grad().abs().sum().item<double>() > 0);
      }
    }
  }
}

TEST_CASE("Memory savings of a training step: the same loss and gradients", "[nn][model]") {
  // The knobs are read at each call: off, the MLP product recomputed, the loss in chunks of 5 rows
  // (22 rows: the last chunk of 2).
  auto step = [](ForgettingTransformerForCausalLM& lm, const torch::Tensor& ids,
                 const torch::Tensor& labels, const char* recompute, const char* chunk_rows) {
    setenv("FOX_RECOMPUTE_GATED", recompute, 1);
    setenv("FOX_LOSS_CHUNK_ROWS", chunk_rows, 1);
    lm->zero_grad();
    auto loss = lm(ids, labels);
    (loss * torch::linspace(0.5, 1.5, loss.numel(), loss.options()).view(loss.sizes())).sum().backward();
    std::vector<torch::Tensor> out{loss.detach()};
    for (auto& p : lm->parameters()) out.push_back(p.grad().clone());
    unsetenv("FOX_RECOMPUTE_GATED");
    unsetenv("FOX_LOSS_CHUNK_ROWS");
    return out;
  };
  for (bool tied : {false, true}) {
    SECTION(tied ? "tied" : "lm_head") {
      torch::manual_seed(9);
      auto cfg = fox_test::tiny_config("fox_pro");
      cfg.tie_word_embeddings(tied);
      ForgettingTransformerForCausalLM lm(cfg);
      lm->to(torch::kFloat64);
      auto ids = torch::randint(0, 61, {2, 11});
      auto labels = torch::randint(0, 61, {2, 11});
      labels[0][3] = -100;
      labels[1][10] = -100;
      auto off = step(lm, ids, labels, "0", "0");
      auto recomputed = step(lm, ids, labels, "1", "0");
      auto chunked = step(lm, ids, labels, "0", "5");
      for (size_t i = 0; i < off.size(); ++i) {
        INFO(i);
        CHECK(torch::equal(off[i], recomputed[i]));
        CHECK(close(off[i], chunked[i], 1e-12));
      }
    }
  }
}

TEST_CASE("Save/load round trip of a small model", "[nn][model]") {
  torch::manual_seed(6);
  auto cfg = fox_test::tiny_config("fox_pro");
  ForgettingTransformerForCausalLM a(cfg);
  fox_test::randomize(*a);
  auto path = std::string("/tmp/fox_nn_test_") + std::to_string(::getpid()) + ".pt";
  torch::save(a, path);
  torch::manual_seed(7);
  ForgettingTransformerForCausalLM b(cfg);
  auto ids = torch::randint(0, 61, {2, 6});
  CHECK(!close(a(ids), b(ids), 1e-6));
  torch::load(b, path);
  std::remove(path.c_str());
  CHECK(close(a(ids), b(ids), 0.0));
  // clone() is a deep copy with the same outputs
  auto c = std::dynamic_pointer_cast<ForgettingTransformerForCausalLMImpl>(a->clone());
  CHECK(close(a(ids), c->forward(ids), 0.0));
}

TEST_CASE("Tied embeddings and padding row", "[nn][model]") {
  auto cfg = fox_test::tiny_config("fox_llama");
  cfg.tie_word_embeddings(true).pad_token_id(0);
  ForgettingTransformerForCausalLM lm(cfg);
  CHECK(lm->named_parameters().find("lm_head.weight") == nullptr);
  CHECK(lm->model->embeddings->weight[0].eq(0).all().item<bool>());
  auto h = lm->model(torch::randint(0, 61, {1, 4}));
  CHECK(close(lm->logits(h), torch::matmul(h, lm->model->embeddings->weight.t()), 1e-5));
}

TEST_CASE("replace_parameter re-points every parameter, as FSDP2 swaps them", "[nn][model]") {
  // Swap every parameter for a fresh tensor holding the same values: forward is unchanged and
  // the gradients land in the new tensors (forward reads them), none in the old ones.
  for (const char* arch : {"fox_pro", "fox_llama", "transformer_llama"}) {
    SECTION(arch) {
      torch::manual_seed(8);
      auto cfg = fox_test::tiny_config(arch);
      if (std::string(arch) == "fox_llama") cfg.tie_word_embeddings(true).fgate_type("bias_only");
      ForgettingTransformerForCausalLM lm(cfg);
      fox_test::randomize(*lm);
      auto ids = torch::randint(0, 61, {2, 7});
      auto before = lm(ids).detach();
      std::vector<std::pair<torch::Tensor, torch::Tensor>> swapped;  // (old, new)
      for (auto& m : lm->modules(/*include_self=*/true)) {
        for (auto& p : m->named_parameters(/*recurse=*/false)) {
          auto fresh = p.value().detach().clone().requires_grad_(true);
          swapped.emplace_back(p.value(), fresh);
          replace_parameter(*m, p.key(), fresh);
        }
      }
      CHECK(swapped.size() == lm->parameters().size());
      auto params = lm->parameters();
      for (size_t i = 0; i < swapped.size(); ++i) CHECK(params[i].is_same(swapped[i].second));
      auto out = lm(ids);
      CHECK(close(out, before, 0.0));
      out.square().sum().backward();
      for (auto& [old, fresh] : swapped) {
        CHECK(!old.grad().defined());
        REQUIRE(fresh.grad().defined());
        CHECK(fresh.grad().abs().sum().item<double>() > 0);
      }
    }
  }
  ForgettingTransformerForCausalLM lm(fox_test::tiny_config("fox_pro"));
  auto& q = *lm->model->layers[0]->as<ForgettingTransformerBlockImpl>()->attn->q_proj;
  CHECK_THROWS_WITH(replace_parameter(q, "weight", torch::zeros({3, 3})),
                    fox_test::HasSubstring("has shape"));
  CHECK_THROWS_WITH(replace_parameter(q, "scale", torch::zeros({3})),
                    fox_test::HasSubstring("no parameter 'scale'"));
}

TEST_CASE("A block runner sees every block call, and clones run without it", "[nn][model]") {
  torch::manual_seed(9);
  ForgettingTransformerForCausalLM lm(fox_test::tiny_config("fox_pro"));
  auto ids = torch::randint(0, 61, {2, 5});
  auto expect = lm(ids);
  std::vector<int64_t> calls;
  lm->model->set_block_runner([&](int64_t i, const torch::Tensor& h, LayerCache* cache,
                                  const std::optional<torch::Tensor>& start) {
    calls.push_back(i);
    return lm->model->layers[i]->as<ForgettingTransformerBlockImpl>()->forward(h, cache, start);
  });
  CHECK(close(lm(ids), expect, 0.0));
  CHECK((calls == std::vector<int64_t>{0, 1}));
  auto c = std::dynamic_pointer_cast<ForgettingTransformerForCausalLMImpl>(lm->clone());
  CHECK(close(c->forward(ids), expect, 0.0));
  CHECK(calls.size() == 2);
  lm->model->set_block_runner(nullptr);
  CHECK(close(lm(ids), expect, 0.0));
  CHECK(calls.size() == 2);
}

TEST_CASE("A SequenceShard of two pieces in one process gives the whole sequence's output",
          "[nn][model]") {
  // The callbacks a context-parallel host supplies, for one process holding the sequence as two
  // pieces: the second piece's KV-shift reads the first's last token, attention sees everything.
  for (const char* arch : {"fox_pro", "transformer_pro"}) {
    torch::manual_seed(10);
    ForgettingTransformerForCausalLM lm(fox_test::tiny_config(arch));
    auto ids = torch::randint(0, 61, {2, 9});
    auto expect = lm(ids);
    auto shard = std::make_shared<SequenceShard>();
    int prepared = 0;
    shard->prepare = [&](SequenceShard* s, int64_t length, torch::Device device) {
      ++prepared;
      s->positions = torch::arange(length, torch::TensorOptions().dtype(torch::kLong).device(device));
      s->piece_lengths = {4, length - 4};
      s->sequence_length = length;
    };
    shard->previous_tokens = [](const torch::Tensor& y) {
      return torch::stack({torch::zeros_like(y.select(1, 0)), y.select(1, 3)}, 1);
    };
    shard->attention = [](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const torch::Tensor& g, double sm_scale, std::optional<double> threshold) {
      return fox::forgetting_attention(
          q, k, v, g, fox::AttentionOptions().sm_scale(sm_scale).adaptive_threshold(threshold));
    };
    lm->model->set_sequence_shard(shard);
    CHECK(close(lm(ids), expect, 1e-6));
    CHECK(prepared == 1);
    auto cache = lm->new_cache();
    CHECK_THROWS_WITH(lm->forward(ids, std::nullopt, &cache),
                      fox_test::HasSubstring("neither a cache nor seq_start"));
    lm->model->set_sequence_shard(nullptr);
    CHECK(close(lm(ids), expect, 0.0));
    CHECK_THROWS_WITH(lm->model->set_sequence_shard(std::make_shared<SequenceShard>()),
                      fox_test::HasSubstring("needs prepare"));
  }
}
