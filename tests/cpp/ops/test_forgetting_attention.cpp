// fox::forgetting_attention (+ the forward/backward ops) on CPU against the naive formula:
// float64 to 1e-10, float32 tightly, bfloat16/float16 by FlashAttention's "2x the naive error"
// rule; gradients through C++ autograd; the options head_first, seq_start, cu_seqlens, sm_scale,
// adaptive_threshold; strided and empty inputs; determinism.
#include <cmath>
#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "../catch.h"

#include <fox/fox.h>

#include "reference.h"

using namespace fox_test;

namespace {

// Shapes of the main grid: single token, odd head dims (1, 33, 40, 60, 100), the largest (256),
// more than one CPU tile (128 queries x 256 keys), Tq < Tk (chunked prefill, decoding),
// GQA and MQA, and every gate regime ("never forget" .. "forget at once").
const std::vector<Case>& main_cases() {
  static const std::vector<Case> cases = {
      {2, 1, 1, 2, 2, 16, 0},       {2, 63, 63, 4, 4, 40, 0},    {1, 97, 97, 4, 2, 60, 1},
      {1, 300, 300, 2, 1, 64, 2},   {2, 17, 97, 4, 2, 100, 3},   {1, 130, 300, 4, 4, 33, 1},
      {1, 1, 300, 4, 1, 128, 0},    {1, 50, 50, 2, 2, 256, 2},   {3, 20, 20, 4, 4, 1, 3},
      {1, 1025, 1025, 2, 1, 32, 1},
  };
  return cases;
}

void check_grads_close(const Grads& got, const Grads& ref, double tol, double gate_tol) {
  check_close(got.out, ref.out, tol, "out");
  check_close(got.dq, ref.dq, tol, "dq");
  check_close(got.dk, ref.dk, tol, "dk");
  check_close(got.dv, ref.dv, tol, "dv");
  check_close(got.dg, ref.dg, gate_tol, "dlog_fgate");
}

void check_grads_2x(const Grads& got, const Grads& ref64, const Grads& naive, double floor) {
  check_2x_naive(got.out, ref64.out, naive.out, floor, "out");
  check_2x_naive(got.dq, ref64.dq, naive.dq, floor, "dq");
  check_2x_naive(got.dk, ref64.dk, naive.dk, floor, "dk");
  check_2x_naive(got.dv, ref64.dv, naive.dv, floor, "dv");
  check_2x_naive(got.dg, ref64.dg, naive.dg, floor, "dlog_fgate");
}

void check_dtypes(const Grads& got, const Inputs& in) {
  CHECK(got.out.scalar_type() == in.q.scalar_type());
  CHECK(got.out.sizes() == in.q.sizes());
  CHECK(got.dq.scalar_type() == in.q.scalar_type());
  CHECK(got.dk.scalar_type() == in.k.scalar_type());
  CHECK(got.dv.scalar_type() == in.v.scalar_type());
  CHECK(got.dg.scalar_type() == in.g.scalar_type());
  CHECK(got.dq.sizes() == in.q.sizes());
  CHECK(got.dk.sizes() == in.k.sizes());
  CHECK(got.dv.sizes() == in.v.sizes());
  CHECK(got.dg.sizes() == in.g.sizes());
}

}  // namespace

TEST_CASE("float64: output and autograd gradients match the fp64 reference to 1e-10",
          "[cpu][float64][autograd]") {
  const Case c = GENERATE(from_range(main_cases()));
  // float32 gates with float64 q are allowed too; their gradient is then rounded to float32.
  const at::ScalarType gate_dtype = GENERATE(at::kDouble, at::kFloat);
  CAPTURE(describe(c), gate_dtype);
  at::manual_seed(1);
  const Inputs in = make_inputs(c, at::kDouble, gate_dtype);
  const auto dout = at::randn_like(in.q);

  const Grads got = run_with_grads(fox_fn(), in, dout);
  const Grads ref = run_with_grads(reference64_fn(), in, dout, at::kDouble, at::kDouble);
  check_dtypes(got, in);
  check_grads_close(got, ref, 1e-10, gate_dtype == at::kDouble ? 1e-10 : 2e-7);
}

