#include <fox/nn/functional.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <string>

#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/functional/loss.h>

#ifdef FOX_WITH_CUDA
#include "cuda/fused_kernels.h"
#include "cuda/small_batch_linear.h"
#endif

namespace fox::nn::functional {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

torch::ScalarType compute_dtype(const torch::Tensor& x) {
  return x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
}

// Whether the comparison switch `name` (a FOX_* environment variable, read at each call so that
// one process can time both sides) is set to 0.
bool switched_off(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::string(v) == "0";
}

// The fused kernels serve CUDA tensors in float32/float16/bfloat16.
bool fused(const torch::Tensor& x) {
#ifdef FOX_WITH_CUDA
  const auto t = x.scalar_type();
  return x.is_cuda() && (t == torch::kFloat32 || t == torch::kFloat16 || t == torch::kBFloat16);
#else
  return false;
#endif
}

// (rows, C) view of x with one row stride and a contiguous last dimension (a copy only if x's
// leading dimensions do not collapse to one stride).
torch::Tensor rows_view(const torch::Tensor& x) {
  const int64_t C = x.size(-1);
  auto r = x.reshape({-1, C});
  if (C > 1 && r.stride(1) != 1) r = r.contiguous();
  return r;
}

// (B, T, C) with a contiguous last dimension.
torch::Tensor last_contiguous(const torch::Tensor& x) {
  return x.size(-1) > 1 && x.stride(-1) != 1 ? x.contiguous() : x;
}

// An incoming gradient as a contiguous, 16-byte aligned tensor (what the row kernels read).
torch::Tensor aligned(const torch::Tensor& g) {
  auto c = g.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

#ifdef FOX_WITH_CUDA
// Whether the fused row kernels take rows of `channels` in groups of `group` from these tensors.
bool rows_fit(int64_t channels, int64_t group, std::initializer_list<torch::Tensor> tensors) {
  return cuda::row_vector_width(channels, group, tensors) > 0;
}
#endif

// No autograd graph would be recorded through these tensors: the inference-only fused paths.
bool without_autograd(std::initializer_list<torch::Tensor> tensors) {
  if (!torch::GradMode::is_enabled()) return true;
  for (const auto& t : tensors) {
    if (t.defined() && t.requires_grad()) return false;
  }
  return true;
}

// a + b in their promoted dtype. A float32 residual stream plus a half-precision branch as a cast
// and a same-dtype add: ATen's mixed-dtype add is not vectorized (~4x the time on a training
// step's rows); the values are the same (the cast is exact, the sum is float32 either way).
torch::Tensor add_promoted(const torch::Tensor& a, const torch::Tensor& b) {
  const auto dtype = at::result_type(a, b);
  return a.to(dtype) + b.to(dtype);
}

bool is_silu(const std::string& act) {
  if (act == "swish" || act == "silu") return true;
  TORCH_CHECK(act == "sigmoid", "gated: act must be swish, silu or sigmoid, got '", act, "'");
  return false;
}

#ifdef FOX_WITH_CUDA

struct RMSNormFunction : public torch::autograd::Function<RMSNormFunction> {
  // Optional tensors are std::optional: autograd::Function takes no undefined tensors.
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const std::optional<torch::Tensor>& weight_in, int64_t group,
                               double eps, torch::ScalarType out_dtype) {
    const auto weight = weight_in.value_or(torch::Tensor());
    auto x2 = rows_view(x);
    // The forward reads a float32 weight or one of x's dtype as it is (no copy per call in
    // decoding); the backward kernels take float32.
    auto w = weight.defined() ? weight.contiguous() : torch::Tensor();
    if (w.defined() && w.scalar_type() != torch::kFloat32 && w.scalar_type() != x.scalar_type())
      w = w.to(torch::kFloat32);
    auto y = torch::empty(x.sizes(), x.options().dtype(out_dtype));
    auto rstd = torch::empty({x2.size(0), x2.size(1) / group}, x.options().dtype(torch::kFloat32));
    cuda::rms_norm_forward(x2, w, group, eps, y.view({-1, x2.size(1)}), rstd);
    ctx->save_for_backward({x2, w, rstd});
    ctx->saved_data["group"] = group;
    ctx->saved_data["weight_dtype"] =
        weight.defined() ? int64_t(weight.scalar_type()) : int64_t(torch::kFloat32);
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &x2 = saved[0], &rstd = saved[2];
    const auto w = saved[1].defined() ? saved[1].to(torch::kFloat32) : saved[1];
    const int64_t group = ctx->saved_data["group"].toInt();
    auto dy = aligned(rows_view(grads[0]));
    auto dx = torch::empty(x2.sizes(), x2.options());
    torch::Tensor dw;
    if (w.defined() && ctx->needs_input_grad(1)) dw = torch::empty({x2.size(1)}, rstd.options());
    cuda::rms_norm_backward(dy, x2, w, rstd, group, dx, dw);
    if (dw.defined()) dw = dw.to(torch::ScalarType(ctx->saved_data["weight_dtype"].toInt()));
    return {dx.view(ctx->saved_data["x_sizes"].toIntVector()), dw, torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

// {x + delta, rms_norm(x + delta)} with autograd: a residual stream (x, float32 in a training step
// under autocast) plus a branch (delta, x's dtype or half precision), and the next norm. The
// backward adds the stream's own gradient inside the norm's backward kernel and writes the
// branch's gradient in its dtype in the same pass: bitwise the add, the cast and the norm as
// separate autograd steps, in one kernel each way instead of three.
struct AddRMSNormFunction : public torch::autograd::Function<AddRMSNormFunction> {
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& delta,
                               const std::optional<torch::Tensor>& weight_in, double eps,
                               torch::ScalarType out_dtype) {
    const auto weight = weight_in.value_or(torch::Tensor());
    auto x2 = rows_view(x), d2 = rows_view(delta);
    auto w = weight.defined() ? weight.contiguous() : torch::Tensor();
    if (w.defined() && w.scalar_type() != torch::kFloat32 && w.scalar_type() != x.scalar_type())
      w = w.to(torch::kFloat32);
    auto sum = torch::empty(x.sizes(), x.options());
    auto y = torch::empty(x.sizes(), x.options().dtype(out_dtype));
    auto rstd = torch::empty({x2.size(0), 1}, x.options().dtype(torch::kFloat32));
    cuda::rms_norm_forward(x2, w, x2.size(1), eps, y.view({-1, x2.size(1)}), rstd, d2,
                           sum.view({-1, x2.size(1)}));
    ctx->save_for_backward({sum, w, rstd});
    ctx->saved_data["weight_dtype"] =
        weight.defined() ? int64_t(weight.scalar_type()) : int64_t(torch::kFloat32);
    ctx->saved_data["delta_dtype"] = int64_t(delta.scalar_type());
    return {sum, y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto sum2 = rows_view(saved[0]);
    const auto& rstd = saved[2];
    const auto w = saved[1].defined() ? saved[1].to(torch::kFloat32) : saved[1];
    const auto sizes = saved[0].sizes();
    const auto delta_dtype = torch::ScalarType(ctx->saved_data["delta_dtype"].toInt());
    torch::Tensor dsum = grads[0].defined() ? aligned(rows_view(grads[0])) : torch::Tensor();
    torch::Tensor dy = grads[1].defined() ? aligned(rows_view(grads[1]))
                                          : torch::zeros(sum2.sizes(), sum2.options());
    auto dx = torch::empty(sum2.sizes(), sum2.options());
    torch::Tensor ddelta;
    if (ctx->needs_input_grad(1) && delta_dtype != sum2.scalar_type())
      ddelta = torch::empty(sum2.sizes(), sum2.options().dtype(delta_dtype));
    torch::Tensor dw;
    if (w.defined() && ctx->needs_input_grad(2)) dw = torch::empty({sum2.size(1)}, rstd.options());
    cuda::rms_norm_backward(dy, sum2, w, rstd, sum2.size(1), dx, dw, dsum, ddelta);
    if (dw.defined()) dw = dw.to(torch::ScalarType(ctx->saved_data["weight_dtype"].toInt()));
    dx = dx.view(sizes);
    if (ctx->needs_input_grad(1)) ddelta = ddelta.defined() ? ddelta.view(sizes) : dx;
    return {ctx->needs_input_grad(0) ? dx : torch::Tensor(), ddelta, dw, torch::Tensor(),
            torch::Tensor()};
  }
};

// The fused functions below see inputs of one dtype (the callers check it).
struct ShiftMixFunction : public torch::autograd::Function<ShiftMixFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& cur_in,
                               const torch::Tensor& logits_in,
                               const std::optional<torch::Tensor>& first_opt) {
    auto cur = last_contiguous(cur_in);
    auto logits = last_contiguous(logits_in);
    auto first = first_opt ? first_opt->contiguous() : torch::Tensor();  // read as (B, C)
    auto out = torch::empty(cur.sizes(), cur.options());
    cuda::shift_mix_forward(cur, logits, first, out);
    ctx->save_for_backward({cur, logits, first});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &cur = saved[0], &logits = saved[1], &first = saved[2];
    auto dout = aligned(grads[0]);
    auto dcur = torch::empty(cur.sizes(), cur.options());
    auto dlogits = torch::empty(logits.sizes(), logits.options());
    torch::Tensor dfirst;
    if (first.defined() && ctx->needs_input_grad(2)) dfirst = torch::empty(first.sizes(), first.options());
    cuda::shift_mix_backward(dout, cur, logits, first, dcur, dlogits, dfirst);
    return {dcur, dlogits, dfirst};
  }
};

struct EmbeddingFunction : public torch::autograd::Function<EmbeddingFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& weight,
                               const torch::Tensor& ids, int64_t padding_idx) {
    ctx->save_for_backward({ids});
    ctx->saved_data["rows"] = weight.size(0);
    ctx->saved_data["padding_idx"] = padding_idx;
    return at::embedding(weight, ids, padding_idx);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto ids = ctx->get_saved_variables()[0].reshape({-1});
    const int64_t rows = ctx->saved_data["rows"].toInt();
    const int64_t padding_idx = ctx->saved_data["padding_idx"].toInt();
    const auto dy = grads[0].reshape({ids.numel(), -1});
    auto dweight = torch::zeros({rows, dy.size(1)}, dy.options());
    c10::List<std::optional<torch::Tensor>> index;
    index.push_back(ids);
    dweight.index_put_(index, dy, /*accumulate=*/true);
    if (padding_idx >= 0) dweight[padding_idx].zero_();
    return {dweight, torch::Tensor(), torch::Tensor()};
  }
};

