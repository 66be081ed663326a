// Shared helpers of the fox_ops_tests: the naive Forgetting Attention formula written with ATen
// ops (fp64 reference, or the same formula in a low precision for the "2x the naive error" rule),
// input generators and comparison helpers.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "../catch.h"

#include <cstdlib>
#include <iostream>

#include <fox/fox.h>

namespace fox_test {

// FOX_TEST_VERBOSE=1 prints every measured error (to tune or audit tolerances).
inline bool verbose() {
  static const bool v = std::getenv("FOX_TEST_VERBOSE") != nullptr;
  return v;
}

// One problem size. Queries are the last Tq of the Tk positions; H % Hkv == 0 (GQA/MQA).
// gate_shift picks which gate regime each head gets (see make_log_fgate).
struct Case {
  int64_t B, Tq, Tk, H, Hkv, D;
  int gate_shift = 0;
};

inline std::string describe(const Case& c) {
  std::ostringstream s;
  s << "B=" << c.B << " Tq=" << c.Tq << " Tk=" << c.Tk << " H=" << c.H << " Hkv=" << c.Hkv
    << " D=" << c.D << " gate_shift=" << c.gate_shift;
  return s.str();
}

// Log forget gates (B, T, H) in float64, all < 0, one regime per head ((h + shift) % 4):
//   0: "never forget"      log f in [-1.1e-6, -1e-7]
//   1: "forget at once"    log f in [-25, -15]
//   2: slow forgetting     logsigmoid(2 z + 4)
//   3: fast forgetting     logsigmoid(z)
inline at::Tensor make_log_fgate(int64_t B, int64_t T, int64_t H, int shift) {
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  auto g = at::empty({B, T, H}, opts);
  for (int64_t h = 0; h < H; ++h) {
    at::Tensor x;
    switch ((h + shift) % 4) {
      case 0: x = -(1e-7 + 1e-6 * at::rand({B, T}, opts)); break;
      case 1: x = -(15.0 + 10.0 * at::rand({B, T}, opts)); break;
      case 2: x = at::log_sigmoid(2.0 * at::randn({B, T}, opts) + 4.0); break;
      default: x = at::log_sigmoid(at::randn({B, T}, opts)); break;
    }
    g.select(2, h).copy_(x);
  }
  return g;
}

struct Inputs {
  at::Tensor q, k, v, g;
};

// Fresh random inputs (never zeros) in `dtype` (q, k, v) and `gate_dtype` (log_fgate).
inline Inputs make_inputs(const Case& c, at::ScalarType dtype, at::ScalarType gate_dtype,
                          at::Device device = at::kCPU) {
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  Inputs in;
  in.q = at::randn({c.B, c.Tq, c.H, c.D}, opts).to(device, dtype);
  in.k = at::randn({c.B, c.Tk, c.Hkv, c.D}, opts).to(device, dtype);
  in.v = at::randn({c.B, c.Tk, c.Hkv, c.D}, opts).to(device, dtype);
  in.g = make_log_fgate(c.B, c.Tk, c.H, c.gate_shift).to(device, gate_dtype);
  return in;
}

struct RefResult {
  at::Tensor out;  // (B, Tq, H, D)
  at::Tensor lse;  // (B, H, Tq), -inf for rows without a visible key
};

// The plain formula, computed in the dtypes of its inputs: c = cumsum(log f), d_ij = c_i - c_j,
// s = scale q.k + d, causal (query i at position i + Tk - Tq) and seq_start masks, softmax, P V.
// Rows with no visible key give zeros. With low-precision q, k, v and float32 gates this is the
// "naive formula in the kernel's precision": scores in the input dtype, bias and softmax in
// float32, P rounded to the input dtype before P V.
inline RefResult reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& g, const std::optional<at::Tensor>& seq_start = {},
                           std::optional<double> sm_scale = {}) {
  const int64_t B = q.size(0), Tq = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t Tk = k.size(1), Hkv = k.size(2);
  const double scale = sm_scale.value_or(1.0 / std::sqrt(static_cast<double>(D)));
  const auto qh = q.permute({0, 2, 1, 3});
  const auto kh = k.repeat_interleave(H / Hkv, 2).permute({0, 2, 1, 3});
  const auto vh = v.repeat_interleave(H / Hkv, 2).permute({0, 2, 1, 3});
  const auto idx = at::TensorOptions().dtype(at::kLong).device(q.device());
  const auto pos = at::arange(Tq, idx) + (Tk - Tq);  // key position of each query
  const auto j = at::arange(Tk, idx);

  const auto c = g.cumsum(1).permute({0, 2, 1});                      // (B, H, Tk)
  const auto d = c.index_select(2, pos).unsqueeze(-1) - c.unsqueeze(-2);  // (B, H, Tq, Tk)
  const auto s = at::matmul(qh, kh.transpose(-1, -2)) * scale + d;

  auto mask = j.view({1, 1, 1, Tk}) <= pos.view({1, 1, Tq, 1});
  if (seq_start.has_value()) {
    mask = mask & (j.view({1, 1, 1, Tk}) >= seq_start->to(idx).view({B, 1, 1, 1}));
  }
  mask = mask.expand(s.sizes());
  const auto s_masked = s.masked_fill(mask.logical_not(), -std::numeric_limits<double>::infinity());
  const auto any = mask.any(-1, /*keepdim=*/true);
  const auto p = at::softmax(at::where(any, s_masked, 0.0), -1) * any;
  RefResult r;
  r.out = at::matmul(p.to(vh.scalar_type()), vh).permute({0, 2, 1, 3}).to(q.scalar_type());
  r.lse = at::logsumexp(s_masked, -1);
  return r;
}