TEST_CASE("float32: output and gradients match the fp64 reference tightly",
          "[cpu][float32][autograd]") {
  const Case c = GENERATE(from_range(main_cases()));
  CAPTURE(describe(c));
  at::manual_seed(2);
  const Inputs in = make_inputs(c, at::kFloat, at::kFloat);
  const auto dout = at::randn_like(in.q);

  const Grads got = run_with_grads(fox_fn(), in, dout);
  const Grads ref = run_with_grads(reference64_fn(), in, dout, at::kDouble, at::kDouble);
  const Grads naive = run_with_grads(reference_fn(), in, dout);
  check_dtypes(got, in);
  // The kernel keeps gate sums relative to nearby anchors, so it stays close to fp64 even where
  // the naive float32 formula cancels badly ("forget at once" heads, long sequences).
  check_grads_close(got, ref, 2e-5, 2e-5);
  check_2x_naive(got.out, ref.out, naive.out, 1e-6, "out");
}

// design.md section 5: the error against fp64 is at most 2x that of the naive formula evaluated
// in the kernel's precision (float32 for the CPU kernels), plus a small floor.
TEST_CASE("float32: gradients within 2x the naive float32 error",
          "[cpu][float32][autograd][2x]") {
  const Case c = GENERATE(from_range(main_cases()));
  CAPTURE(describe(c));
  at::manual_seed(2);
  const Inputs in = make_inputs(c, at::kFloat, at::kFloat);
  const auto dout = at::randn_like(in.q);

  const Grads got = run_with_grads(fox_fn(), in, dout);
  const Grads ref = run_with_grads(reference64_fn(), in, dout, at::kDouble, at::kDouble);
  const Grads naive = run_with_grads(reference_fn(), in, dout);
  check_grads_2x(got, ref, naive, 1e-6);
}

TEST_CASE("bfloat16 and float16: within 2x the naive low-precision error",
          "[cpu][bfloat16][float16][autograd]") {
  const Case c = GENERATE(values<Case>({{2, 63, 63, 4, 4, 40, 0},
                                        {1, 97, 97, 4, 2, 64, 1},
                                        {2, 17, 300, 4, 2, 100, 3},
                                        {1, 300, 300, 2, 1, 128, 2},
                                        {1, 1, 77, 2, 2, 256, 0}}));
  const at::ScalarType dtype = GENERATE(at::kBFloat16, at::kHalf);
  CAPTURE(describe(c), dtype);
  at::manual_seed(3);
  const Inputs in = make_inputs(c, dtype, at::kFloat);
  const auto dout = at::randn_like(in.q);

  const Grads got = run_with_grads(fox_fn(), in, dout);
  const Grads ref = run_with_grads(reference64_fn(), in, dout, at::kDouble, at::kDouble);
  const Grads naive = run_with_grads(reference_fn(), in, dout);
  check_dtypes(got, in);
  check_grads_2x(got, ref, naive, 1e-4);
  const double eps = dtype == at::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;  // one ulp at 1.0
  check_grads_close(got, ref, 2 * eps, 2 * eps);
}

