// fox::nn layers: norms, ShiftLinear, GatedMLP and ForgettingAttentionLayer against naive math.
#include "helpers.h"  // LibTorch first: Catch2 must own CHECK

#include "../catch.h"

using namespace fox::nn;
using fox_test::close;

TEST_CASE("RMSNorm and GroupRMSNorm match the formula", "[nn][norm]") {
  torch::manual_seed(0);
  auto x = torch::randn({2, 5, 12}, torch::kFloat64);
  RMSNorm n(RMSNormOptions(12).eps(1e-6));
  n->to(torch::kFloat64);
  fox_test::randomize(*n);
  CHECK(close(n(x), fox_test::ref_rms(x, n->weight, 1, 1e-6)));
  GroupRMSNorm g(GroupRMSNormOptions(3, 12));
  g->to(torch::kFloat64);
  fox_test::randomize(*g);
  CHECK(g->options.eps() == 1e-5);
  CHECK(close(g(x), fox_test::ref_rms(x, g->weight, 3, 1e-5)));
  // float32 input: computed in fp32, returned in the input dtype
  auto xf = torch::randn({2, 3, 12}).to(torch::kBFloat16);
  GroupRMSNorm gf(GroupRMSNormOptions(3, 12));
  CHECK(gf(xf).scalar_type() == torch::kBFloat16);
  CHECK_THROWS_WITH(GroupRMSNorm(GroupRMSNormOptions(5, 12)), fox_test::HasSubstring("multiple"));
  CHECK_THROWS_WITH(n(torch::randn({2, 3, 7})), fox_test::HasSubstring("last dimension"));
}

TEST_CASE("ShiftLinear: token shift, parameter names and state chaining", "[nn][shift]") {
  torch::manual_seed(1);
  ShiftLinear m(ShiftLinearOptions(16, 24, 3));
  m->to(torch::kFloat64);
  auto names = m->named_parameters().keys();
  CHECK((names == std::vector<std::string>{"linear.weight", "shift_proj.weight"}));
  CHECK(m->shift_proj->weight.sizes() == torch::IntArrayRef({3, 16}));
  auto x = torch::randn({2, 7, 16}, torch::kFloat64);
  auto full = m(x);
  CHECK(close(full, fox_test::ref_shift(x, *m)));
  // in chunks, passing the state along
  auto [a, s1] = m->forward_with_state(x.narrow(1, 0, 3));
  auto [b, s2] = m->forward_with_state(x.narrow(1, 3, 1), s1);
  auto [c, s3] = m->forward_with_state(x.narrow(1, 4, 3), s2);
  CHECK(close(torch::cat({a, b, c}, 1), full));
  CHECK(close(s3, torch::matmul(x.select(1, 6), m->linear->weight.t())));
}

TEST_CASE("GatedMLP: authors' width rounding and SwiGLU", "[nn][mlp]") {
  // int(h * r * 2/3) rounded up to 256. NB: seed 002 prints gate_proj 8192 for the Pro config
  // with hidden_ratio 3.5, but the authors' formula gives 3584 (= LLaMA's parameter count, the
  // reason for 3.5); the printed tree matches ratio 4 (4096). We follow the code.
  CHECK(mlp_intermediate_size(1536, 3.5) == 3584);
  CHECK(mlp_intermediate_size(1536, 4.0) == 4096);
  CHECK(mlp_intermediate_size(2048, 4.0) == 5632);
  CHECK(mlp_intermediate_size(1000, 1.0) == 768);
  GatedMLP big(GatedMLPOptions(1536).hidden_ratio(4.0));
  CHECK(big->gate_proj->weight.sizes() == torch::IntArrayRef({8192, 1536}));
  CHECK(big->down_proj->weight.sizes() == torch::IntArrayRef({1536, 4096}));
  torch::manual_seed(2);
  GatedMLP m(GatedMLPOptions(8).intermediate_size(12));
  m->to(torch::kFloat64);
  auto x = torch::randn({2, 3, 8}, torch::kFloat64);
  auto gy = torch::matmul(x, m->gate_proj->weight.t()).chunk(2, -1);
  auto ref = torch::matmul(torch::silu(gy[0]) * gy[1], m->down_proj->weight.t());
  CHECK(close(m(x), ref));
  CHECK_THROWS_WITH(GatedMLP(GatedMLPOptions(8).hidden_act("relu")), fox_test::HasSubstring("swish"));
}

TEST_CASE("ForgettingAttentionLayer matches the naive formula", "[nn][attention]") {
  struct Case {
    const char* name;
    ForgettingAttentionLayerOptions opts;
  };
  auto base = ForgettingAttentionLayerOptions(32, 4);
  std::vector<Case> cases = {
      {"fox llama", base},
      {"fox pro",
       ForgettingAttentionLayerOptions(32, 4).qk_norm(true).use_output_gate(true)
           .use_output_norm(true).use_k_shift(true).use_v_shift(true)},
      {"transformer llama (rope)", ForgettingAttentionLayerOptions(32, 4).fgate_type("none")
                                       .use_rope(true).rope_base(10000)},
      {"bias_only", ForgettingAttentionLayerOptions(32, 4).fgate_type("bias_only")},
      {"fixed", ForgettingAttentionLayerOptions(32, 4).fgate_type("fixed").fgate_bias_init(true)
                    .decay_time_min(2).decay_time_max(64)},
      {"gqa + kv shift + qk norm", ForgettingAttentionLayerOptions(32, 4).num_kv_heads(2)
                                       .use_k_shift(true).use_v_shift(true).qk_norm(true)},
  };
  for (auto& c : cases) {
    SECTION(c.name) {
      torch::manual_seed(3);
      ForgettingAttentionLayer m(c.opts);
      m->to(torch::kFloat64);
      fox_test::randomize(*m);
      auto x = torch::randn({2, 9, 32}, torch::kFloat64);
      auto y = m(x);
      CHECK(y.sizes() == x.sizes());
      CHECK(close(y, fox_test::ref_layer(*m, x), 1e-9));
    }
  }
}