struct ForgetGateFunction : public torch::autograd::Function<ForgetGateFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits_in,
                               const std::optional<torch::Tensor>& bias_opt) {
    auto logits = last_contiguous(logits_in);
    auto bias = bias_opt ? bias_opt->contiguous() : torch::Tensor();
    auto out = torch::empty(logits.sizes(), logits.options().dtype(torch::kFloat32));
    cuda::forget_gate_forward(logits, bias, out);
    // The logits are a view of the input projection, which its backward keeps anyway.
    ctx->save_for_backward({logits, bias});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {torch::Tensor(), torch::Tensor()};
    auto saved = ctx->get_saved_variables();
    const auto &logits = saved[0], &bias = saved[1];
    auto dlogits = torch::empty(logits.sizes(), logits.options());
    cuda::forget_gate_backward(grads[0].to(torch::kFloat32).contiguous(), logits, bias, dlogits);
    torch::Tensor dbias;
    if (bias.defined() && ctx->needs_input_grad(1)) {
      // The composition's: the broadcast add's sum in the logits' dtype, then the bias's cast.
      dbias = dlogits.sum(at::IntArrayRef{0, 1}).to(bias.scalar_type());
    }
    return {dlogits, dbias};
  }
};

// The parts of an attention layer's input projection y (B, T, W) and its q, k and v as in
// attention_inputs, with autograd: the backward's kernels write every part's gradient into its
// columns of one (B, T, W) tensor (strided rows), so the projection's backward takes it as it is,
// with no concatenation of the parts' gradients (split_with_sizes' backward). The parts passed
// through are views of y; their gradients are copied in. Bitwise the composition: the same kernels
// on the same views, except that a k part with both a KV-shift and a norm takes them in one
// kernel each way (shift_norm_*), which rounds every value as the two kernels do; its norm
// weight's gradient is summed in the same grouping where a thread takes one row (small inputs),
// and where threads walk runs of rows in another fixed order (equal to float32 rounding).
struct AttentionInputsFunction : public torch::autograd::Function<AttentionInputsFunction> {
  // The layout as saved data: the fields in order, then the passed parts' (column, width) pairs.
  static std::vector<int64_t> pack(const AttentionInputLayout& l) {
    std::vector<int64_t> v = {l.q,       l.k,       l.v,           l.q_width, l.kv_width,
                              l.k_shift, l.v_shift, l.shift_heads, l.q_group, l.k_group};
    for (const auto& [first, width] : l.passed) v.insert(v.end(), {first, width});
    return v;
  }
  static AttentionInputLayout unpack(const std::vector<int64_t>& v, double eps) {
    AttentionInputLayout l;
    std::tie(l.q, l.k, l.v, l.q_width, l.kv_width) = std::tuple(v[0], v[1], v[2], v[3], v[4]);
    std::tie(l.k_shift, l.v_shift, l.shift_heads, l.q_group, l.k_group) =
        std::tuple(v[5], v[6], v[7], v[8], v[9]);
    for (size_t i = 10; i + 1 < v.size(); i += 2) l.passed.emplace_back(v[i], v[i + 1]);
    l.norm_eps = eps;
    return l;
  }
  // A norm weight as the norm kernels read it: float32 or y's dtype as it is.
  static torch::Tensor kernel_weight(const std::optional<torch::Tensor>& w,
                                     const torch::Tensor& y) {
    if (!w || !w->defined()) return {};
    auto c = w->contiguous();
    return c.scalar_type() == torch::kFloat32 || c.scalar_type() == y.scalar_type()
               ? c
               : c.to(torch::kFloat32);
  }

  static variable_list forward(AutogradContext* ctx, const torch::Tensor& y,
                               const std::optional<torch::Tensor>& q_weight,
                               const std::optional<torch::Tensor>& k_weight,
                               const AttentionInputLayout& l) {
    const int64_t B = y.size(0), T = y.size(1), rows = B * T, W = y.size(2);
    const auto y2 = y.view({rows, W});
    const auto qw = kernel_weight(q_weight, y), kw = kernel_weight(k_weight, y);
    const auto f32 = y.options().dtype(torch::kFloat32);
    torch::Tensor q = y.narrow(2, l.q, l.q_width), rstd_q, rstd_k, k_shifted;
    if (l.q_group) {
      auto normed = torch::empty({B, T, l.q_width}, y.options());
      rstd_q = torch::empty({rows, l.q_width / l.q_group}, f32);
      cuda::rms_norm_forward(y2.narrow(1, l.q, l.q_width), qw, l.q_group, l.norm_eps,
                             normed.view({rows, l.q_width}), rstd_q);
      q = normed;
    }
    auto shifted = [&](int64_t first, int64_t shift) {
      auto part = y.narrow(2, first, l.kv_width);
      if (shift < 0) return part;
      auto out = torch::empty({B, T, l.kv_width}, y.options());
      cuda::shift_mix_forward(part, y.narrow(2, shift, l.shift_heads), {}, out);
      return out;
    };
    // The k part's shift and norm in one pass each way (the shifted rows are not kept), unless
    // FOX_FUSED_SHIFT_NORM=0 (two kernels, the shifted rows saved: for comparisons).
    const bool one_pass =
        l.k_shift >= 0 && l.k_group && !switched_off("FOX_FUSED_SHIFT_NORM") &&
        cuda::shift_norm_fits(rows, l.kv_width, l.k_group, l.kv_width / l.shift_heads,
                              {y2.narrow(1, l.k, l.kv_width)});
    auto k = one_pass ? torch::Tensor() : shifted(l.k, l.k_shift);
    if (l.k_group) {
      auto normed = torch::empty({B, T, l.kv_width}, y.options());
      rstd_k = torch::empty({rows, l.kv_width / l.k_group}, f32);
      if (one_pass) {
        cuda::shift_norm_forward(y2.narrow(1, l.k, l.kv_width),
                                 y2.narrow(1, l.k_shift, l.shift_heads), T, kw, l.k_group,
                                 l.norm_eps, normed.view({rows, l.kv_width}), rstd_k);
      } else {
        if (l.k_shift >= 0) k_shifted = k;
        cuda::rms_norm_forward(rows_view(k), kw, l.k_group, l.norm_eps,
                               normed.view({rows, l.kv_width}), rstd_k);
      }
      k = normed;
    }
    variable_list out = {q, k, shifted(l.v, l.v_shift)};
    for (const auto& [first, width] : l.passed) out.push_back(y.narrow(2, first, width));
    // y only for the kernels' backward (untransformed parts' gradients are copies): a layer
    // without norms and shifts frees it with the last view of it the backward reads.
    const bool reads_y = l.q_group || l.k_group || l.k_shift >= 0 || l.v_shift >= 0;
    ctx->save_for_backward({reads_y ? y : torch::Tensor(), qw, kw, rstd_q, rstd_k, k_shifted});
    ctx->saved_data["y_sizes"] = y.sizes().vec();
    ctx->saved_data["y_dtype"] = int64_t(y.scalar_type());
    ctx->saved_data["layout"] = pack(l);
    ctx->saved_data["eps"] = l.norm_eps;
    auto dtype_of = [](const std::optional<torch::Tensor>& w) {
      return int64_t(w ? w->scalar_type() : torch::kFloat32);
    };
    ctx->saved_data["q_weight_dtype"] = dtype_of(q_weight);
    ctx->saved_data["k_weight_dtype"] = dtype_of(k_weight);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &y = saved[0], &qw = saved[1], &kw = saved[2], &rstd_q = saved[3],
               &rstd_k = saved[4], &k_shifted = saved[5];
    const auto l =
        unpack(ctx->saved_data["layout"].toIntVector(), ctx->saved_data["eps"].toDouble());
    const auto sizes = ctx->saved_data["y_sizes"].toIntVector();
    const int64_t B = sizes[0], T = sizes[1], rows = B * T, W = sizes[2];
    const auto y2 = y.defined() ? y.view({rows, W}) : y;
    const auto dtype = torch::ScalarType(ctx->saved_data["y_dtype"].toInt());
    auto dy = torch::empty(sizes, grads[0].options().dtype(dtype));
    const auto dy2 = dy.view({rows, W});
    std::vector<bool> covered(W, false);
    auto columns = [&](int64_t first, int64_t width) {
      std::fill(covered.begin() + first, covered.begin() + first + width, true);
      return dy2.narrow(1, first, width);
    };
    // An incoming gradient copied into its part's columns.
    auto put = [&](int64_t first, int64_t width, const torch::Tensor& grad) {
      auto into = columns(first, width);
      auto g = rows_view(grad.reshape({rows, width}));
      if (rows_fit(width, width, {g, into})) cuda::copy_rows(g, into);
      else into.copy_(g);
    };
    // The norm kernels' backward takes a float32 weight and makes a float32 weight gradient.
    auto float32 = [](const torch::Tensor& w) { return w.defined() ? w.to(torch::kFloat32) : w; };
    auto norm_weight_grad = [&](const torch::Tensor& w, int index) {
      return w.defined() && ctx->needs_input_grad(index)
                 ? torch::empty({w.size(0)}, y.options().dtype(torch::kFloat32))
                 : torch::Tensor();
    };
    // q: the norm's backward into q's columns
    auto dq_w = norm_weight_grad(qw, 1);
    if (l.q_group) {
      cuda::rms_norm_backward(aligned(rows_view(grads[0])), y2.narrow(1, l.q, l.q_width),
                              float32(qw), rstd_q, l.q_group,
                              columns(l.q, l.q_width), dq_w);
    } else {
      put(l.q, l.q_width, grads[0]);
    }
    // k and v: the norm's backward, then the KV-shift's into the part's and its logits' columns
    auto shift_back = [&](const torch::Tensor& d, int64_t first, int64_t shift) {
      if (shift < 0) return put(first, l.kv_width, d);
      columns(first, l.kv_width);
      columns(shift, l.shift_heads);
      cuda::shift_mix_backward(d.view({B, T, l.kv_width}), y.narrow(2, first, l.kv_width),
                               y.narrow(2, shift, l.shift_heads), {},
                               dy.narrow(2, first, l.kv_width), dy.narrow(2, shift, l.shift_heads),
                               {});
    };
    const auto dk = l.k_group || l.k_shift >= 0 ? aligned(rows_view(grads[1])) : grads[1];
    auto dk_w = norm_weight_grad(kw, 2);
    if (l.k_group && l.k_shift >= 0 && !k_shifted.defined()) {  // the forward's one pass
      cuda::shift_norm_backward(dk, y2.narrow(1, l.k, l.kv_width),
                                y2.narrow(1, l.k_shift, l.shift_heads), T, float32(kw), rstd_k,
                                l.k_group, columns(l.k, l.kv_width),
                                columns(l.k_shift, l.shift_heads), dk_w);
    } else if (l.k_group) {
      auto into = l.k_shift < 0 ? columns(l.k, l.kv_width) : torch::empty_like(dk);
      const auto k_in = l.k_shift < 0 ? y2.narrow(1, l.k, l.kv_width) : rows_view(k_shifted);
      cuda::rms_norm_backward(dk, k_in, float32(kw), rstd_k, l.k_group, into, dk_w);
      if (l.k_shift >= 0) shift_back(into, l.k, l.k_shift);
    } else {
      shift_back(l.k_shift < 0 ? grads[1] : dk, l.k, l.k_shift);
    }
    shift_back(l.v_shift < 0 ? grads[2] : aligned(rows_view(grads[2])), l.v, l.v_shift);
    for (size_t i = 0; i < l.passed.size(); ++i)
      put(l.passed[i].first, l.passed[i].second, grads[3 + i]);
    // Columns of no part (the projection's padding) get zeros.
    for (int64_t c = 0; c < W;) {
      if (covered[c]) { ++c; continue; }
      int64_t end = c;
      while (end < W && !covered[end]) ++end;
      dy2.narrow(1, c, end - c).zero_();
      c = end;
    }
    auto weight_grad = [&](torch::Tensor dw, const char* dtype_key) {
      return dw.defined() ? dw.to(torch::ScalarType(ctx->saved_data[dtype_key].toInt())) : dw;
    };
    return {dy, weight_grad(dq_w, "q_weight_dtype"), weight_grad(dk_w, "k_weight_dtype"),
            torch::Tensor()};
  }
};

