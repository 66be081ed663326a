// [cuda] cases: the CUDA kernels against the CPU result and the fp64 reference (bf16 and fp16,
// forward and C++ autograd), options on CUDA, and device-mismatch errors. They skip with a
// warning where there is no GPU (or the library was built without its CUDA kernels).
#include <optional>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include "../catch.h"
#include <torch/cuda.h>

#include <fox/fox.h>

#include "reference.h"

using namespace fox_test;

namespace {

bool cuda_ready() {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: [cuda] case skipped");
    return false;
  }
  if (!fox::built_with_cuda()) {
    WARN("fox_torch was built without CUDA kernels: [cuda] case skipped");
    return false;
  }
  return true;
}

Inputs to_cuda(const Inputs& in) {
  return {in.q.cuda(), in.k.cuda(), in.v.cuda(), in.g.cuda()};
}

// The CUDA result: within 2x the naive low-precision error of the fp64 reference, and as close
// to the CPU result (fp32 compute) as the triangle inequality allows.
void check_cuda(const at::Tensor& cuda, const at::Tensor& cpu, const at::Tensor& ref64,
                const at::Tensor& naive, const std::string& what) {
  REQUIRE(cuda.defined());
  CHECK(cuda.is_cuda());
  CHECK(cuda.scalar_type() == cpu.scalar_type());
  CHECK(cuda.sizes() == cpu.sizes());
  const double floor = 1e-3 * std::max(1.0, max_abs(ref64));
  check_2x_naive(cuda, ref64, naive, 1e-3, what + " (CUDA vs fp64)");
  const double err = max_abs_diff(cuda, cpu);
  const double bound = 3.0 * max_abs_diff(naive, ref64) + floor;
  INFO(what << " (CUDA vs CPU): max|cuda - cpu| = " << err << ", bound " << bound);
  CHECK(err <= bound);
}

void check_all(const Grads& cuda, const Grads& cpu, const Grads& ref64, const Grads& naive) {
  check_cuda(cuda.out, cpu.out, ref64.out, naive.out, "out");
  check_cuda(cuda.dq, cpu.dq, ref64.dq, naive.dq, "dq");
  check_cuda(cuda.dk, cpu.dk, ref64.dk, naive.dk, "dk");
  check_cuda(cuda.dv, cpu.dv, ref64.dv, naive.dv, "dv");
  check_cuda(cuda.dg, cpu.dg, ref64.dg, naive.dg, "dlog_fgate");
}

}  // namespace

TEST_CASE("CUDA bf16/fp16 forward and autograd gradients match the CPU and the fp64 reference",
          "[cuda][autograd]") {
  if (!cuda_ready()) return;
  const Case c = GENERATE(values<Case>({{2, 128, 128, 4, 4, 64, 0},
                                        {1, 97, 300, 8, 2, 128, 1},
                                        {2, 63, 63, 4, 1, 40, 2},
                                        {1, 1025, 1025, 2, 2, 100, 3},
                                        {1, 1, 513, 4, 2, 64, 0},
                                        {2, 50, 50, 2, 2, 256, 1}}));
  const at::ScalarType dtype = GENERATE(at::kBFloat16, at::kHalf);
  CAPTURE(describe(c), dtype);
  at::manual_seed(20);
  const Inputs in = make_inputs(c, dtype, at::kFloat);
  const auto dout = at::randn_like(in.q);

  const Grads cuda = run_with_grads(fox_fn(), to_cuda(in), dout.cuda());
  const Grads cpu = run_with_grads(fox_fn(), in, dout);
  const Grads ref = run_with_grads(reference64_fn(), in, dout, at::kDouble, at::kDouble);
  const Grads naive = run_with_grads(reference_fn(), in, dout);
  CHECK(cuda.dg.scalar_type() == at::kFloat);
  check_all(cuda, cpu, ref, naive);
}

