// The model's elementwise building blocks as functions with their own autograd. On CUDA each is
// one fused kernel forward and one backward (float32 math, one rounding to the output dtype); on
// CPU and in float64 they are the plain ATen formulas. Inputs may be slices of a larger tensor
// (e.g. of one concatenated projection) as long as their last dimension is contiguous.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

namespace fox::nn::functional {

/// RMSNorm over groups of `group_size` channels of the last dimension, times `weight` (C,) when
/// defined: y = x / sqrt(mean(x^2) + eps) * weight. The output has x's dtype, except that a
/// float32 x under autocast gives the autocast dtype (what the next projection reads anyway).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, int64_t group_size,
                       double eps);

/// The KV-shift mix: out[:, t] = a_t * cur[:, t-1] + (1 - a_t) * cur[:, t] with
/// a_t = sigmoid(shift_logits[:, t, head]), cur (B, T, H*D), shift_logits (B, T, H); the row
/// before t = 0 is `first` (B, H*D) when given, zeros otherwise.
torch::Tensor shift_mix(const torch::Tensor& cur, const torch::Tensor& shift_logits,
                        const std::optional<torch::Tensor>& first = std::nullopt);

/// The log forget gate log f = logsigmoid(logits + bias) in float32 (float64 for float64 logits):
/// logits (B, T, H), bias (H,) or undefined. As the composition rounds it under autocast: the bias
/// cast to the logits' dtype, the sum rounded to it, then cast up. On CUDA one kernel forward and
/// one backward (and the bias gradient's sum) for the composition's four launches each way, with
/// the log-sigmoid evaluated in float64 and rounded once; elsewhere the composition.
/// FOX_FUSED_FORGET_GATE=0 composes.
torch::Tensor log_forget_gate(const torch::Tensor& logits, const torch::Tensor& bias);

/// weight[ids], as F.embedding (with padding_idx, that row gets no gradient). On CUDA under
/// autograd the weight's gradient sums the rows of repeated ids in a fixed order (index_put_ with
/// accumulate sorts the ids first): ATen's embedding backward sums them in an order that changes
/// from run to run on batches of thousands of ids, so two identical training steps would differ.
torch::Tensor embedding(const torch::Tensor& ids, const torch::Tensor& weight,
                        std::optional<int64_t> padding_idx = std::nullopt);

/// rms_norm(x + delta) over the whole last dimension, returning {x + delta, its norm}: a residual
/// add and the next norm. On CUDA one kernel (the sum is rounded to x's dtype before the norm, as
/// the separate add rounds it), with autograd too (a float32 stream plus a half-precision branch
/// under autocast; the backward is one kernel as well); elsewhere the add, then rms_norm. Either
/// way bitwise the separate steps. FOX_FUSED_ADD_NORM=0 takes the separate steps with autograd.
std::pair<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                     const torch::Tensor& delta,
                                                     const torch::Tensor& weight, double eps);

/// shift_mix(cur, shift_logits, state), then state = cur[:, T-1] in place: a decoding step's
/// KV-shift against a static cache's state (B, H*D). On CUDA without autograd and for T = 1 one
/// kernel; otherwise shift_mix and a copy.
torch::Tensor shift_mix_update(const torch::Tensor& cur, const torch::Tensor& shift_logits,
                               torch::Tensor& state);

/// Where the parts of an attention layer's one input projection lie in its last dimension (first
/// column and width) and what is done to its q, k and v.
struct AttentionInputLayout {
  int64_t q = 0, k = 0, v = 0;         // first columns of q (q_width wide), k and v (kv_width)
  int64_t q_width = 0, kv_width = 0;
  int64_t k_shift = -1, v_shift = -1;  // first columns of k's / v's KV-shift logits (-1: none)
  int64_t shift_heads = 0;             // their width
  int64_t q_group = 0, k_group = 0;    // group size of q's / k's RMSNorm (0: none)
  double norm_eps = 1e-6;
  std::vector<std::pair<int64_t, int64_t>> passed;  // other parts: (first column, width)
};

/// From an attention layer's input projection y (B, T, W): {q, k, v, passed parts...} with
/// q = rms_norm(y[q]), k = rms_norm(shift_mix(y[k], y[k_shift])), v = shift_mix(y[v], y[v_shift])
/// (each step where the layout has it; the norms with q_norm_weight / k_norm_weight) and the
/// passed parts as views of y. Bitwise the composition. On CUDA under autograd one node whose
/// backward writes every part's gradient into its columns of one (B, T, W) tensor (zeros in
/// columns of no part): the projection's backward takes it as it is, where the gradients of split
/// parts would be concatenated. FOX_FUSED_ATTENTION_INPUTS=0 (read at each call) composes.
std::vector<torch::Tensor> attention_inputs(const torch::Tensor& y,
                                            const AttentionInputLayout& layout,
                                            const torch::Tensor& q_norm_weight = {},
                                            const torch::Tensor& k_norm_weight = {});

