// Fused CUDA kernels of the model's elementwise work (normalizations, KV-shift, gates, loss).
// Launchers take 2-D row views: (rows, C) with a row stride and a contiguous last dimension, so
// slices of one concatenated projection are read in place. Outputs are contiguous, except where a
// launcher says it writes a view with row strides (the input gradients of the norm, KV-shift and
// gates, written into the columns of one projection's gradient). Called only by
// csrc/nn/functional.cpp, which owns the autograd and the fallbacks.
#pragma once

#include <initializer_list>

#include <ATen/core/Tensor.h>

namespace fox::nn::cuda {

// The row kernels (all but the loss) give each thread VEC consecutive channels of a row: the widest
// VEC (<= 16 bytes) that the channel count, the group size (norm group, head) and every tensor's
// alignment and row strides allow, with at most 1024 threads a row. 0: they cannot take these
// tensors (the callers then use the ATen formulas).
int row_vector_width(int64_t channels, int64_t group, std::initializer_list<at::Tensor> tensors);

// y = x * rsqrt(mean_group(x^2) + eps) * weight, per group of `group` channels; rstd (rows, C/group).
// weight (C,): float32 or x's dtype (read as it is). With delta (rows, C), the input is x + delta
// rounded to x's dtype, also written to sum (rows, C) contiguous, of x's dtype: a residual add and
// the next norm in one pass. delta has x's dtype, or a half-precision dtype added to float32 x
// (a training step's float32 residual stream and bf16 branch; then y has delta's dtype).
void rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, int64_t group, double eps,
                      const at::Tensor& y, const at::Tensor& rstd, const at::Tensor& delta = {},
                      const at::Tensor& sum = {});
// dx (rows, C), any row stride, and, when defined, dweight (C,) float32. With dsum (rows, C) of
// x's dtype, dx is the norm's input gradient plus dsum (the residual stream's gradient that skips
// the norm); with dx_cast (x's dtype, or dy's when x is float32) dx is also written there.
void rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& rstd, int64_t group, const at::Tensor& dx,
                       const at::Tensor& dweight, const at::Tensor& dsum = {},
                       const at::Tensor& dx_cast = {});

// out[b, t] = a * cur[b, t-1] + (1 - a) * cur[b, t], a = sigmoid(logits[b, t, head]); the row
// before t = 0 is first[b] (zeros when undefined). cur (B, T, C), logits (B, T, H): 3-D views with
// a contiguous last dimension. When defined, last (B, C) receives cur[:, T-1] (a cache's KV-shift
// state); it may be first itself only when T = 1.
void shift_mix_forward(const at::Tensor& cur, const at::Tensor& logits, const at::Tensor& first,
                       const at::Tensor& out, const at::Tensor& last = {});
// dout contiguous; dcur (B, T, C) and dlogits (B, T, H) any strides, the last dimension
// contiguous.
void shift_mix_backward(const at::Tensor& dout, const at::Tensor& cur, const at::Tensor& logits,
                        const at::Tensor& first, const at::Tensor& dcur,
                        const at::Tensor& dlogits, const at::Tensor& dfirst);

// Whether shift_norm_forward / shift_norm_backward take `rows` rows of `channels` in norm groups
// of `group` and shift heads of `head` from these tensors (the row kernels' conditions, at most
// 256 threads a row and 2^31 rows).
bool shift_norm_fits(int64_t rows, int64_t channels, int64_t group, int64_t head,
                     std::initializer_list<at::Tensor> tensors);
// The KV-shift of an attention layer's k part and the RMSNorm by group after it, in one pass
// each way, the shifted rows never stored: the forward is rms_norm_forward on
// shift_mix_forward(cur, logits) (zeros before each sequence's first row), bitwise; the backward
// makes the shifted rows again and writes d cur, d logits and d weight (float32, when defined) as
// rms_norm_backward then shift_mix_backward would. cur (rows, C), logits (rows, H), dy and the
// gradients: 2-D row views (any row stride) of sequences of seq_len rows, one after another; y
// contiguous. The backward's weight is float32.
void shift_norm_forward(const at::Tensor& cur, const at::Tensor& logits, int64_t seq_len,
                        const at::Tensor& weight, int64_t group, double eps, const at::Tensor& y,
                        const at::Tensor& rstd);
