// Bad input to the Forgetting Attention C++ API is a c10::Error whose message names the argument,
// through every entry point: fox::forgetting_attention (autograd path, inputs requiring grad),
// fox::forgetting_attention_forward and fox::forgetting_attention_backward.
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include "../catch.h"

#include <fox/fox.h>

using fox_test::HasSubstring;

namespace {

struct Args {
  at::Tensor q, k, v, g;
  std::optional<at::Tensor> seq_start;
  std::optional<at::Tensor> cu_seqlens;
  std::optional<double> sm_scale;
  std::optional<double> adaptive_threshold;
};

// Valid arguments: B=2, Tq=5, Tk=7, H=4, Hkv=2, D=8, float32.
Args good(int64_t B = 2, int64_t Tq = 5, int64_t Tk = 7, int64_t H = 4, int64_t Hkv = 2,
          int64_t D = 8) {
  const auto f = at::TensorOptions().dtype(at::kFloat);
  return {at::randn({B, Tq, H, D}, f), at::randn({B, Tk, Hkv, D}, f),
          at::randn({B, Tk, Hkv, D}, f), at::log_sigmoid(at::randn({B, Tk, H}, f))};
}

at::Tensor index(std::vector<int64_t> values) { return at::tensor(values, at::kLong); }

enum class Entry { Autograd, ForwardOp, BackwardOp };

const char* entry_name(Entry e) {
  switch (e) {
    case Entry::Autograd: return "fox::forgetting_attention";
    case Entry::ForwardOp: return "fox::forgetting_attention_forward";
    default: return "fox::forgetting_attention_backward";
  }
}

// Calls one entry point with the arguments. For the backward op, grad_out/out/lse get shapes
// consistent with q where q allows it, so the forward checks are the ones that fire.
void call(Entry entry, const Args& a) {
  switch (entry) {
    case Entry::Autograd: {
      auto leaf = [](const at::Tensor& x) {
        return at::isFloatingType(x.scalar_type()) ? x.detach().clone().requires_grad_(true) : x;
      };
      fox::AttentionOptions o;
      o.seq_start(a.seq_start).cu_seqlens(a.cu_seqlens).sm_scale(a.sm_scale);
      o.adaptive_threshold(a.adaptive_threshold);
      auto out = fox::forgetting_attention(leaf(a.q), leaf(a.k), leaf(a.v), leaf(a.g), o);
      out.sum().backward();
      return;
    }
    case Entry::ForwardOp:
      fox::forgetting_attention_forward(a.q, a.k, a.v, a.g, a.seq_start, a.cu_seqlens, a.sm_scale,
                                        a.adaptive_threshold);
      return;
    case Entry::BackwardOp: {
      const auto f = a.q.options().dtype(at::kFloat);
      const auto lse = a.q.dim() == 4 ? at::zeros({a.q.size(0), a.q.size(2), a.q.size(1)}, f)
                                      : at::zeros({1, 1, 1}, f);
      fox::forgetting_attention_backward(at::ones_like(a.q), a.q, a.k, a.v, a.g,
                                         at::ones_like(a.q), lse, a.seq_start, a.cu_seqlens,
                                         a.sm_scale, a.adaptive_threshold);
      return;
    }
  }
}

// The call throws c10::Error and its message contains every fragment.
#define CHECK_REJECTS(entry, args, ...)                                   \
  do {                                                                    \
    CHECK_THROWS_AS(call(entry, args), c10::Error);                       \
    for (const std::string& fragment : std::vector<std::string>{__VA_ARGS__}) { \
      CHECK_THROWS_WITH(call(entry, args), HasSubstring(fragment));           \
    }                                                                     \
  } while (0)

}  // namespace