/// x @ weight^T (+ bias) (+ residual): F.linear, with an optional residual added in the same
/// pass. On CUDA without autograd, for up to 8 rows of fp16/bf16 (weight of x's dtype), one
/// matrix-vector kernel that reads the weight once (a decoding step's projections); elsewhere
/// F.linear and an add. Under autocast on CUDA a float32 weight's gradient is made in float32 by
/// the GEMM itself (autocast's F.linear makes it in bf16 and casts it up); so are those of
/// gated_linear, split_gated_linear and linear_cross_entropy.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const torch::Tensor& bias = {}, const torch::Tensor& residual = {});

/// The LM head's logits, linear(hidden, weight). On CUDA without autograd, for 9 rows or more
/// and a vocabulary that is no multiple of 8, the product runs on the weight padded with zero rows
/// (16-byte aligned logits: cuBLAS's fast kernels) and the first V columns are copied out.
torch::Tensor logits(const torch::Tensor& hidden, const torch::Tensor& weight);

/// The LM head's weight for many inference products with one weight (a generation session's
/// steps): on CUDA a vocabulary that is no multiple of 8 gets a copy padded with zero rows to a
/// multiple of 64, since logits rows that are not 16-byte aligned put cuBLAS on kernels 4-7x
/// slower (H200, 9-2048 rows of a 50277 x 768 head); otherwise, or with FOX_PAD_VOCAB=0, the
/// weight itself. The logits are linear(hidden, it).narrow(-1, 0, V).
torch::Tensor aligned_head_weight(const torch::Tensor& weight);

/// act(gate) * value with act "swish" (silu) or "sigmoid": SwiGLU, and the attention output gate.
torch::Tensor gated(const torch::Tensor& gate, const torch::Tensor& value, const std::string& act);

/// linear(gated(gate, value, act), weight, bias) (+ residual): a gated MLP's product and down
/// projection, the attention output gate and o_proj. Under autograd only gate, value and weight
/// (and bias) are kept for the backward, which computes gated(gate, value) again: the product is
/// never kept. Forward and gradients are bitwise those of the composition (autocast included);
/// without autograd, or with FOX_RECOMPUTE_GATED=0 (read at each call), it is the composition.
torch::Tensor gated_linear(const torch::Tensor& gate, const torch::Tensor& value,
                           const std::string& act, const torch::Tensor& weight,
                           const torch::Tensor& bias = {}, const torch::Tensor& residual = {});

/// gated_linear of the two halves of gate_value's last dimension, gate first (a gated MLP's one
/// up projection, as the authors' GatedMLP chunks it). Under autograd on CUDA the gradient of
/// gate_value is written as one tensor: no concatenation of the halves' gradients. Elsewhere
/// (CPU, no autograd, FOX_RECOMPUTE_GATED=0, rows the fused kernels do not take) it is
/// gated_linear of the two halves as views. Bitwise gated_linear either way.
torch::Tensor split_gated_linear(const torch::Tensor& gate_value, const std::string& act,
                                 const torch::Tensor& weight, const torch::Tensor& bias = {},
                                 const torch::Tensor& residual = {});

/// cross_entropy(linear(hidden, weight), labels, ignore_index): the per-token loss of a language
/// model head. Under autograd the logits are made `chunk_rows` rows at a time (0: as many as fit
/// in about 256 MiB) and never kept: the backward makes each chunk's logits again. The loss
/// matches the composition up to the rounding of GEMMs over fewer rows; without autograd it is
/// the composition.
/// reduction: "none" (the per-token loss, the shape of labels), "sum" (a float32 scalar) or
/// "mean" (the sum over the tokens not labelled ignore_index, divided by their count). A reduced
/// loss on CUDA makes its gradients in the forward, chunk by chunk, and keeps d hidden and d
/// weight (float32 for a half-precision weight) for the backward instead of making the logits
/// again there: the LM head then takes three GEMMs a training step instead of four.
torch::Tensor linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                   const torch::Tensor& labels, int64_t ignore_index = -100,
                                   int64_t chunk_rows = 0, const std::string& reduction = "none");

/// A loss reduced as `reduction` asks: "none" (loss as it is), "sum" or "mean" (the sum divided by
/// the count of labels that are not ignore_index). loss: per-token losses, 0 at ignored labels, or
/// their sum already (a scalar).
torch::Tensor reduce_loss(const torch::Tensor& loss, const torch::Tensor& labels,
                          int64_t ignore_index, const std::string& reduction);
/// Errors (naming `caller`) unless reduction is "none", "sum" or "mean".
void check_loss_reduction(const std::string& reduction, const char* caller);

/// argmax(x, -1) as int64 (the first index on ties, NaN counting as the largest, as torch.argmax):
/// a greedy decoding step's token. On CUDA one kernel per call (torch's reduction takes ~16 us for
/// one 50k-vocabulary row on an H100).
torch::Tensor argmax(const torch::Tensor& x);

/// Per-token cross entropy (float32, the shape of labels) of logits (..., V) against labels
/// (...) int64; tokens labelled `ignore_index` give 0. Logits are read in their own dtype.
torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& labels,
                            int64_t ignore_index = -100);

}  // namespace fox::nn::functional