void shift_norm_backward(const at::Tensor& dy, const at::Tensor& cur, const at::Tensor& logits,
                         int64_t seq_len, const at::Tensor& weight, const at::Tensor& rstd,
                         int64_t group, const at::Tensor& dcur, const at::Tensor& dlogits,
                         const at::Tensor& dweight);

// y = act(g) * u with act = silu (swish) or sigmoid; g and u (rows, C). g, u, dg and du may have
// any row stride (the two halves of one projection's rows); y and dy are contiguous.
void gated_forward(const at::Tensor& g, const at::Tensor& u, bool silu, const at::Tensor& y);
// dg and du from dy; when defined, y also receives the product, bitwise gated_forward's (a
// backward that needs the product again for its weight's gradient reads g and u once). y may be
// dy itself: the product then takes the incoming gradient's place.
void gated_backward(const at::Tensor& dy, const at::Tensor& g, const at::Tensor& u, bool silu,
                    const at::Tensor& dg, const at::Tensor& du, const at::Tensor& y = {});

// dst = src for (rows, C) views of one dtype with any row strides (a part's gradient into its
// columns of a wider tensor).
void copy_rows(const at::Tensor& src, const at::Tensor& dst);

// log f = logsigmoid(logits + bias) in float32: logits (B, T, H) with a contiguous last dimension
// (float32/float16/bfloat16), bias (H,) of the logits' dtype or float32, or undefined; the bias is
// cast to the logits' dtype and the sum rounded to it, as the composition under autocast does. out
// (B, T, H) float32 contiguous.
void forget_gate_forward(const at::Tensor& logits, const at::Tensor& bias, const at::Tensor& out);
// dlogits (B, T, H) contiguous, of the logits' dtype, from dout (B, T, H) float32 contiguous.
void forget_gate_backward(const at::Tensor& dout, const at::Tensor& logits, const at::Tensor& bias,
                          const at::Tensor& dlogits);

// Per-row cross entropy of logits (rows, V) (unit column stride, any row stride) against labels
// (rows,) int64; rows whose label is ignore_index give 0. loss and lse float32 (rows,).
void cross_entropy_forward(const at::Tensor& logits, const at::Tensor& labels,
                           int64_t ignore_index, const at::Tensor& loss, const at::Tensor& lse);
// dlogits = (softmax(logits) - onehot(label)) * dloss, in the logits' dtype; dlogits (rows, V)
// with a unit column stride, may be logits itself.
void cross_entropy_backward(const at::Tensor& dloss, const at::Tensor& logits,
                            const at::Tensor& labels, const at::Tensor& lse, int64_t ignore_index,
                            const at::Tensor& dlogits);

// out[r] = index of the largest value of row r of x (rows, V) (V >= 1), as torch.argmax: the first
// on ties, NaN counting as the largest. out (rows,) int64.
void argmax(const at::Tensor& x, const at::Tensor& out);

// The static cache's write of T new tokens: k[b, pos[b, t]] = k_new[b, t] (and v, g). k_new,
// v_new (B, T, C) of the cache's dtype and g_new (B, T, H) with a contiguous last dimension; k, v
// (B, L, C) and g (B, L, H) float32 likewise; positions (B, T) int64 contiguous, each < L. g_new is
// float32 log f, or, with gate_logits, the forget gate's logits (float32 or the cache's dtype):
// log f = logsigmoid(logit) is computed in the write.
void cache_write(const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& g_new,
                 bool gate_logits, const at::Tensor& positions, const at::Tensor& k,
                 const at::Tensor& v, const at::Tensor& g);

}  // namespace fox::nn::cuda