struct GatedFunction : public torch::autograd::Function<GatedFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& gate,
                               const torch::Tensor& value, bool silu) {
    auto g = rows_view(gate), u = rows_view(value);
    auto y = torch::empty(value.sizes(), value.options());
    cuda::gated_forward(g, u, silu, y.view({-1, g.size(1)}));
    ctx->save_for_backward({g, u});
    ctx->saved_data["silu"] = silu;
    ctx->saved_data["sizes"] = value.sizes().vec();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &g = saved[0], &u = saved[1];
    auto dy = aligned(grads[0]);
    auto dg = torch::empty(g.sizes(), g.options()), du = torch::empty(u.sizes(), u.options());
    cuda::gated_backward(dy, g, u, ctx->saved_data["silu"].toBool(), dg, du);
    const auto sizes = ctx->saved_data["sizes"].toIntVector();
    return {dg.view(sizes), du.view(sizes), torch::Tensor()};
  }
};

struct CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits_in,
                               const torch::Tensor& labels_in, int64_t ignore_index) {
    auto logits = rows_view(logits_in);
    auto labels = labels_in.reshape({-1}).to(logits.device(), torch::kLong).contiguous();
    auto f32 = logits.options().dtype(torch::kFloat32);
    auto loss = torch::empty({logits.size(0)}, f32), lse = torch::empty({logits.size(0)}, f32);
    cuda::cross_entropy_forward(logits, labels, ignore_index, loss, lse);
    ctx->save_for_backward({logits, labels, lse});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["sizes"] = logits_in.sizes().vec();
    return loss.view(labels_in.sizes());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &logits = saved[0], &labels = saved[1], &lse = saved[2];
    auto dloss = grads[0].to(torch::kFloat32).reshape({-1}).contiguous();
    auto dlogits = torch::empty(logits.sizes(), logits.options());
    cuda::cross_entropy_backward(dloss, logits, labels, lse, ctx->saved_data["ignore_index"].toInt(),
                                 dlogits);
    return {dlogits.view(ctx->saved_data["sizes"].toIntVector()), torch::Tensor(),
            torch::Tensor()};
  }
};

#endif  // FOX_WITH_CUDA

// What autocast does to F.linear's tensor arguments: the autocast dtype's (cached) copy.
torch::Tensor autocast_arg(const torch::Tensor& t) {
  if (!t.defined()) return t;
  const auto device = t.device().type();
  if (!at::autocast::is_autocast_enabled(device)) return t;
  return at::autocast::cached_cast(at::autocast::get_autocast_dtype(device), t, device);
}

// F.linear on arguments already cast as autocast would: the functions below recompute in their
// backward, where autocast may differ from the forward's.
torch::Tensor plain_linear(const torch::Tensor& x, const torch::Tensor& weight,
                           const torch::Tensor& bias = {}) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return torch::nn::functional::linear(x, weight, bias);
}

// Under autocast on CUDA a float32 weight that takes a gradient is multiplied in the autocast
// dtype; autocast's composition then makes its gradient in that dtype and casts it up (a rounding,
// and a pass over the weight's bytes). The functions below instead take such a weight as it is,
// cast it in their forward, and make its gradient in float32 with the GEMM itself. Returns the
// dtype to multiply in, -1 where autocast's own cast stands (other devices and dtypes, no
// gradient).
int64_t float32_gradient_dtype(const torch::Tensor& weight) {
  if (!weight.defined() || !weight.is_cuda() || weight.scalar_type() != torch::kFloat32 ||
      !weight.requires_grad() || !torch::GradMode::is_enabled() ||
      !at::autocast::is_autocast_enabled(torch::kCUDA))
    return -1;
  const auto dtype = at::autocast::get_autocast_dtype(torch::kCUDA);
  return dtype == torch::kFloat32 ? -1 : int64_t(dtype);
}

// A weight or bias as those functions take it: as it is where they cast it (compute >= 0),
// autocast's cast otherwise; and inside their forward, its copy in the compute dtype.
torch::Tensor weight_arg(const torch::Tensor& t, int64_t compute) {
  return compute >= 0 ? t : autocast_arg(t);
}
torch::Tensor compute_copy(const torch::Tensor& t, int64_t compute) {
  return compute >= 0 && t.defined() ? t.to(torch::ScalarType(compute)) : t;
}

// d weight = dy^T x (dy, x: rows first): in float32 from the GEMM for a weight cast in the forward.
torch::Tensor weight_gradient(const torch::Tensor& dy, const torch::Tensor& x, bool float32) {
  return float32 ? at::mm(dy.t(), x, torch::kFloat32) : dy.t().mm(x);
}