TEST_CASE("bad arguments throw c10::Error naming the argument", "[cpu][errors]") {
  const Entry entry = GENERATE(Entry::Autograd, Entry::ForwardOp, Entry::BackwardOp);
  CAPTURE(entry_name(entry));
  at::manual_seed(0);

  SECTION("the valid arguments pass") {
    CHECK_NOTHROW(call(entry, good()));
    Args a = good(1, 10, 10);
    a.cu_seqlens = index({0, 4, 10});
    CHECK_NOTHROW(call(entry, a));
  }

  SECTION("rank of q, k, v, log_fgate") {
    Args a = good();
    a.q = a.q.flatten(2);
    CHECK_REJECTS(entry, a, "q must be (batch, seqlen_q, num_heads, head_dim)", "[2, 5, 32]");
    a = good();
    a.k = a.k.flatten(2);
    CHECK_REJECTS(entry, a, "k must be (batch, seqlen_k, num_kv_heads, head_dim)");
    a = good();
    a.v = a.v.unsqueeze(0);
    CHECK_REJECTS(entry, a, "v must be (batch, seqlen_k, num_kv_heads, head_dim)");
    a = good();
    a.g = a.g.flatten(1);
    CHECK_REJECTS(entry, a, "log_fgate must be (batch, seqlen_k, num_heads)");
  }

  SECTION("mismatched batch and lengths") {
    Args a = good();
    const Args b3 = good(3);
    a.k = b3.k;
    a.v = b3.v;
    CHECK_REJECTS(entry, a, "k must be (batch=2");
    a = good();
    a.v = good(2, 5, 8).v;  // seqlen_k 8 while k has 7
    CHECK_REJECTS(entry, a, "v must have the shape of k");
    a = good();
    a.g = b3.g;
    CHECK_REJECTS(entry, a, "log_fgate must be (batch=2");
    a = good();
    a.g = good(2, 5, 6).g;  // 6 positions instead of 7
    CHECK_REJECTS(entry, a, "log_fgate must be", "seqlen_k=7");
    a = good();
    a.g = good(2, 5, 7, 2, 2).g;  // 2 heads instead of 4
    CHECK_REJECTS(entry, a, "log_fgate must be", "num_heads=4");
    a = good();
    a.k = good(2, 5, 7, 4, 2, 16).k;  // head_dim 16 vs q's 8
    CHECK_REJECTS(entry, a, "k must be", "head_dim=8");
  }

  SECTION("head_dim 0 and 257") {
    const int64_t D = GENERATE(0, 257);
    CHECK_REJECTS(entry, good(2, 5, 7, 4, 2, D), "head_dim", std::to_string(D));
  }

  SECTION("num_kv_heads must divide num_heads") {
    CHECK_REJECTS(entry, good(2, 5, 7, 4, 3), "num_kv_heads", "(3)");
    CHECK_REJECTS(entry, good(2, 5, 7, 2, 4), "num_kv_heads", "(4)");
  }

  SECTION("seqlen_q must not exceed seqlen_k") {
    CHECK_REJECTS(entry, good(2, 8, 7), "seqlen_q", "seqlen_k");
  }

  SECTION("seq_start") {
    Args a = good();
    a.seq_start = index({0, -1});
    CHECK_REJECTS(entry, a, "seq_start", "-1");
    a.seq_start = index({0, 7});  // == seqlen_k
    CHECK_REJECTS(entry, a, "seq_start", "seqlen_k=7");
    a.seq_start = index({0, 1, 2});
    CHECK_REJECTS(entry, a, "seq_start must have batch=2");
    a.seq_start = at::zeros({2}, at::kFloat);
    CHECK_REJECTS(entry, a, "seq_start must be an integer tensor");
    a.seq_start = at::zeros({2, 1}, at::kLong);
    CHECK_REJECTS(entry, a, "seq_start must be one-dimensional");
  }

  SECTION("cu_seqlens") {
    Args a = good(1, 10, 10);
    a.cu_seqlens = index({0, 6, 4, 10});
    CHECK_REJECTS(entry, a, "cu_seqlens must be non-decreasing");
    a.cu_seqlens = index({0, 4, 9});
    CHECK_REJECTS(entry, a, "cu_seqlens must end at", "10");
    a.cu_seqlens = index({0, 4, 11});
    CHECK_REJECTS(entry, a, "cu_seqlens must end at", "11");
    a.cu_seqlens = index({1, 4, 10});
    CHECK_REJECTS(entry, a, "cu_seqlens must start at 0");
    a.cu_seqlens = index({10});
    CHECK_REJECTS(entry, a, "cu_seqlens must have at least 2 entries");
    a.cu_seqlens = at::tensor(std::vector<double>{0, 10});
    CHECK_REJECTS(entry, a, "cu_seqlens must be an integer tensor");
    a.cu_seqlens = index({0, 4, 10});
    a.seq_start = index({0});
    CHECK_REJECTS(entry, a, "seq_start and cu_seqlens");

    Args b = good(2, 10, 10);
    b.cu_seqlens = index({0, 4, 10});
    CHECK_REJECTS(entry, b, "cu_seqlens", "batch size 1");
    Args c = good(1, 6, 10);
    c.cu_seqlens = index({0, 4, 10});
    CHECK_REJECTS(entry, c, "cu_seqlens", "seqlen_q");
  }

  SECTION("dtypes") {
    Args a = good();
    a.k = a.k.to(at::kDouble);
    CHECK_REJECTS(entry, a, "k must have the dtype of q");
    a = good();
    a.v = a.v.to(at::kBFloat16);
    CHECK_REJECTS(entry, a, "v must have the dtype of q");
    a = good();
    a.g = a.g.to(at::kBFloat16);
    CHECK_REJECTS(entry, a, "log_fgate must be float32");
    a = good();
    a.g = a.g.to(at::kDouble);  // float64 gates only with float64 q
    CHECK_REJECTS(entry, a, "log_fgate must be float32");
    a = good();
    a.q = a.q.to(at::kInt);
    a.k = a.k.to(at::kInt);
    a.v = a.v.to(at::kInt);
    CHECK_REJECTS(entry, a, "q must be float16, bfloat16, float32 or float64");
  }

  SECTION("sm_scale and adaptive_threshold") {
    Args a = good();
    a.sm_scale = std::numeric_limits<double>::quiet_NaN();
    CHECK_REJECTS(entry, a, "sm_scale must be finite");
    a.sm_scale = std::numeric_limits<double>::infinity();
    CHECK_REJECTS(entry, a, "sm_scale must be finite");
    a = good();
    a.adaptive_threshold = std::numeric_limits<double>::quiet_NaN();
    CHECK_REJECTS(entry, a, "adaptive_threshold");
  }
}