// Packed variable-length batch (B == 1): the reference of each sequence, concatenated.
inline RefResult reference_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& g, const std::vector<int64_t>& cu_seqlens,
                                  std::optional<double> sm_scale = {}) {
  std::vector<at::Tensor> outs, lses;
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const int64_t b = cu_seqlens[s], n = cu_seqlens[s + 1] - b;
    if (n == 0) continue;
    auto r = reference(q.narrow(1, b, n), k.narrow(1, b, n), v.narrow(1, b, n), g.narrow(1, b, n),
                       std::nullopt, sm_scale);
    outs.push_back(r.out);
    lses.push_back(r.lse);
  }
  return {at::cat(outs, 1), at::cat(lses, 2)};
}

// Output and gradients of one attention function.
struct Grads {
  at::Tensor out, dq, dk, dv, dg;
};

using AttentionFn = std::function<at::Tensor(const at::Tensor&, const at::Tensor&,
                                             const at::Tensor&, const at::Tensor&)>;

// Runs fn on leaf copies of the inputs (cast to the given dtypes, requires_grad on q, k, v and
// log_fgate), calls backward(dout) and collects the .grad() of each leaf.
inline Grads run_with_grads(const AttentionFn& fn, const Inputs& in, const at::Tensor& dout,
                            std::optional<at::ScalarType> dtype = {},
                            std::optional<at::ScalarType> gate_dtype = {}) {
  auto leaf = [](const at::Tensor& x, std::optional<at::ScalarType> dt) {
    return x.detach().to(dt.value_or(x.scalar_type())).clone().requires_grad_(true);
  };
  auto q = leaf(in.q, dtype), k = leaf(in.k, dtype), v = leaf(in.v, dtype);
  auto g = leaf(in.g, gate_dtype);
  auto out = fn(q, k, v, g);
  out.backward(dout.to(out.scalar_type()));
  return {out.detach(), q.grad(), k.grad(), v.grad(), g.grad()};
}

inline double max_abs(const at::Tensor& x) {
  return x.numel() == 0 ? 0.0 : x.detach().to(at::kDouble).abs().max().item<double>();
}

// Largest |a - b|; NaN if either holds a NaN (so every comparison below fails on NaN).
inline double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  REQUIRE(a.sizes() == b.sizes());
  if (a.numel() == 0) return 0.0;
  return (a.detach().cpu().to(at::kDouble) - b.detach().cpu().to(at::kDouble))
      .abs()
      .max()
      .item<double>();
}

// |got - ref| <= tol * max(1, max|ref|).
inline void check_close(const at::Tensor& got, const at::Tensor& ref, double tol,
                        const std::string& what) {
  REQUIRE(got.defined());
  const double err = max_abs_diff(got, ref);
  const double bound = tol * std::max(1.0, max_abs(ref));
  INFO(what << ": max|got - ref| = " << err << ", bound " << bound << " (max|ref| = "
            << max_abs(ref) << ")");
  if (verbose()) std::cout << "[close] " << what << ": err " << err << " bound " << bound << "\n";
  CHECK(err <= bound);
}

// FlashAttention's rule: the error of `got` against the fp64 reference is at most twice the
// error of the naive formula evaluated in the kernel's precision, plus a small floor (relative to
// max(1, max|ref|)).
inline void check_2x_naive(const at::Tensor& got, const at::Tensor& ref64,
                           const at::Tensor& naive, double floor, const std::string& what) {
  REQUIRE(got.defined());
  const double err = max_abs_diff(got, ref64);
  const double naive_err = max_abs_diff(naive, ref64);
  const double bound = 2.0 * naive_err + floor * std::max(1.0, max_abs(ref64));
  INFO(what << ": max|got - ref64| = " << err << ", naive error " << naive_err << ", bound "
            << bound);
  if (verbose()) {
    std::cout << "[2x] " << what << ": err " << err << " naive " << naive_err << " bound " << bound
              << " max|ref| " << max_abs(ref64) << "\n";
  }
  CHECK(err <= bound);
}

// fox::forgetting_attention with fixed options, as an AttentionFn.
inline AttentionFn fox_fn(fox::AttentionOptions options = {}) {
  return [options](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& g) { return fox::forgetting_attention(q, k, v, g, options); };
}

// The reference as an AttentionFn, computed in float64 whatever the inputs' dtypes.
inline AttentionFn reference64_fn(std::optional<at::Tensor> seq_start = {},
                                  std::optional<double> sm_scale = {}) {
  return [seq_start, sm_scale](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& g) {
    return reference(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), g.to(at::kDouble),
                     seq_start, sm_scale)
        .out;
  };
}

// The reference as an AttentionFn, computed in the dtypes of the inputs (naive low precision).
inline AttentionFn reference_fn(std::optional<at::Tensor> seq_start = {},
                                std::optional<double> sm_scale = {}) {
  return [seq_start, sm_scale](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& g) {
    return reference(q, k, v, g, seq_start, sm_scale).out;
  };
}

}  // namespace fox_test