// F.linear, a 3-D input's rows folded into one addmm when there is a bias: its GEMM adds the bias
// in its epilogue, where F.linear on a 3-D input runs a matmul and a broadcast add_ of the bias,
// not vectorized (a step's input projection spent 0.23 ms a layer on it at 16k rows of 3136).
torch::Tensor folded_linear(const torch::Tensor& x, const torch::Tensor& weight,
                            const torch::Tensor& bias) {
  if (!bias.defined() || x.dim() <= 2 || weight.dim() != 2)
    return torch::nn::functional::linear(x, weight, bias);
  auto sizes = x.sizes().vec();
  sizes.back() = weight.size(0);
  return torch::addmm(bias, x.reshape({-1, x.size(-1)}), weight.t()).view(sizes);
}

#ifdef FOX_WITH_CUDA
// F.linear for a float32 weight under autocast (float32_gradient_dtype): the weight's gradient in
// float32 from the GEMM; x's gradient and the bias's as autocast's composition makes them.
struct Float32GradientLinearFunction
    : public torch::autograd::Function<Float32GradientLinearFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight,
                               const std::optional<torch::Tensor>& bias, int64_t compute) {
    const auto w = compute_copy(weight, compute);
    const auto b = compute_copy(bias.value_or(torch::Tensor()), compute);
    ctx->save_for_backward({x, w});
    ctx->saved_data["bias"] = b.defined();
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    return folded_linear(x, w, b);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w = saved[1];
    const auto dy = grads[0].reshape({-1, grads[0].size(-1)});
    variable_list out(4);
    if (ctx->needs_input_grad(0)) out[0] = dy.mm(w).view(x.sizes());
    if (ctx->needs_input_grad(1)) out[1] = weight_gradient(dy, x.reshape({-1, x.size(-1)}), true);
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) out[2] = dy.sum(0);
    return out;
  }
};
#endif

// linear(gated(gate, value), weight, bias) keeping gate, value and weight, not the product: the
// backward computes the product again and takes the linear's gradients with the products
// autograd's own mm backward uses (bitwise the composition's), then the product's own backward.
struct GatedLinearFunction : public torch::autograd::Function<GatedLinearFunction> {
  // weight and bias arrive as weight_arg gives them (cast here when compute >= 0); the product is
  // cast as autocast casts it.
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& gate,
                               const torch::Tensor& value, const torch::Tensor& weight_in,
                               const std::optional<torch::Tensor>& bias, const std::string& act,
                               int64_t compute) {
    auto h = autocast_arg(functional::gated(gate, value, act));
    const auto weight = compute_copy(weight_in, compute);
    ctx->save_for_backward({gate, value, weight});
    ctx->saved_data["act"] = act;
    ctx->saved_data["dtype"] = int64_t(h.scalar_type());
    ctx->saved_data["bias"] = bias.has_value();
    ctx->saved_data["float32_weight_grad"] = compute >= 0;
    return plain_linear(h, weight, compute_copy(bias.value_or(torch::Tensor()), compute));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto weight = saved[2].detach();
    auto gate = saved[0].detach(), value = saved[1].detach();
    const bool need_gate = ctx->needs_input_grad(0), need_value = ctx->needs_input_grad(1);
#ifdef FOX_WITH_CUDA
    if (auto out = fused_backward(ctx, grads[0], gate, value, weight)) return *out;
#endif
    variable_list inputs;
    if (need_gate) inputs.push_back(gate.requires_grad_(true));
    if (need_value) inputs.push_back(value.requires_grad_(true));
    torch::AutoGradMode grad_mode(!inputs.empty());
    auto h = functional::gated(gate, value, ctx->saved_data["act"].toStringRef())
                 .to(torch::ScalarType(ctx->saved_data["dtype"].toInt()));
    // F.linear folds the leading dimensions into the rows of one mm(h, weight^T); its backward:
    // dh = dy.mm(weight), d weight = dy^T.mm(h), d bias = dy.sum(0).
    const auto dy = grads[0].reshape({-1, grads[0].size(-1)});
    variable_list out(6);
    if (ctx->needs_input_grad(2))
      out[2] = weight_gradient(dy, h.detach().reshape({-1, h.size(-1)}),
                               ctx->saved_data["float32_weight_grad"].toBool());
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(3)) out[3] = dy.sum(0);
    if (!inputs.empty()) {
      auto dh = dy.mm(weight).view(h.sizes());
      auto found = torch::autograd::grad({h}, inputs, {dh});
      size_t k = 0;
      if (need_gate) out[0] = found[k++];
      if (need_value) out[1] = found[k++];
    }
    return out;
  }

#ifdef FOX_WITH_CUDA
  // The same gradients when the gated kernels take gate and value and the product needs no cast:
  // the gated backward kernel writes the product for the weight's gradient as it goes (bitwise
  // gated_forward's), instead of a second kernel reading gate and value again. nullopt otherwise.
  static std::optional<variable_list> fused_backward(AutogradContext* ctx,
                                                     const torch::Tensor& dy_in,
                                                     const torch::Tensor& gate,
                                                     const torch::Tensor& value,
                                                     const torch::Tensor& weight) {
    const auto dtype = torch::ScalarType(ctx->saved_data["dtype"].toInt());
    if (!(ctx->needs_input_grad(0) || ctx->needs_input_grad(1)) || !fused(gate) ||
        gate.scalar_type() != dtype || value.scalar_type() != dtype || gate.numel() == 0 ||
        gate.device() != value.device() ||
        !rows_fit(gate.size(-1), gate.size(-1), {rows_view(gate), rows_view(value)})) {
      return std::nullopt;
    }
    const auto g = rows_view(gate), u = rows_view(value);
    const auto dy = dy_in.reshape({-1, dy_in.size(-1)});
    auto dg = torch::empty(g.sizes(), g.options()), du = torch::empty(u.sizes(), u.options());
    auto dh = aligned(dy.mm(weight));
    const auto h = ctx->needs_input_grad(2) ? dh : torch::Tensor();  // in place of dh
    cuda::gated_backward(dh, g, u, is_silu(ctx->saved_data["act"].toStringRef()), dg, du, h);
    variable_list out(6);
    if (ctx->needs_input_grad(0)) out[0] = dg.view(gate.sizes());
    if (ctx->needs_input_grad(1)) out[1] = du.view(value.sizes());
    if (h.defined())
      out[2] = weight_gradient(dy, h, ctx->saved_data["float32_weight_grad"].toBool());
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(3)) out[3] = dy.sum(0);
    return out;
  }
#endif
};

#ifdef FOX_WITH_CUDA
// GatedLinearFunction over the two halves of one tensor (gate first): the gradient of gate_value
// is written as one tensor by the fused kernel, where the gradients of two chunk views would be
// concatenated by autograd (a copy of the whole projection output per layer). The caller checks
// that the fused kernels take the halves and that the product needs no cast.
struct SplitGatedLinearFunction : public torch::autograd::Function<SplitGatedLinearFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& gate_value,
                               const torch::Tensor& weight_in,
                               const std::optional<torch::Tensor>& bias, const std::string& act,
                               int64_t compute) {
    const int64_t F = gate_value.size(-1) / 2;
    auto h = functional::gated(gate_value.narrow(-1, 0, F), gate_value.narrow(-1, F, F), act);
    const auto weight = compute_copy(weight_in, compute);
    ctx->save_for_backward({gate_value, weight});
    ctx->saved_data["silu"] = is_silu(act);
    ctx->saved_data["bias"] = bias.has_value();
    ctx->saved_data["float32_weight_grad"] = compute >= 0;
    return plain_linear(h, weight, compute_copy(bias.value_or(torch::Tensor()), compute));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto gv = rows_view(saved[0]), weight = saved[1];
    const int64_t F = gv.size(1) / 2;
    const auto gate = gv.narrow(1, 0, F), value = gv.narrow(1, F, F);
    const bool silu = ctx->saved_data["silu"].toBool();
    // As GatedLinearFunction: the product again, then mm's own backward and the product's. With
    // both gradients the product comes from the gated backward kernel (one pass over the halves).
    const auto dy = grads[0].reshape({-1, grads[0].size(-1)});
    variable_list out(5);
    torch::Tensor h;
    if (ctx->needs_input_grad(0)) {
      // The product replaces the product's gradient in place (no more memory than before).
      auto dh = aligned(dy.mm(weight));
      auto dgv = torch::empty(gv.sizes(), gv.options());
      if (ctx->needs_input_grad(1)) h = dh;
      cuda::gated_backward(dh, gate, value, silu, dgv.narrow(1, 0, F), dgv.narrow(1, F, F), h);
      out[0] = dgv.view(saved[0].sizes());
    } else if (ctx->needs_input_grad(1)) {
      h = torch::empty({gv.size(0), F}, gv.options());
      cuda::gated_forward(gate, value, silu, h);
    }
    if (h.defined())
      out[1] = weight_gradient(dy, h, ctx->saved_data["float32_weight_grad"].toBool());
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) out[2] = dy.sum(0);
    return out;
  }
};
#endif  // FOX_WITH_CUDA

// The LM head loss's weight gradient, summed over the row chunks: zeros, in float32 for a
// half-precision weight (on CUDA the chunks' GEMMs accumulate into it: one rounding at the end, as
// the composition's single GEMM).
torch::Tensor weight_grad_accumulator(const torch::Tensor& weight) {
  const bool half = weight.scalar_type() == torch::kFloat16 ||
                    weight.scalar_type() == torch::kBFloat16;
  return torch::zeros(weight.sizes(), weight.options().dtype(half ? torch::kFloat32
                                                                  : weight.scalar_type()));
}