TEST_CASE("head_first checks the ranks", "[cpu][errors]") {
  const Args a = good();
  CHECK_THROWS_AS(fox::forgetting_attention(a.q.flatten(2), a.k, a.v, a.g,
                                            fox::AttentionOptions().head_first(true)),
                  c10::Error);
  CHECK_THROWS_WITH(fox::forgetting_attention(a.q, a.k, a.v, a.g.unsqueeze(0),
                                              fox::AttentionOptions().head_first(true)),
                    HasSubstring("head_first") && HasSubstring("log_fgate"));
}

TEST_CASE("backward op checks grad_out, out and lse", "[cpu][errors]") {
  const Args a = good();
  auto [out, lse] = fox::forgetting_attention_forward(a.q, a.k, a.v, a.g, std::nullopt,
                                                      std::nullopt, std::nullopt, std::nullopt);
  const auto dout = at::randn_like(out);
  auto bwd = [&](const at::Tensor& grad_out, const at::Tensor& o, const at::Tensor& l) {
    fox::forgetting_attention_backward(grad_out, a.q, a.k, a.v, a.g, o, l, std::nullopt,
                                       std::nullopt, std::nullopt, std::nullopt);
  };
  CHECK_NOTHROW(bwd(dout, out, lse));
  CHECK_THROWS_AS(bwd(dout.narrow(1, 0, 4), out, lse), c10::Error);
  CHECK_THROWS_WITH(bwd(dout.narrow(1, 0, 4), out, lse), HasSubstring("grad_out must have the shape"));
  CHECK_THROWS_WITH(bwd(dout, out.narrow(1, 0, 4), lse), HasSubstring("out must have the shape"));
  CHECK_THROWS_WITH(bwd(dout, out, lse.transpose(1, 2)), HasSubstring("lse must be"));
  CHECK_THROWS_WITH(bwd(dout, out, lse.to(at::kDouble)), HasSubstring("lse must be"));
  CHECK_THROWS_WITH(bwd(dout, out, lse.narrow(2, 0, 4)), HasSubstring("lse must be"));
}