TEST_CASE("ForgettingAttentionLayer: names, gate init and option errors", "[nn][attention]") {
  ForgettingAttentionLayer pro(ForgettingAttentionLayerOptions(1536, 24).qk_norm(true)
                                   .use_output_gate(true).use_output_norm(true)
                                   .use_k_shift(true).use_v_shift(true));
  auto params = pro->named_parameters();
  std::vector<std::string> expect = {
      "q_proj.weight", "k_proj.linear.weight", "k_proj.shift_proj.weight",
      "v_proj.linear.weight", "v_proj.shift_proj.weight", "o_proj.weight",
      "fgate_proj.weight", "fgate_proj.bias", "ogate_proj.weight", "output_norm.weight",
      "q_norm.weight", "k_norm.weight"};
  CHECK(params.keys() == expect);
  CHECK(params["fgate_proj.weight"].sizes() == torch::IntArrayRef({24, 1536}));
  CHECK(params["q_norm.weight"].sizes() == torch::IntArrayRef({1536}));
  CHECK(pro->output_norm->options.eps() == 1e-6);
  CHECK(pro->q_norm->options.eps() == 1e-5);
  CHECK(params["fgate_proj.bias"].abs().max().item<float>() == 0.0f);
  auto w = params["q_proj.weight"];
  CHECK(std::abs(w.std().item<double>() - 0.02) < 1e-3);

  // fixed gates: a buffer, decay times log-spaced from T_min to T_max
  ForgettingAttentionLayer fixed(ForgettingAttentionLayerOptions(32, 4).fgate_type("fixed")
                                     .fgate_bias_init(true).decay_time_min(2).decay_time_max(256));
  CHECK(fixed->named_parameters().find("fgate_bias") == nullptr);
  REQUIRE(fixed->named_buffers().find("fgate_bias") != nullptr);
  auto t = -1.0 / torch::log_sigmoid(fixed->fgate_bias.to(torch::kFloat64));
  CHECK(close(t, torch::tensor({2.0, 10.079368399, 50.796833068, 256.0}, torch::kFloat64), 1e-4));
  ForgettingAttentionLayer bias_only(ForgettingAttentionLayerOptions(32, 4).fgate_type("bias_only"));
  CHECK(bias_only->named_parameters().find("fgate_bias") != nullptr);
  ForgettingAttentionLayer none(ForgettingAttentionLayerOptions(32, 4).fgate_type("none"));
  CHECK(none->named_parameters().find("fgate_proj.weight") == nullptr);

  CHECK_THROWS_WITH(ForgettingAttentionLayer(ForgettingAttentionLayerOptions(32, 4).fgate_type("x")),
                    fox_test::HasSubstring("fgate_type"));
  CHECK_THROWS_WITH(ForgettingAttentionLayer(ForgettingAttentionLayerOptions(32, 4).fgate_type("fixed")),
                    fox_test::HasSubstring("fgate_bias_init"));
  CHECK_THROWS_WITH(ForgettingAttentionLayer(ForgettingAttentionLayerOptions(32, 4).num_kv_heads(3)),
                    fox_test::HasSubstring("num_kv_heads"));
  CHECK_THROWS_WITH(ForgettingAttentionLayer(ForgettingAttentionLayerOptions(30, 4)),
                    fox_test::HasSubstring("num_heads"));
  ForgettingAttentionLayer ok(ForgettingAttentionLayerOptions(32, 4));
  CHECK_THROWS_WITH(ok(torch::randn({2, 3, 31})), fox_test::HasSubstring("(batch, seqlen, 32)"));
}

TEST_CASE("ForgettingAttentionLayer: pruning with a loose tolerance changes nothing visible",
          "[nn][attention]") {
  torch::manual_seed(4);
  auto opts = ForgettingAttentionLayerOptions(32, 4).qk_norm(true);
  ForgettingAttentionLayer exact(opts);
  ForgettingAttentionLayer pruned(ForgettingAttentionLayerOptions(opts).log_pruning_tolerance(-10.0));
  {
    torch::NoGradGuard g;
    auto src = exact->named_parameters();
    for (auto& p : pruned->named_parameters()) p.value().copy_(src[p.key()]);
    // strongly forgetting heads so some key tiles are actually skipped
    exact->fgate_proj->bias.fill_(-6.0);
    pruned->fgate_proj->bias.fill_(-6.0);
  }
  auto x = torch::randn({1, 300, 32});
  auto a = exact(x), b = pruned(x);
  CHECK((a - b).abs().max().item<double>() < 1e-3);
}