// The LM head's weight as the fused loss multiplies it (in the compute dtype). With a vocabulary
// that is no multiple of 8 (50277, 50257) the logits' rows are not 16-byte aligned and cuBLAS
// falls back to kernels that move 2 bytes at a time (the loss's three GEMMs 6-7x slower on an
// H200), so such a weight gets zero rows up to a multiple of 64: the logits of the pad are 0 and
// never read by the loss kernels, and its rows of d weight are dropped (`FOX_PAD_VOCAB=0`: as is).
torch::Tensor loss_head_weight(const torch::Tensor& weight, int64_t compute) {
  const int64_t V = weight.size(0), padded = (V + 63) / 64 * 64;
  if (V % 8 == 0 || switched_off("FOX_PAD_VOCAB")) return compute_copy(weight, compute);
  const auto dtype = compute >= 0 ? torch::ScalarType(compute) : weight.scalar_type();
  auto out = torch::empty({padded, weight.size(1)}, weight.options().dtype(dtype));
  out.narrow(0, V, padded - V).zero_();
  out.narrow(0, 0, V).copy_(weight);
  return out;
}

// A chunk's d logits (its rows h of hidden, from row `start`) into d hidden's rows and into d
// weight, each where defined. accumulate_in_gemm: CUDA's GEMM adds into a float32 d weight.
void add_chunk_gradients(const torch::Tensor& dlogits, const torch::Tensor& h,
                         const torch::Tensor& weight, int64_t start, const torch::Tensor& dhidden,
                         torch::Tensor& dweight, bool accumulate_in_gemm) {
  if (dhidden.defined()) {
    auto out = dhidden.narrow(0, start, h.size(0));
    torch::mm_out(out, dlogits, weight);
  }
  if (!dweight.defined()) return;
  if (dweight.scalar_type() == weight.scalar_type()) dweight.addmm_(dlogits.t(), h);
  else if (accumulate_in_gemm) at::addmm_out(dweight, dweight, dlogits.t(), h, torch::kFloat32);
  else dweight.add_(dlogits.t().mm(h));  // CPU: mm.dtype is CUDA's
}

// Per-token cross entropy of hidden (N, C) @ weight (V, C)^T against labels (N,), the logits made
// chunk_rows rows at a time in the forward and again in the backward, never kept. On CUDA the
// fused loss kernels run on each chunk: the forward keeps every row's log-sum-exp, and the
// backward turns the chunk's logits into d logits in place. Elsewhere d logits come from
// cross_entropy's own backward (float32 softmax math, ignored labels 0).
struct LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
  static bool direct(const torch::Tensor& hidden) {
#ifdef FOX_WITH_CUDA
    return fused(hidden);
#else
    (void)hidden;
    return false;
#endif
  }

  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden,
                               const torch::Tensor& weight_in, const torch::Tensor& labels,
                               int64_t ignore_index, int64_t chunk_rows, int64_t compute) {
    const int64_t N = hidden.size(0), V = weight_in.size(0);
    const auto weight = direct(hidden) ? loss_head_weight(weight_in, compute)
                                       : compute_copy(weight_in, compute);
    torch::Tensor loss, lse;
    if (direct(hidden)) {
#ifdef FOX_WITH_CUDA
      auto f32 = hidden.options().dtype(torch::kFloat32);
      loss = torch::empty({N}, f32);
      lse = torch::empty({N}, f32);
      for (int64_t start = 0; start < N; start += chunk_rows) {
        const int64_t rows = std::min(chunk_rows, N - start);
        const auto logits = plain_linear(hidden.narrow(0, start, rows), weight);
        cuda::cross_entropy_forward(logits.narrow(1, 0, V), labels.narrow(0, start, rows),
                                    ignore_index, loss.narrow(0, start, rows),
                                    lse.narrow(0, start, rows));
      }
#endif
    } else {
      std::vector<torch::Tensor> losses;
      for (int64_t start = 0; start < N; start += chunk_rows) {
        const int64_t rows = std::min(chunk_rows, N - start);
        losses.push_back(cross_entropy(plain_linear(hidden.narrow(0, start, rows), weight),
                                       labels.narrow(0, start, rows), ignore_index));
      }
      loss = torch::cat(losses);
    }
    // The weight as it came, or its cast copy's first V rows: the backward pads it again.
    ctx->save_for_backward({hidden, compute >= 0 ? weight.narrow(0, 0, V) : weight_in, labels,
                            lse});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["chunk_rows"] = chunk_rows;
    ctx->saved_data["vocab"] = V;
    ctx->saved_data["loss_dtype"] = int64_t(loss.scalar_type());
    ctx->saved_data["weight_dtype"] = int64_t(weight_in.scalar_type());
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // Detached: nothing here joins the outer graph (also under create_graph).
    auto saved = ctx->get_saved_variables();
    const auto hidden = saved[0].detach(), labels = saved[2], lse = saved[3];
    const auto weight = lse.defined() ? loss_head_weight(saved[1].detach(), -1) : saved[1].detach();
    const int64_t chunk_rows = ctx->saved_data["chunk_rows"].toInt();
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    const int64_t V = ctx->saved_data["vocab"].toInt();
    auto dloss = grads[0].to(torch::ScalarType(ctx->saved_data["loss_dtype"].toInt())).contiguous();
    torch::Tensor dhidden, dweight;
    if (ctx->needs_input_grad(0)) dhidden = torch::empty(hidden.sizes(), hidden.options());
    if (ctx->needs_input_grad(1)) dweight = weight_grad_accumulator(weight);
    for (int64_t start = 0; start < hidden.size(0); start += chunk_rows) {
      const int64_t rows = std::min(chunk_rows, hidden.size(0) - start);
      auto h = hidden.narrow(0, start, rows);
      auto logits = plain_linear(h, weight);
      torch::Tensor dlogits;
      if (lse.defined()) {
#ifdef FOX_WITH_CUDA
        const auto valid = logits.narrow(1, 0, V);
        cuda::cross_entropy_backward(dloss.narrow(0, start, rows), valid,
                                     labels.narrow(0, start, rows), lse.narrow(0, start, rows),
                                     ignore_index, valid);  // in place: one read, one write
        dlogits = logits;
#endif
      } else {
        torch::AutoGradMode grad_mode(true);
        logits.requires_grad_(true);
        auto loss = cross_entropy(logits, labels.narrow(0, start, rows), ignore_index);
        dlogits = torch::autograd::grad({loss}, {logits}, {dloss.narrow(0, start, rows)})[0];
      }
      add_chunk_gradients(dlogits, h, weight, start, dhidden, dweight, lse.defined());
    }
    if (dweight.defined())
      dweight = dweight.narrow(0, 0, V).to(
          torch::ScalarType(ctx->saved_data["weight_dtype"].toInt()));
    return {dhidden, dweight, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

#ifdef FOX_WITH_CUDA
// The sum of LinearCrossEntropyFunction's per-token losses, its gradients made in the forward (the
// fused CUDA path only): each chunk's logits become the d logits of the sum in place and go
// straight into d hidden and d weight, so the logits are made once instead of twice, and the
// backward only scales the two gradients by the incoming one (a scalar). A per-token loss cannot
// do this: its rows' gradients are known only in the backward.
struct SummedLinearCrossEntropyFunction
    : public torch::autograd::Function<SummedLinearCrossEntropyFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden,
                               const torch::Tensor& weight_in, const torch::Tensor& labels,
                               int64_t ignore_index, int64_t chunk_rows, int64_t compute) {
    const int64_t N = hidden.size(0), V = weight_in.size(0);
    const auto weight = loss_head_weight(weight_in, compute);
    auto f32 = hidden.options().dtype(torch::kFloat32);
    auto loss = torch::empty({N}, f32), lse = torch::empty({N}, f32);
    auto ones = torch::ones({std::min(chunk_rows, N)}, f32);  // d loss of every row of the sum
    torch::Tensor dhidden, dweight;
    if (hidden.requires_grad()) dhidden = torch::empty(hidden.sizes(), hidden.options());
    if (weight_in.requires_grad()) dweight = weight_grad_accumulator(weight);
    for (int64_t start = 0; start < N; start += chunk_rows) {
      const int64_t rows = std::min(chunk_rows, N - start);
      auto h = hidden.narrow(0, start, rows);
      auto labels_chunk = labels.narrow(0, start, rows);
      auto lse_chunk = lse.narrow(0, start, rows);
      auto logits = plain_linear(h, weight);
      const auto valid = logits.narrow(1, 0, V);
      cuda::cross_entropy_forward(valid, labels_chunk, ignore_index, loss.narrow(0, start, rows),
                                  lse_chunk);
      if (!dhidden.defined() && !dweight.defined()) continue;
      cuda::cross_entropy_backward(ones.narrow(0, 0, rows), valid, labels_chunk, lse_chunk,
                                   ignore_index, valid);  // in place
      add_chunk_gradients(logits, h, weight, start, dhidden, dweight, true);
    }
    ctx->saved_data["dhidden"] = dhidden;
    ctx->saved_data["dweight"] = dweight.defined() ? dweight.narrow(0, 0, V) : dweight;
    ctx->saved_data["weight_dtype"] = int64_t(weight_in.scalar_type());
    return loss.sum();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto g = grads[0].to(torch::kFloat32);
    const auto dhidden = ctx->saved_data["dhidden"].toTensor();
    const auto dweight = ctx->saved_data["dweight"].toTensor();
    torch::Tensor dh, dw;
    if (dhidden.defined()) dh = dhidden * g;  // (in dhidden's dtype; float32 arithmetic)
    if (dweight.defined())
      dw = (dweight * g).to(torch::ScalarType(ctx->saved_data["weight_dtype"].toInt()));
    return {dh, dw, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};
#endif  // FOX_WITH_CUDA

}  // namespace

void check_loss_reduction(const std::string& reduction, const char* caller) {
  TORCH_CHECK(reduction == "none" || reduction == "sum" || reduction == "mean", caller,
              ": reduction must be 'none', 'sum' or 'mean', got '", reduction, "'");
}

torch::Tensor reduce_loss(const torch::Tensor& loss, const torch::Tensor& labels,
                          int64_t ignore_index, const std::string& reduction) {
  check_loss_reduction(reduction, "reduce_loss");
  if (reduction == "none") return loss;
  auto total = loss.dim() == 0 ? loss : loss.sum();
  if (reduction == "sum") return total;
  return total / (labels != ignore_index).sum().to(total.scalar_type());
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, int64_t group_size,
                       double eps) {
  const int64_t C = x.dim() > 0 ? x.size(-1) : 0;
  TORCH_CHECK(x.dim() >= 1 && group_size > 0 && C % group_size == 0, "rms_norm: the last dimension (",
              C, ") of x ", x.sizes(), " must be a positive multiple of group_size (", group_size, ")");
  TORCH_CHECK(!weight.defined() || (weight.dim() == 1 && weight.size(0) == C),
              "rms_norm: weight must be (", C, ",), got ", weight.sizes());
  auto out_dtype = x.scalar_type();
  if (out_dtype == torch::kFloat32 && at::autocast::is_autocast_enabled(x.device().type())) {
    out_dtype = at::autocast::get_autocast_dtype(x.device().type());
  }
#ifdef FOX_WITH_CUDA
  if (fused(x) && x.numel() > 0 && rows_fit(C, group_size, {rows_view(x)})) {
    return RMSNormFunction::apply(
        x, weight.defined() ? std::optional<torch::Tensor>(weight) : std::nullopt, group_size, eps,
        out_dtype);
  }
#endif
  auto sizes = x.sizes().vec();
  std::vector<int64_t> grouped(sizes.begin(), sizes.end() - 1);
  grouped.push_back(C / group_size);
  grouped.push_back(group_size);
  auto xf = x.reshape(grouped).to(compute_dtype(x));
  auto y = (xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps)).reshape(sizes);
  if (weight.defined()) y = y * weight.to(y.scalar_type());
  return y.to(out_dtype);
}