TEST_CASE("forward op returns out and lse, backward op returns the reference gradients",
          "[cpu][ops]") {
  const Case c = GENERATE(values<Case>({{2, 40, 97, 4, 2, 32, 0}, {1, 260, 260, 2, 2, 64, 1}}));
  const at::ScalarType dtype = GENERATE(at::kDouble, at::kFloat);
  CAPTURE(describe(c), dtype);
  at::manual_seed(4);
  const Inputs in = make_inputs(c, dtype, dtype);
  const double tol = dtype == at::kDouble ? 1e-10 : 2e-5;
  const auto stat_dtype = dtype == at::kDouble ? at::kDouble : at::kFloat;

  auto [out, lse] = fox::forgetting_attention_forward(in.q, in.k, in.v, in.g, std::nullopt,
                                                      std::nullopt, std::nullopt, std::nullopt);
  REQUIRE(out.sizes() == in.q.sizes());
  CHECK(out.scalar_type() == dtype);
  REQUIRE(lse.sizes() == at::IntArrayRef({c.B, c.H, c.Tq}));
  CHECK(lse.scalar_type() == stat_dtype);
  CHECK_FALSE(out.requires_grad());

  const auto ref = reference(in.q.to(at::kDouble), in.k.to(at::kDouble), in.v.to(at::kDouble),
                             in.g.to(at::kDouble));
  check_close(out, ref.out, tol, "out");
  check_close(lse, ref.lse, tol, "lse");

  const auto dout = at::randn_like(in.q);
  auto [dq, dk, dv, dg] = fox::forgetting_attention_backward(
      dout, in.q, in.k, in.v, in.g, out, lse, std::nullopt, std::nullopt, std::nullopt,
      std::nullopt);
  const Grads rg = run_with_grads(reference64_fn(), in, dout, at::kDouble, at::kDouble);
  CHECK(dq.scalar_type() == dtype);
  CHECK(dg.scalar_type() == dtype);
  check_close(dq, rg.dq, tol, "dq");
  check_close(dk, rg.dk, tol, "dk");
  check_close(dv, rg.dv, tol, "dv");
  check_close(dg, rg.dg, tol, "dlog_fgate");
}

TEST_CASE("head_first: (B, H, T, D) layout, forward and gradients", "[cpu][options][autograd]") {
  const Case c{2, 37, 77, 4, 2, 24, 1};
  at::manual_seed(5);
  const Inputs bthd = make_inputs(c, at::kDouble, at::kDouble);
  // Head-first inputs, made contiguous in that layout.
  const Inputs bhtd{bthd.q.transpose(1, 2).contiguous(), bthd.k.transpose(1, 2).contiguous(),
                    bthd.v.transpose(1, 2).contiguous(), bthd.g.transpose(1, 2).contiguous()};
  const auto dout = at::randn({c.B, c.H, c.Tq, c.D}, bthd.q.options());

  const Grads got = run_with_grads(fox_fn(fox::AttentionOptions().head_first(true)), bhtd, dout);
  const AttentionFn ref_fn = [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& g) {
    return reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2))
        .out.transpose(1, 2);
  };
  const Grads ref = run_with_grads(ref_fn, bhtd, dout, at::kDouble, at::kDouble);
  check_dtypes(got, bhtd);
  check_grads_close(got, ref, 1e-10, 1e-10);

  // Same numbers as the default layout.
  const auto plain = fox::forgetting_attention(bthd.q, bthd.k, bthd.v, bthd.g);
  check_close(got.out.transpose(1, 2), plain, 1e-12, "head_first vs (B, T, H, D)");
}

TEST_CASE("seq_start masks the keys before it", "[cpu][options][autograd]") {
  SECTION("every query sees at least one key (Tq < Tk, GQA)") {
    const Case c{3, 40, 97, 4, 2, 32, 2};
    // 57 == Tk - Tq: the first query of that sequence sees exactly one key.
    const std::vector<int64_t> starts = {0, 13, 57};
    const at::ScalarType index_dtype = GENERATE(at::kLong, at::kInt);
    const at::ScalarType dtype = GENERATE(at::kDouble, at::kFloat);
    CAPTURE(index_dtype, dtype);
    at::manual_seed(6);
    const auto seq_start = at::tensor(starts, at::kLong).to(index_dtype);
    const Inputs in = make_inputs(c, dtype, dtype);
    const auto dout = at::randn_like(in.q);

    const Grads got = run_with_grads(fox_fn(fox::AttentionOptions().seq_start(seq_start)), in, dout);
    const Grads ref =
        run_with_grads(reference64_fn(seq_start), in, dout, at::kDouble, at::kDouble);
    check_dtypes(got, in);
    const double tol = dtype == at::kDouble ? 1e-10 : 2e-5;
    check_grads_close(got, ref, tol, tol);
    // Masked keys get no gradient at all.
    for (int64_t b = 0; b < c.B; ++b) {
      CHECK(max_abs(got.dk[b].narrow(0, 0, starts[b])) == 0.0);
      CHECK(max_abs(got.dv[b].narrow(0, 0, starts[b])) == 0.0);
    }
    // Without seq_start the result differs (the option is not ignored).
    const auto unmasked = fox::forgetting_attention(in.q, in.k, in.v, in.g);
    CHECK(max_abs_diff(unmasked[1], got.out[1]) > 1e-3);
  }

  SECTION("queries before seq_start see no key: zero output, finite gradients") {
    const Case c{2, 50, 50, 2, 2, 16, 3};
    const auto seq_start = at::tensor(std::vector<int64_t>{10, 0}, at::kLong);
    at::manual_seed(7);
    const Inputs in = make_inputs(c, at::kDouble, at::kDouble);
    const auto dout = at::randn_like(in.q);
    const Grads got = run_with_grads(fox_fn(fox::AttentionOptions().seq_start(seq_start)), in, dout);
    const Grads ref =
        run_with_grads(reference64_fn(seq_start), in, dout, at::kDouble, at::kDouble);
    CHECK(max_abs(got.out[0].narrow(0, 0, 10)) == 0.0);
    check_grads_close(got, ref, 1e-10, 1e-10);

    auto [out, lse] = fox::forgetting_attention_forward(in.q, in.k, in.v, in.g, seq_start,
                                                        std::nullopt, std::nullopt, std::nullopt);
    const auto empty_rows = lse[0].narrow(1, 0, 10);
    CHECK(at::isneginf(empty_rows).all().item<bool>());
    CHECK(at::isfinite(lse[0].narrow(1, 10, 40)).all().item<bool>());
    CHECK(at::isfinite(lse[1]).all().item<bool>());
  }
}

