// Shared helpers of the fox::nn tests: small configs and a naive fp64 reference of the layer.
#pragma once

#include <cmath>
#include <string>

#include <torch/torch.h>

#include <fox/nn.h>

namespace fox_test {

inline fox::nn::ForgettingTransformerConfig tiny_config(const std::string& arch) {
  fox::nn::ForgettingTransformerConfig c;
  c.vocab_size(61).hidden_size(32).num_hidden_layers(2).num_heads(4).intermediate_size(48);
  c = c.preset(arch);
  c.intermediate_size(48);
  return c;
}

inline bool close(const torch::Tensor& a, const torch::Tensor& b, double tol = 1e-10) {
  if (a.sizes() != b.sizes()) return false;
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>() <= tol;
}

inline torch::Tensor ref_rms(const torch::Tensor& x, const torch::Tensor& w, int64_t groups,
                             double eps) {
  auto s = x.sizes().vec();
  auto g = x.reshape({x.size(0), x.size(1), groups, -1});
  g = g / torch::sqrt(g.pow(2).mean(-1, true) + eps);
  return g.reshape(s) * w;
}

inline torch::Tensor ref_shift(const torch::Tensor& x, fox::nn::ShiftLinearImpl& m) {
  auto out = torch::matmul(x, m.linear->weight.t());  // (B, T, O)
  const int64_t B = x.size(0), T = x.size(1), H = m.options.num_heads();
  auto alpha = torch::sigmoid(torch::matmul(x, m.shift_proj->weight.t()));  // (B, T, H)
  auto res = torch::empty_like(out);
  for (int64_t t = 0; t < T; ++t) {
    auto cur = out.select(1, t).view({B, H, -1});
    auto prev = t == 0 ? torch::zeros_like(cur) : out.select(1, t - 1).view({B, H, -1});
    auto a = alpha.select(1, t).unsqueeze(-1);
    res.select(1, t).copy_((a * prev + (1 - a) * cur).view({B, -1}));
  }
  return res;
}

inline torch::Tensor ref_rope(const torch::Tensor& x, double base) {  // (B, T, H, D)
  const int64_t T = x.size(1), D = x.size(3);
  auto out = torch::empty_like(x);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < D / 2; ++i) {
      double ang = t * std::pow(base, -2.0 * i / D);
      auto a = x.select(1, t).select(-1, i), b = x.select(1, t).select(-1, i + D / 2);
      out.select(1, t).select(-1, i).copy_(a * std::cos(ang) - b * std::sin(ang));
      out.select(1, t).select(-1, i + D / 2).copy_(b * std::cos(ang) + a * std::sin(ang));
    }
  }
  return out;
}

/// The layer's math written out naively (materialized gate matrix and softmax), fp64.
inline torch::Tensor ref_layer(fox::nn::ForgettingAttentionLayerImpl& m, const torch::Tensor& x) {
  const auto& o = m.options;
  const int64_t B = x.size(0), T = x.size(1), H = o.num_heads(), Hkv = m.num_kv_heads();
  const int64_t D = m.head_dim();
  auto q = torch::matmul(x, m.q_proj->weight.t());
  auto k = m.k_shift_proj ? ref_shift(x, *m.k_shift_proj) : torch::matmul(x, m.k_proj->weight.t());
  auto v = m.v_shift_proj ? ref_shift(x, *m.v_shift_proj) : torch::matmul(x, m.v_proj->weight.t());
  if (o.qk_norm()) {
    q = ref_rms(q, m.q_norm->weight, H, o.qk_norm_eps());
    k = ref_rms(k, m.k_norm->weight, Hkv, o.qk_norm_eps());
  }
  q = q.view({B, T, H, D});
  k = k.view({B, T, Hkv, D});
  v = v.view({B, T, Hkv, D});
  if (o.use_rope()) {
    q = ref_rope(q, o.rope_base());
    k = ref_rope(k, o.rope_base());
  }
  torch::Tensor lf;
  if (o.fgate_type() == "full") {
    lf = torch::log_sigmoid(torch::matmul(x, m.fgate_proj->weight.t()) + m.fgate_proj->bias);
  } else if (o.fgate_type() == "none") {
    lf = torch::zeros({B, T, H}, x.options());
  } else {
    lf = torch::log_sigmoid(m.fgate_bias.to(x.scalar_type())).expand({B, T, H});
  }
  auto c = lf.cumsum(1).permute({0, 2, 1});                       // (B, H, T)
  auto d = c.unsqueeze(-1) - c.unsqueeze(-2);                       // (B, H, T, T) c_i - c_j
  auto rep = H / Hkv;
  auto kk = k.repeat_interleave(rep, 2).permute({0, 2, 1, 3});      // (B, H, T, D)
  auto vv = v.repeat_interleave(rep, 2).permute({0, 2, 1, 3});
  auto s = torch::matmul(q.permute({0, 2, 1, 3}), kk.transpose(-1, -2)) / std::sqrt(double(D)) + d;
  auto causal = torch::ones({T, T}, torch::kBool).tril();
  s = s.masked_fill(~causal, -INFINITY);
  auto out = torch::matmul(s.softmax(-1), vv).permute({0, 2, 1, 3}).reshape({B, T, H * D});
  if (o.use_output_norm()) out = ref_rms(out, m.output_norm->weight, H, o.norm_eps());
  if (o.use_output_gate()) out = out * torch::sigmoid(torch::matmul(x, m.ogate_proj->weight.t()));
  return torch::matmul(out, m.o_proj->weight.t());
}

/// Randomizes every parameter and buffer (so norms and gates are not at their trivial init).
inline void randomize(torch::nn::Module& m, double scale = 0.3) {
  torch::NoGradGuard g;
  for (auto& p : m.parameters()) p.add_(torch::randn_like(p) * scale);
}

}  // namespace fox_test