std::pair<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                     const torch::Tensor& delta,
                                                     const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.sizes() == delta.sizes(), "add_rms_norm: x ", x.sizes(), " and delta ",
              delta.sizes(), " must have the same shape");
#ifdef FOX_WITH_CUDA
  const int64_t C = x.dim() > 0 ? x.size(-1) : 0;
  if (fused(x) && x.numel() > 0 && delta.scalar_type() == x.scalar_type() &&
      delta.device() == x.device() && x.scalar_type() != torch::kFloat32 &&
      (!weight.defined() || (weight.dim() == 1 && weight.size(0) == C)) &&
      without_autograd({x, delta, weight})) {
    auto x2 = rows_view(x), d2 = rows_view(delta);
    if (rows_fit(C, C, {x2, d2})) {
      auto w = weight;
      if (w.defined() && w.scalar_type() != torch::kFloat32 && w.scalar_type() != x.scalar_type())
        w = w.to(torch::kFloat32);
      auto sum = torch::empty(x.sizes(), x.options());
      auto y = torch::empty(x.sizes(), x.options());
      auto rstd = torch::empty({x2.size(0), 1}, x.options().dtype(torch::kFloat32));
      cuda::rms_norm_forward(x2, w.defined() ? w.contiguous() : w, C, eps, y.view({-1, C}), rstd,
                             d2, sum.view({-1, C}));
      return {sum, y};
    }
  }
  // With autograd (a training step): the fused function where the kernels take these tensors.
  // FOX_FUSED_ADD_NORM=0: the separate steps (comparisons; read at each call).
  if (!switched_off("FOX_FUSED_ADD_NORM") && fused(x) && fused(delta) && x.numel() > 0 &&
      delta.device() == x.device() &&
      (delta.scalar_type() == x.scalar_type() ||
       (x.scalar_type() == torch::kFloat32 && delta.scalar_type() != torch::kFloat32)) &&
      (!weight.defined() || (weight.dim() == 1 && weight.size(0) == C &&
                             (weight.scalar_type() == torch::kFloat32 ||
                              weight.scalar_type() == x.scalar_type())))) {
    auto out_dtype = x.scalar_type();
    if (out_dtype == torch::kFloat32 && at::autocast::is_autocast_enabled(x.device().type()))
      out_dtype = at::autocast::get_autocast_dtype(x.device().type());
    // The kernel writes y of a half-precision branch's dtype for a float32 stream.
    const bool kernel_dtypes =
        delta.scalar_type() == x.scalar_type() || out_dtype == delta.scalar_type();
    auto x2 = rows_view(x), d2 = rows_view(delta);
    if (kernel_dtypes && rows_fit(C, C, {x2, d2})) {
      auto outs = AddRMSNormFunction::apply(
          x, delta, weight.defined() ? std::optional<torch::Tensor>(weight) : std::nullopt, eps,
          out_dtype);
      return {outs[0], outs[1]};
    }
  }
#endif
  auto sum = add_promoted(x, delta);
  return {sum, rms_norm(sum, weight, sum.size(-1), eps)};
}

torch::Tensor shift_mix_update(const torch::Tensor& cur, const torch::Tensor& shift_logits,
                               torch::Tensor& state) {
  TORCH_CHECK(cur.dim() == 3 && state.dim() == 2 && state.size(0) == cur.size(0) &&
                  state.size(1) == cur.size(2),
              "shift_mix_update: state must be (batch, channels) of cur ", cur.sizes(), ", got ",
              state.sizes());
#ifdef FOX_WITH_CUDA
  const int64_t C = cur.size(2);
  if (fused(cur) && cur.size(1) == 1 && cur.numel() > 0 &&
      shift_logits.scalar_type() == cur.scalar_type() &&
      state.scalar_type() == cur.scalar_type() && state.is_contiguous() &&
      shift_logits.dim() == 3 && shift_logits.size(0) == cur.size(0) &&
      shift_logits.size(1) == 1 && shift_logits.size(2) > 0 && C % shift_logits.size(2) == 0 &&
      without_autograd({cur, shift_logits, state}) &&
      rows_fit(C, C / shift_logits.size(2), {last_contiguous(cur), state})) {
    auto c = last_contiguous(cur);
    auto out = torch::empty(c.sizes(), c.options());
    cuda::shift_mix_forward(c, last_contiguous(shift_logits), state, out, state);
    return out;
  }
#endif
  auto out = shift_mix(cur, shift_logits, state);
  state.copy_(cur.select(1, cur.size(1) - 1));
  return out;
}

std::vector<torch::Tensor> attention_inputs(const torch::Tensor& y,
                                            const AttentionInputLayout& layout,
                                            const torch::Tensor& q_norm_weight,
                                            const torch::Tensor& k_norm_weight) {
  const auto& l = layout;
  TORCH_CHECK(y.dim() == 3, "attention_inputs: y must be (batch, seqlen, width), got ", y.sizes());
  const int64_t W = y.size(2);
  auto check_part = [&](const char* name, int64_t first, int64_t width) {
    TORCH_CHECK(first >= 0 && width > 0 && first + width <= W, "attention_inputs: part ", name,
                " (first column ", first, ", width ", width, ") must lie in y's ", W, " columns");
  };
  check_part("q", l.q, l.q_width);
  check_part("k", l.k, l.kv_width);
  check_part("v", l.v, l.kv_width);
  if (l.k_shift >= 0) check_part("k_shift", l.k_shift, l.shift_heads);
  if (l.v_shift >= 0) check_part("v_shift", l.v_shift, l.shift_heads);
  for (const auto& [first, width] : l.passed) check_part("passed", first, width);
  TORCH_CHECK((l.k_shift < 0 && l.v_shift < 0) || l.kv_width % l.shift_heads == 0,
              "attention_inputs: shift_heads (", l.shift_heads, ") must divide kv_width (",
              l.kv_width, ")");
  TORCH_CHECK(l.q_group >= 0 && l.k_group >= 0 && (!l.q_group || l.q_width % l.q_group == 0) &&
                  (!l.k_group || l.kv_width % l.k_group == 0),
              "attention_inputs: q_group (", l.q_group, ") / k_group (", l.k_group,
              ") must divide q_width (", l.q_width, ") / kv_width (", l.kv_width, ")");
  // The parts in column order, not overlapping: the fused backward writes each part's columns once.
  std::vector<std::pair<int64_t, int64_t>> ranges = {{l.q, l.q_width}, {l.k, l.kv_width},
                                                     {l.v, l.kv_width}};
  if (l.k_shift >= 0) ranges.emplace_back(l.k_shift, l.shift_heads);
  if (l.v_shift >= 0) ranges.emplace_back(l.v_shift, l.shift_heads);
  ranges.insert(ranges.end(), l.passed.begin(), l.passed.end());
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    TORCH_CHECK(ranges[i - 1].first + ranges[i - 1].second <= ranges[i].first,
                "attention_inputs: parts must not overlap: columns ", ranges[i - 1].first, "..",
                ranges[i - 1].first + ranges[i - 1].second - 1, " and ", ranges[i].first, "..",
                ranges[i].first + ranges[i].second - 1);
  }
  auto part = [&](int64_t first, int64_t width) { return y.narrow(2, first, width); };