TEST_CASE("cu_seqlens: packed variable-length batch", "[cpu][options][autograd]") {
  // Lengths 1, 63, 0, 136, 257: an empty sequence, and one longer than a key tile.
  const std::vector<int64_t> cu = {0, 1, 64, 64, 200, 457};
  const Case c{1, 457, 457, 4, 2, 48, 1};
  const at::ScalarType index_dtype = GENERATE(at::kLong, at::kInt);
  const at::ScalarType dtype = GENERATE(at::kDouble, at::kFloat);
  CAPTURE(index_dtype, dtype);
  at::manual_seed(8);
  const Inputs in = make_inputs(c, dtype, dtype);
  const auto dout = at::randn_like(in.q);
  const auto cu_seqlens = at::tensor(cu, at::kLong).to(index_dtype);

  const Grads got = run_with_grads(fox_fn(fox::AttentionOptions().cu_seqlens(cu_seqlens)), in, dout);
  const AttentionFn ref_fn = [&cu](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& g) {
    return reference_varlen(q, k, v, g, cu).out;
  };
  const Grads ref = run_with_grads(ref_fn, in, dout, at::kDouble, at::kDouble);
  check_dtypes(got, in);
  const double tol = dtype == at::kDouble ? 1e-10 : 2e-5;
  check_grads_close(got, ref, tol, tol);

  // The lse of the forward op, too.
  auto [out, lse] = fox::forgetting_attention_forward(in.q, in.k, in.v, in.g, std::nullopt,
                                                      cu_seqlens, std::nullopt, std::nullopt);
  const auto ref_fwd = reference_varlen(in.q.to(at::kDouble), in.k.to(at::kDouble),
                                        in.v.to(at::kDouble), in.g.to(at::kDouble), cu);
  check_close(lse, ref_fwd.lse, tol, "lse");

  // One sequence spanning the batch is the plain call.
  const auto whole = at::tensor(std::vector<int64_t>{0, c.Tk}, at::kLong).to(index_dtype);
  const auto one = fox::forgetting_attention(in.q, in.k, in.v, in.g,
                                             fox::AttentionOptions().cu_seqlens(whole));
  const auto plain = fox::forgetting_attention(in.q, in.k, in.v, in.g);
  check_close(one, plain, dtype == at::kDouble ? 1e-12 : 1e-6, "cu_seqlens {0, T} vs plain");
}

