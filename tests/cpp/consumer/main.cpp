// Consumer of the installed fox_torch CMake package: runs fox::forgetting_attention on random CPU
// tensors with gradients, checks the result against the plain formula, and prints checksums.
// Exit status 0 when everything is right, 1 otherwise (with the reason on stderr).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <fox/fox.h>

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "fox_consumer: FAILED: %s\n", what.c_str());
    ++failures;
  }
}

bool finite(const at::Tensor& t) { return t.defined() && at::isfinite(t).all().item<bool>(); }

// softmax(q k^T / sqrt(D) + (c_i - c_j)) v, causal, with c = cumsum(log_fgate); GQA by repeat.
at::Tensor reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& g) {
  const int64_t T = q.size(1), H = q.size(2), D = q.size(3), group = H / k.size(2);
  const auto qh = q.permute({0, 2, 1, 3});
  const auto kh = k.repeat_interleave(group, 2).permute({0, 2, 1, 3});
  const auto vh = v.repeat_interleave(group, 2).permute({0, 2, 1, 3});
  const auto c = g.cumsum(1).permute({0, 2, 1});
  const auto s = at::matmul(qh, kh.transpose(-1, -2)) / std::sqrt(static_cast<double>(D)) +
                 c.unsqueeze(-1) - c.unsqueeze(-2);
  const auto causal = at::ones({T, T}, q.options().dtype(at::kBool)).tril();
  const auto p = at::softmax(s.masked_fill(causal.logical_not(), -INFINITY), -1);
  return at::matmul(p, vh).permute({0, 2, 1, 3});
}

}  // namespace

int main() {
  const int64_t B = 2, T = 37, H = 4, Hkv = 2, D = 32;
  at::manual_seed(0);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  auto q = at::randn({B, T, H, D}, f32).requires_grad_(true);
  auto k = at::randn({B, T, Hkv, D}, f32).requires_grad_(true);
  auto v = at::randn({B, T, Hkv, D}, f32).requires_grad_(true);
  auto g = at::log_sigmoid(at::randn({B, T, H}, f32) + 2.0).detach().requires_grad_(true);

  at::Tensor out;
  try {
    out = fox::forgetting_attention(q, k, v, g);
    expect(out.sizes() == q.sizes(), "output shape");
    expect(out.scalar_type() == at::kFloat, "output dtype");
    expect(finite(out), "output is finite");
    out.pow(2).sum().backward();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fox_consumer: FAILED: exception: %s\n", e.what());
    return 1;
  }
  for (const auto* x : {&q, &k, &v, &g}) {
    const auto& grad = x->grad();
    expect(grad.defined(), "gradient is defined");
    if (!grad.defined()) continue;
    expect(grad.sizes() == x->sizes(), "gradient shape");
    expect(finite(grad), "gradient is finite");
    expect(grad.abs().max().item<double>() > 0, "gradient is not all zero");
  }
  if (failures != 0) {
    std::fprintf(stderr, "fox_consumer: %d check(s) failed\n", failures);
    return 1;
  }

  // The same numbers as the formula, in float64.
  auto q64 = q.detach().to(at::kDouble).requires_grad_(true);
  auto k64 = k.detach().to(at::kDouble).requires_grad_(true);
  auto v64 = v.detach().to(at::kDouble).requires_grad_(true);
  auto g64 = g.detach().to(at::kDouble).requires_grad_(true);
  const auto ref = reference(q64, k64, v64, g64);
  ref.pow(2).sum().backward();
  auto err = [](const at::Tensor& a, const at::Tensor& b) {
    return (a.to(at::kDouble) - b).abs().max().item<double>() /
           std::max(1.0, b.abs().max().item<double>());
  };
  const double out_err = err(out.detach(), ref.detach());
  const double grad_err = std::max({err(q.grad(), q64.grad()), err(k.grad(), k64.grad()),
                                    err(v.grad(), v64.grad()), err(g.grad(), g64.grad())});
  expect(out_err < 1e-5, "output matches the reference (rel. error " + std::to_string(out_err) + ")");
  expect(grad_err < 1e-4,
         "gradients match the reference (rel. error " + std::to_string(grad_err) + ")");

  std::printf("built_with_cuda=%d\n", fox::built_with_cuda() ? 1 : 0);
  std::printf("out_sum=%.9g\n", out.detach().sum().item<double>());
  std::printf("grad_sums=%.9g %.9g %.9g %.9g\n", q.grad().sum().item<double>(),
              k.grad().sum().item<double>(), v.grad().sum().item<double>(),
              g.grad().sum().item<double>());
  std::printf("max_rel_error out=%.3g grads=%.3g\n", out_err, grad_err);
  if (failures != 0) {
    std::fprintf(stderr, "fox_consumer: %d check(s) failed\n", failures);
    return 1;
  }
  std::printf("fox_consumer: OK\n");
  return 0;
}