#ifdef FOX_WITH_CUDA
  const bool wanted = !switched_off("FOX_FUSED_ATTENTION_INPUTS");
  // The kernels' conditions: y's dtype is the norms' output dtype (no autocast cast of a float32
  // y), and every part's rows fit the row kernels (the gradient's columns then do too: same
  // width, offsets and row stride).
  auto fits = [&] {
    const bool cast_by_autocast = y.scalar_type() == torch::kFloat32 &&
                                  at::autocast::is_autocast_enabled(y.device().type());
    if (!(fused(y) && y.is_contiguous() && y.numel() > 0) || cast_by_autocast) return false;
    auto rows = [&](int64_t first, int64_t width) { return rows_view(part(first, width)); };
    // A KV-shift's channel group: one head.
    const int64_t head = l.shift_heads > 0 ? l.kv_width / l.shift_heads : l.kv_width;
    auto weight_fits = [&](const torch::Tensor& w) {
      return !w.defined() || (w.device() == y.device() && w.dim() == 1);
    };
    return weight_fits(q_norm_weight) && weight_fits(k_norm_weight) &&
           (!l.q_group || rows_fit(l.q_width, l.q_group, {rows(l.q, l.q_width)})) &&
           (l.k_shift < 0 || rows_fit(l.kv_width, head, {rows(l.k, l.kv_width)})) &&
           (l.v_shift < 0 || rows_fit(l.kv_width, head, {rows(l.v, l.kv_width)})) &&
           (!l.k_group || rows_fit(l.kv_width, l.k_group, {rows(l.k, l.kv_width)}));
  };
  if (wanted && !without_autograd({y, q_norm_weight, k_norm_weight}) && fits()) {
    auto optional = [](const torch::Tensor& t) {
      return t.defined() ? std::optional<torch::Tensor>(t) : std::nullopt;
    };
    return AttentionInputsFunction::apply(y, optional(l.q_group ? q_norm_weight : torch::Tensor()),
                                          optional(l.k_group ? k_norm_weight : torch::Tensor()), l);
  }
#endif
  // The composition on the pieces of one split_with_sizes, whose backward is one concatenation
  // (each narrow view would add a gradient of y's whole width).
  std::vector<int64_t> widths;
  std::map<int64_t, size_t> piece_of;  // first column -> index of its piece
  int64_t at = 0;
  for (const auto& [first, width] : ranges) {
    if (first > at) widths.push_back(first - at);
    piece_of[first] = widths.size();
    widths.push_back(width);
    at = first + width;
  }
  if (at < W) widths.push_back(W - at);
  const auto pieces = y.split_with_sizes(widths, 2);
  auto piece = [&](int64_t first) { return pieces[piece_of.at(first)]; };
  auto q = piece(l.q), k = piece(l.k), v = piece(l.v);
  if (l.q_group) q = rms_norm(q, q_norm_weight, l.q_group, l.norm_eps);
  if (l.k_shift >= 0) k = shift_mix(k, piece(l.k_shift));
  if (l.k_group) k = rms_norm(k, k_norm_weight, l.k_group, l.norm_eps);
  if (l.v_shift >= 0) v = shift_mix(v, piece(l.v_shift));
  std::vector<torch::Tensor> out = {q, k, v};
  for (const auto& [first, width] : l.passed) out.push_back(piece(first));
  return out;
}

torch::Tensor logits(const torch::Tensor& hidden, const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "logits: weight must be (vocab, hidden), got ", weight.sizes());
  TORCH_CHECK(hidden.dim() >= 1 && hidden.size(-1) == weight.size(1), "logits: hidden ",
              hidden.sizes(), " must end in the weight's hidden size ", weight.size(1));
#ifdef FOX_WITH_CUDA
  const int64_t V = weight.size(0);
  const auto device = hidden.device().type();
  const bool autocast = at::autocast::is_autocast_enabled(device);
  const auto dtype = autocast ? at::autocast::get_autocast_dtype(device) : hidden.scalar_type();
  // The padded copy costs a pass over the weight, less than cuBLAS's unaligned kernels lose from
  // 9 rows on (H200, 50277 x 768: 98-156 us for 9-64 rows against 23-25 on the padded weight);
  // up to 8 rows the few-row kernel reads the weight as it is.
  if (V % 8 != 0 && hidden.numel() > 0 &&
      hidden.numel() / hidden.size(-1) > cuda::kSmallBatchMaxRows && fused(hidden) &&
      (autocast || weight.scalar_type() == dtype) && without_autograd({hidden, weight}) &&
      !switched_off("FOX_PAD_VOCAB")) {
    const auto padded = plain_linear(hidden.to(dtype), loss_head_weight(weight, int64_t(dtype)));
    return padded.narrow(-1, 0, V).contiguous();
  }
#endif
  return functional::linear(hidden, weight);  // (qualified: ATen's linear is found by argument)
}

torch::Tensor aligned_head_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "aligned_head_weight: weight must be (vocab, hidden), got ",
              weight.sizes());
  if (!weight.is_cuda()) return weight;
  torch::NoGradGuard no_grad;
  return loss_head_weight(weight.detach(), -1);  // the weight itself unless it is padded
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const torch::Tensor& bias, const torch::Tensor& residual) {
#ifdef FOX_WITH_CUDA
  // FOX_SMALL_BATCH_LINEAR=0: always F.linear (for comparisons).
  static const bool enabled = !switched_off("FOX_SMALL_BATCH_LINEAR");
  // Under autocast F.linear would compute in the autocast dtype: only that dtype takes the kernel.
  if (enabled && x.is_cuda() && x.dim() >= 1 && x.numel() > 0 &&
      x.numel() / x.size(-1) <= cuda::kSmallBatchMaxRows &&
      (!at::autocast::is_autocast_enabled(x.device().type()) ||
       at::autocast::get_autocast_dtype(x.device().type()) == x.scalar_type()) &&
      without_autograd({x, weight, bias, residual})) {
    auto x2 = rows_view(x);
    auto r2 = residual.defined() && residual.dim() >= 1 ? rows_view(residual) : torch::Tensor();
    if ((!residual.defined() || r2.size(0) == x2.size(0)) &&
        cuda::small_batch_linear_fits(x2, weight, bias, r2)) {
      auto sizes = x.sizes().vec();
      sizes.back() = weight.size(0);
      auto y = torch::empty(sizes, x.options());
      cuda::small_batch_linear(x2, weight, bias, r2, y.view({-1, weight.size(0)}));
      return y;
    }
  }
#endif
  torch::Tensor y;
#ifdef FOX_WITH_CUDA
  if (const int64_t compute = float32_gradient_dtype(weight); compute >= 0 && weight.dim() == 2) {
    y = Float32GradientLinearFunction::apply(
        autocast_arg(x), weight,
        bias.defined() ? std::optional<torch::Tensor>(bias) : std::nullopt, compute);
  }
#endif
  if (!y.defined()) y = folded_linear(x, weight, bias);
  return residual.defined() ? add_promoted(y, residual) : y;
}

torch::Tensor shift_mix(const torch::Tensor& cur, const torch::Tensor& shift_logits,
                        const std::optional<torch::Tensor>& first) {
  TORCH_CHECK(cur.dim() == 3, "shift_mix: cur must be (batch, seqlen, channels), got ", cur.sizes());
  const int64_t B = cur.size(0), T = cur.size(1), C = cur.size(2);
  TORCH_CHECK(shift_logits.dim() == 3 && shift_logits.size(0) == B && shift_logits.size(1) == T &&
                  shift_logits.size(2) > 0 && C % shift_logits.size(2) == 0,
              "shift_mix: shift_logits must be (", B, ", ", T, ", heads) with heads dividing ", C,
              ", got ", shift_logits.sizes());
  const bool has_first = first.has_value() && first->defined();
  if (has_first) {
    TORCH_CHECK(first->dim() == 2 && first->size(0) == B && first->size(1) == C,
                "shift_mix: first must be (", B, ", ", C, "), got ", first->sizes());
  }
#ifdef FOX_WITH_CUDA
  if (fused(cur) && cur.numel() > 0 && shift_logits.scalar_type() == cur.scalar_type() &&
      (!has_first || first->scalar_type() == cur.scalar_type()) &&
      rows_fit(C, C / shift_logits.size(2), {last_contiguous(cur), has_first ? *first : torch::Tensor()})) {
    return ShiftMixFunction::apply(cur, shift_logits, has_first ? first : std::nullopt);
  }
#endif
  const int64_t H = shift_logits.size(2), D = C / H;
  const auto gate_dtype = compute_dtype(cur);
  auto alpha = torch::sigmoid(shift_logits.to(gate_dtype)).unsqueeze(-1);  // (B, T, H, 1)
  auto row0 = has_first ? first->to(cur.scalar_type()).unsqueeze(1)
                        : torch::zeros({B, 1, C}, cur.options());
  auto prev = torch::cat({row0, cur.narrow(1, 0, T - 1)}, 1);
  auto now = cur.reshape({B, T, H, D}).to(gate_dtype);
  auto before = prev.view({B, T, H, D}).to(gate_dtype);
  return (alpha * before + (1 - alpha) * now).to(cur.scalar_type()).view({B, T, C});
}