TEST_CASE("CUDA forward op: lse matches the CPU", "[cuda][ops]") {
  if (!cuda_ready()) return;
  const Case c{2, 70, 200, 4, 2, 64, 1};
  at::manual_seed(21);
  const Inputs in = make_inputs(c, at::kBFloat16, at::kFloat);
  const Inputs d = to_cuda(in);
  auto [out, lse] = fox::forgetting_attention_forward(d.q, d.k, d.v, d.g, std::nullopt,
                                                      std::nullopt, std::nullopt, std::nullopt);
  auto [out_cpu, lse_cpu] = fox::forgetting_attention_forward(
      in.q, in.k, in.v, in.g, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
  CHECK(lse.is_cuda());
  CHECK(lse.scalar_type() == at::kFloat);
  REQUIRE(lse.sizes() == lse_cpu.sizes());
  // lse of bf16 inputs: the scores differ by bf16 rounding of the products at most.
  check_close(lse, lse_cpu, 2e-2, "lse CUDA vs CPU");
}

TEST_CASE("CUDA options: seq_start, cu_seqlens, head_first, sm_scale (bf16, autograd)",
          "[cuda][options][autograd]") {
  if (!cuda_ready()) return;
  at::manual_seed(22);
  const at::ScalarType dtype = at::kBFloat16;

  SECTION("seq_start") {
    const Case c{3, 40, 97, 4, 2, 64, 2};
    const auto seq_start = at::tensor(std::vector<int64_t>{0, 13, 57}, at::kLong);
    const Inputs in = make_inputs(c, dtype, at::kFloat);
    const auto dout = at::randn_like(in.q);
    const Grads cuda = run_with_grads(
        fox_fn(fox::AttentionOptions().seq_start(seq_start.cuda())), to_cuda(in), dout.cuda());
    const Grads cpu = run_with_grads(fox_fn(fox::AttentionOptions().seq_start(seq_start)), in, dout);
    const Grads ref =
        run_with_grads(reference64_fn(seq_start), in, dout, at::kDouble, at::kDouble);
    const Grads naive = run_with_grads(reference_fn(seq_start), in, dout);
    check_all(cuda, cpu, ref, naive);
  }

  SECTION("cu_seqlens") {
    const std::vector<int64_t> cu = {0, 1, 64, 64, 200, 457};
    const Case c{1, 457, 457, 4, 2, 64, 1};
    const auto cu_seqlens = at::tensor(cu, at::kInt);
    const Inputs in = make_inputs(c, dtype, at::kFloat);
    const auto dout = at::randn_like(in.q);
    const Grads cuda = run_with_grads(
        fox_fn(fox::AttentionOptions().cu_seqlens(cu_seqlens.cuda())), to_cuda(in), dout.cuda());
    const Grads cpu =
        run_with_grads(fox_fn(fox::AttentionOptions().cu_seqlens(cu_seqlens)), in, dout);
    const AttentionFn ref_fn = [&cu](const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& g) {
      return reference_varlen(q, k, v, g, cu).out;
    };
    const Grads ref = run_with_grads(ref_fn, in, dout, at::kDouble, at::kDouble);
    const Grads naive = run_with_grads(ref_fn, in, dout);
    check_all(cuda, cpu, ref, naive);
  }

  SECTION("head_first and sm_scale") {
    const Case c{2, 64, 64, 4, 4, 128, 3};
    const Inputs in = make_inputs(c, dtype, at::kFloat);
    const Inputs hf{in.q.transpose(1, 2).contiguous(), in.k.transpose(1, 2).contiguous(),
                    in.v.transpose(1, 2).contiguous(), in.g.transpose(1, 2).contiguous()};
    const auto opts = fox::AttentionOptions().head_first(true).sm_scale(0.05);
    const auto dout = at::randn({c.B, c.H, c.Tq, c.D}, in.q.options());
    const Grads cuda = run_with_grads(fox_fn(opts), to_cuda(hf), dout.cuda());
    const Grads cpu = run_with_grads(fox_fn(opts), hf, dout);
    auto ref_fn = [](bool to64) -> AttentionFn {
      return [to64](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& g) {
        auto t = [&](const at::Tensor& x) { return (to64 ? x.to(at::kDouble) : x).transpose(1, 2); };
        return reference(t(q), t(k), t(v), t(g), std::nullopt, 0.05).out.transpose(1, 2);
      };
    };
    const Grads ref = run_with_grads(ref_fn(true), hf, dout, at::kDouble, at::kDouble);
    const Grads naive = run_with_grads(ref_fn(false), hf, dout);
    check_all(cuda, cpu, ref, naive);
  }
}

TEST_CASE("CUDA: tensors on different devices are rejected", "[cuda][errors]") {
  if (!cuda_ready()) return;
  const Case c{2, 5, 7, 4, 2, 16, 0};
  const Inputs in = make_inputs(c, at::kBFloat16, at::kFloat);
  const Inputs d = to_cuda(in);
  using fox_test::HasSubstring;
  CHECK_THROWS_AS(fox::forgetting_attention(d.q, in.k, d.v, d.g), c10::Error);
  CHECK_THROWS_WITH(fox::forgetting_attention(d.q, in.k, d.v, d.g), HasSubstring("one device"));
  CHECK_THROWS_WITH(fox::forgetting_attention(d.q, d.k, d.v, in.g), HasSubstring("log_fgate"));
  CHECK_THROWS_WITH(
      fox::forgetting_attention(
          d.q, d.k, d.v, d.g,
          fox::AttentionOptions().seq_start(at::tensor(std::vector<int64_t>{0, 1}, at::kLong))),
      HasSubstring("seq_start must be on the same device"));
}