TEST_CASE("sm_scale replaces 1/sqrt(head_dim)", "[cpu][options][autograd]") {
  const double scale = GENERATE(0.0, 0.37, 2.0);
  CAPTURE(scale);
  const Case c{2, 30, 61, 4, 1, 20, 2};
  at::manual_seed(9);
  const Inputs in = make_inputs(c, at::kDouble, at::kDouble);
  const auto dout = at::randn_like(in.q);
  const Grads got = run_with_grads(fox_fn(fox::AttentionOptions().sm_scale(scale)), in, dout);
  const Grads ref =
      run_with_grads(reference64_fn(std::nullopt, scale), in, dout, at::kDouble, at::kDouble);
  check_grads_close(got, ref, 1e-10, 1e-10);
  // The default differs from these scales.
  const auto dflt = fox::forgetting_attention(in.q, in.k, in.v, in.g);
  CHECK(max_abs_diff(dflt, got.out) > 1e-3);
}

TEST_CASE("adaptive_threshold prunes key tiles", "[cpu][options][pruning]") {
  const int64_t B = 1, T = 1024, H = 2, D = 16;
  at::manual_seed(10);
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  Inputs in{at::randn({B, T, H, D}, opts), at::randn({B, T, H, D}, opts),
            at::randn({B, T, H, D}, opts), at::Tensor()};

  SECTION("a threshold from the ACP bound loses at most eps of each row's mass") {
    in.g = -(0.5 + at::rand({B, T, H}, opts));  // fast forgetting: far tiles are prunable
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    const double U = in.q.norm(2, -1).max().item<double>() * in.k.norm(2, -1).max().item<double>() *
                     scale;
    const double eps = 1e-6;
    const double threshold = -2 * U - std::log(static_cast<double>(T)) + std::log(eps);
    CAPTURE(threshold);
    const auto dout = at::randn_like(in.q);
    const Grads got =
        run_with_grads(fox_fn(fox::AttentionOptions().adaptive_threshold(threshold)), in, dout);
    const Grads ref = run_with_grads(reference64_fn(), in, dout);
    // Moving eps of the mass moves the output by at most 2 eps max|v|.
    const double bound = 2 * eps * max_abs(in.v) + 1e-12;
    CHECK(max_abs_diff(got.out, ref.out) <= bound);
    check_close(got.dq, ref.dq, 1e-4, "dq");
    check_close(got.dk, ref.dk, 1e-4, "dk");
    check_close(got.dv, ref.dv, 1e-4, "dv");
    check_close(got.dg, ref.dg, 1e-4, "dlog_fgate");
  }

  SECTION("-inf prunes nothing; an aggressive threshold changes the result") {
    in.g = -(0.005 + 0.01 * at::rand({B, T, H}, opts));  // slow forgetting: far keys matter
    const auto plain = fox::forgetting_attention(in.q, in.k, in.v, in.g);
    const auto none = fox::forgetting_attention(
        in.q, in.k, in.v, in.g,
        fox::AttentionOptions().adaptive_threshold(-std::numeric_limits<double>::infinity()));
    CHECK(at::equal(plain, none));
    const auto pruned = fox::forgetting_attention(in.q, in.k, in.v, in.g,
                                                  fox::AttentionOptions().adaptive_threshold(-1.0));
    CHECK(max_abs_diff(plain, pruned) > 1e-3);
  }
}

TEST_CASE("strided (non-contiguous) inputs", "[cpu][layout][autograd]") {
  const int64_t B = 2, Tq = 33, Tk = 70, H = 4, Hkv = 2, D = 24;
  at::manual_seed(11);
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  // The leaves are storage tensors; the attention inputs are strided views of them.
  const Inputs storage{at::randn({B, Tq, H, D + 8}, opts), at::randn({B, Hkv, Tk, D}, opts),
                       at::randn({B, Tk, Hkv, 2 * D}, opts),
                       at::log_sigmoid(at::randn({B, H, Tk}, opts) + 2)};
  auto views = [=](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& g) {
    return Inputs{q.narrow(-1, 0, D),              // padded rows
                  k.transpose(1, 2),               // head-major storage
                  v.slice(-1, 0, 2 * D, 2),        // last stride 2
                  g.transpose(1, 2)};              // (B, T, H) view of (B, H, T)
  };
  const Inputs in = views(storage.q, storage.k, storage.v, storage.g);
  REQUIRE_FALSE(in.q.is_contiguous());
  REQUIRE_FALSE(in.k.is_contiguous());
  REQUIRE(in.v.stride(-1) == 2);
  REQUIRE_FALSE(in.g.is_contiguous());
  const auto dout = at::randn({B, H, Tq, D}, opts).transpose(1, 2);  // strided grad_out too

  auto through_views = [&](const AttentionFn& fn) -> AttentionFn {
    return [=](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& g) {
      const Inputs x = views(q, k, v, g);
      return fn(x.q, x.k, x.v, x.g);
    };
  };
  const Grads got = run_with_grads(through_views(fox_fn()), storage, dout);
  const Grads ref = run_with_grads(through_views(reference64_fn()), storage, dout);
  check_grads_close(got, ref, 1e-10, 1e-10);

  // Same numbers as contiguous copies.
  const auto contig = fox::forgetting_attention(in.q.contiguous(), in.k.contiguous(),
                                                in.v.contiguous(), in.g.contiguous());
  check_close(got.out, contig, 1e-12, "strided vs contiguous");
}