torch::Tensor embedding(const torch::Tensor& ids, const torch::Tensor& weight,
                        std::optional<int64_t> padding_idx) {
  TORCH_CHECK(weight.dim() == 2, "embedding: weight must be (rows, dim), got ", weight.sizes());
  TORCH_CHECK(ids.scalar_type() == torch::kLong || ids.scalar_type() == torch::kInt,
              "embedding: ids must be int64 or int32, got ", ids.scalar_type());
  const int64_t padding = padding_idx.value_or(-1);
#ifdef FOX_WITH_CUDA
  if (weight.is_cuda() && weight.requires_grad() && torch::GradMode::is_enabled())
    return EmbeddingFunction::apply(weight, ids, padding);
#endif
  return at::embedding(weight, ids, padding);
}

torch::Tensor log_forget_gate(const torch::Tensor& logits, const torch::Tensor& bias) {
  TORCH_CHECK(logits.dim() == 3, "log_forget_gate: logits must be (batch, seqlen, heads), got ",
              logits.sizes());
  TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == logits.size(2)),
              "log_forget_gate: bias must be (", logits.size(2), ",), got ", bias.sizes());
#ifdef FOX_WITH_CUDA
  if (fused(logits) && !switched_off("FOX_FUSED_FORGET_GATE") &&
      (!bias.defined() || (bias.device() == logits.device() &&
                           (bias.scalar_type() == logits.scalar_type() ||
                            bias.scalar_type() == torch::kFloat32)))) {
    return ForgetGateFunction::apply(logits, bias.defined() ? std::optional(bias) : std::nullopt);
  }
#endif
  auto z = bias.defined() ? logits + bias.to(logits.scalar_type()) : logits;
  return torch::log_sigmoid(z.to(compute_dtype(logits)));
}

torch::Tensor gated(const torch::Tensor& gate, const torch::Tensor& value, const std::string& act) {
  TORCH_CHECK(gate.sizes() == value.sizes(), "gated: gate ", gate.sizes(),
              " and value ", value.sizes(), " must have the same shape");
  const bool silu = is_silu(act);
#ifdef FOX_WITH_CUDA
  if (fused(gate) && gate.scalar_type() == value.scalar_type() && gate.dim() >= 1 &&
      gate.numel() > 0 && gate.device() == value.device() &&
      rows_fit(gate.size(-1), gate.size(-1), {rows_view(gate), rows_view(value)})) {
    return GatedFunction::apply(gate, value, silu);
  }
#endif
  return (silu ? torch::nn::functional::silu(gate) : torch::sigmoid(gate)) * value;
}

torch::Tensor gated_linear(const torch::Tensor& gate, const torch::Tensor& value,
                           const std::string& act, const torch::Tensor& weight,
                           const torch::Tensor& bias, const torch::Tensor& residual) {
  // FOX_RECOMPUTE_GATED=0 (read at each call, for comparisons) keeps the product.
  if (without_autograd({gate, value, weight, bias}) || switched_off("FOX_RECOMPUTE_GATED")) {
    return linear(gated(gate, value, act), weight, bias, residual);
  }
  is_silu(act);  // checks act before the autograd function takes it
  const int64_t compute = float32_gradient_dtype(weight);
  auto y = GatedLinearFunction::apply(
      gate, value, weight_arg(weight, compute),
      bias.defined() ? std::optional<torch::Tensor>(weight_arg(bias, compute)) : std::nullopt, act,
      compute);
  return residual.defined() ? add_promoted(y, residual) : y;
}

torch::Tensor split_gated_linear(const torch::Tensor& gate_value, const std::string& act,
                                 const torch::Tensor& weight, const torch::Tensor& bias,
                                 const torch::Tensor& residual) {
  TORCH_CHECK(gate_value.dim() >= 1 && gate_value.size(-1) % 2 == 0,
              "split_gated_linear: gate_value must have an even last dimension (gate, value), got ",
              gate_value.sizes());
  const int64_t F = gate_value.size(-1) / 2;
#ifdef FOX_WITH_CUDA
  if (!without_autograd({gate_value, weight, bias}) && !switched_off("FOX_RECOMPUTE_GATED") &&
      fused(gate_value) &&
      gate_value.numel() > 0 && autocast_arg(gate_value).scalar_type() == gate_value.scalar_type()) {
    auto gv = rows_view(gate_value);
    if (rows_fit(F, F, {gv.narrow(1, 0, F), gv.narrow(1, F, F)})) {
      is_silu(act);  // checks act before the autograd function takes it
      const int64_t compute = float32_gradient_dtype(weight);
      auto y = SplitGatedLinearFunction::apply(
          gate_value, weight_arg(weight, compute),
          bias.defined() ? std::optional<torch::Tensor>(weight_arg(bias, compute)) : std::nullopt,
          act, compute);
      return residual.defined() ? add_promoted(y, residual) : y;
    }
  }
#endif
  return gated_linear(gate_value.narrow(-1, 0, F), gate_value.narrow(-1, F, F), act, weight, bias,
                      residual);
}

torch::Tensor linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                   const torch::Tensor& labels, int64_t ignore_index,
                                   int64_t chunk_rows, const std::string& reduction) {
  TORCH_CHECK(chunk_rows >= 0, "linear_cross_entropy: chunk_rows must be >= 0, got ", chunk_rows);
  check_loss_reduction(reduction, "linear_cross_entropy");
  if (without_autograd({hidden, weight}) || hidden.dim() < 1 || hidden.numel() == 0 ||
      weight.dim() != 2) {
    return reduce_loss(cross_entropy(functional::linear(hidden, weight), labels, ignore_index),
                       labels, ignore_index, reduction);
  }
  TORCH_CHECK(hidden.dim() == labels.dim() + 1 &&
                  hidden.sizes().slice(0, labels.dim()) == labels.sizes(),
              "linear_cross_entropy: hidden (..., channels) ", hidden.sizes(),
              " must match labels (...) ", labels.sizes());
  TORCH_CHECK(!at::isFloatingType(labels.scalar_type()),
              "linear_cross_entropy: labels must be integer class indices, got ",
              labels.scalar_type());
  auto h = rows_view(autocast_arg(hidden));
  const int64_t compute = float32_gradient_dtype(weight);
  auto w = weight_arg(weight, compute);
  if (chunk_rows == 0) {
    constexpr int64_t kChunkBytes = int64_t(256) << 20;
    const int64_t logit_bytes = compute >= 0 ? 2 : w.element_size();
    chunk_rows = std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, w.size(0) * logit_bytes));
  }
  auto flat = labels.reshape({-1}).to(h.device(), torch::kLong).contiguous();
#ifdef FOX_WITH_CUDA
  if (reduction != "none" && LinearCrossEntropyFunction::direct(h)) {
    auto total =
        SummedLinearCrossEntropyFunction::apply(h, w, flat, ignore_index, chunk_rows, compute);
    return reduce_loss(total, flat, ignore_index, reduction);
  }
#endif
  return reduce_loss(
      LinearCrossEntropyFunction::apply(h, w, flat, ignore_index, chunk_rows, compute)
          .view(labels.sizes()),
      labels, ignore_index, reduction);
}

torch::Tensor argmax(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "argmax: x must have a non-empty last dimension, got ",
              x.sizes());
#ifdef FOX_WITH_CUDA
  if (fused(x)) {
    auto rows = rows_view(x);
    auto out = torch::empty({rows.size(0)}, x.options().dtype(torch::kLong));
    cuda::argmax(rows, out);
    auto sizes = x.sizes().vec();
    sizes.pop_back();
    return out.view(sizes);
  }
#endif
  return x.argmax(-1);
}

torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& labels,
                            int64_t ignore_index) {
  TORCH_CHECK(logits.dim() >= 1 && logits.dim() == labels.dim() + 1 &&
                  logits.sizes().slice(0, labels.dim()) == labels.sizes(),
              "cross_entropy: logits (..., vocab) ", logits.sizes(),
              " must match labels (...) ", labels.sizes());
  TORCH_CHECK(!at::isFloatingType(labels.scalar_type()),
              "cross_entropy: labels must be integer class indices, got ", labels.scalar_type());
#ifdef FOX_WITH_CUDA
  if (fused(logits) && logits.numel() > 0) {
    return CrossEntropyFunction::apply(logits, labels, ignore_index);
  }
#endif
  auto lf = logits.to(compute_dtype(logits));
  auto loss = torch::nn::functional::cross_entropy(
      lf.reshape({-1, lf.size(-1)}), labels.reshape({-1}).to(logits.device(), torch::kLong),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone).ignore_index(
          ignore_index));
  return loss.view(labels.sizes());
}

}  // namespace fox::nn::functional