TEST_CASE("empty inputs give empty outputs and zero gradients", "[cpu][edge]") {
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  struct Shape {
    int64_t B, Tq, Tk;
  };
  const Shape s = GENERATE(values<Shape>({{0, 5, 5}, {2, 0, 5}, {1, 0, 0}}));
  CAPTURE(s.B, s.Tq, s.Tk);
  const int64_t H = 2, D = 8;
  Inputs in{at::randn({s.B, s.Tq, H, D}, opts), at::randn({s.B, s.Tk, H, D}, opts),
            at::randn({s.B, s.Tk, H, D}, opts), at::log_sigmoid(at::randn({s.B, s.Tk, H}, opts))};
  const auto dout = at::randn_like(in.q);
  const Grads got = run_with_grads(fox_fn(), in, dout);
  check_dtypes(got, in);
  CHECK(max_abs(got.dk) == 0.0);
  CHECK(max_abs(got.dv) == 0.0);
  CHECK(max_abs(got.dg) == 0.0);
}

TEST_CASE("both backward schedules (fused per kv head, split over key tiles) are right",
          "[cpu][autograd][threads]") {
  // The CPU backward runs one fused pass per (sequence, kv head) when those fill the threads,
  // else it spreads key tiles over the threads and computes dQ in a second pass. 1 thread takes
  // the first, 8 threads the second (batch * kv heads = 2 here).
  const int threads = GENERATE(1, 8);
  const at::ScalarType dtype = GENERATE(at::kDouble, at::kBFloat16);
  CAPTURE(threads, dtype);
  const Case c{1, 200, 600, 4, 2, 48, 1};
  at::manual_seed(13);
  const Inputs in = make_inputs(c, dtype, dtype == at::kDouble ? at::kDouble : at::kFloat);
  const auto dout = at::randn_like(in.q);
  Grads got;
  {
    struct ThreadsGuard {
      int saved = at::get_num_threads();
      ~ThreadsGuard() { at::set_num_threads(saved); }
    } guard;
    at::set_num_threads(threads);
    got = run_with_grads(fox_fn(), in, dout);
  }
  const Grads ref = run_with_grads(reference64_fn(), in, dout, at::kDouble, at::kDouble);
  if (dtype == at::kDouble) {
    check_grads_close(got, ref, 1e-10, 1e-10);
  } else {
    check_grads_2x(got, ref, run_with_grads(reference_fn(), in, dout), 1e-4);
  }
}

TEST_CASE("results are deterministic", "[cpu][determinism]") {
  const Case c{2, 200, 300, 4, 2, 64, 1};
  at::manual_seed(12);
  const Inputs in = make_inputs(c, at::kFloat, at::kFloat);
  const auto dout = at::randn_like(in.q);
  const Grads a = run_with_grads(fox_fn(), in, dout);
  const Grads b = run_with_grads(fox_fn(), in, dout);
  CHECK(at::equal(a.out, b.out));
  CHECK(at::equal(a.dq, b.dq));
  CHECK(at::equal(a.dk, b.dk));
  CHECK(at::equal(a.dv, b.dv));
  CHECK(at::equal(a.dg, b.dg));
}
