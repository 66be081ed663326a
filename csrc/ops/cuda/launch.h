// Host-side entry points of the CUDA kernels, called by api.cu (the only file that touches ATen)
// and defined in instantiations/*.cu, one small file per dtype (and head dim for the fast paths).
#pragma once

#include <cuda_runtime.h>

#include "../params.h"

namespace fox::cuda {

// Split-KV decoding: a few queries against a long cache. The keys are cut into chunks of whole
// 32-key tiles; one block per (sequence, head, chunk) writes a partial result and a combine kernel
// merges them with their log-sum-exps.
struct SplitKVParams {
  int num_splits = 1;
  int key_tile = 32;            // keys per tile of the kernel that runs (32 generic, 64 fast)
  int64_t tiles_per_split = 0;  // key tiles per chunk
  int64_t total_rows = 0;       // batch * seqlen_q rows of the tensors
  float* out_partial = nullptr;  // (num_splits, num_heads, total_rows, head_dim)
  float* lse_partial = nullptr;  // (num_splits, num_heads, total_rows), log2 domain
  float* carry = nullptr;        // (num_sequences, num_heads, num_splits): R at each chunk's top
};

// Workspace of the backward pass (float32, laid out like lse: (batch, num_heads, seqlen)).
struct BackwardWorkspace {
  float* delta = nullptr;  // rowsum(dO * O), (batch, num_heads, seqlen_q)
  float* dc = nullptr;     // -(column sums of dS) per key, (batch, num_heads, seqlen_k)
  // Row sums of dS per query, (batch, num_heads, seqlen_q). Zero in exact arithmetic, but delta
  // comes from the rounded (fp16/bf16) output, and keeping these sums in dc = rowsum - colsum
  // cancels that rounding for every key the query attends to (reverse cumsum of dc).
  float* dq_rowsum = nullptr;
  // Hopper kernels only: -(T + lse) per query in log2 units, T the gate suffix sum at its position
  // (gate_suffix_kernel in hopper_forward.cuh), (batch, num_heads, seqlen_q).
  float* query_bias = nullptr;
  // Fused Hopper backward only (api.cu: backward_form): dQ and the row sums of dS accumulated in
  // float32, rows of fused_dq_row(head_dim) floats laid out like lse; zeroed, or in turns stored by
  // the first addition to each row (fused_dq_zeroed_from).
  float* dq_accum = nullptr;
  // Fused backward in turns (bitwise reproducible dQ): per query row, zeroed, the number of key
  // tiles that have added their part to the query tile starting at that row; nullptr: any order.
  int* dq_turns = nullptr;
};

// Floats per row of BackwardWorkspace::dq_accum (dQ, the row sum of dS, padding: rows stay 16-byte
// aligned for the bulk reductions, and the rows a warp writes at once fall on different banks),
// and the floats of the whole accumulator for `rows` = batch * num_heads * seqlen_q query rows.
constexpr int fused_dq_row(int head_dim) { return head_dim + 4; }
constexpr int64_t fused_dq_accumulator_floats(int64_t rows, int head_dim) {
  return rows * fused_dq_row(head_dim);
}
// 4-byte words of the whole fused workspace: the accumulator, then the turn counters (one per
// query row).
constexpr int64_t fused_dq_workspace_words(int64_t rows, int head_dim) {
  return fused_dq_accumulator_floats(rows, head_dim) + rows;
}
// First word of the fused workspace that needs zeros before the backward: in turns only the
// counters (the first addition to a row stores it), in any order the accumulator too.
constexpr int64_t fused_dq_zeroed_from(int64_t rows, int head_dim, bool in_turns) {
  return in_turns ? fused_dq_accumulator_floats(rows, head_dim) : 0;
}

// Any head dim in [1, 256], fp16/bf16/fp32 (T = __half, __nv_bfloat16, float). `max_len_q` bounds
// the queries of one sequence (sizes the grid).
template <typename T>
void run_generic_forward(const ForwardParams& p, int64_t max_len_q, cudaStream_t stream);
template <typename T>
void run_split_kv_forward(const ForwardParams& p, const SplitKVParams& split, cudaStream_t stream);
template <typename T>
void run_generic_backward(const BackwardParams& p, const BackwardWorkspace& ws, int64_t max_len_q,
                          int64_t max_len_k, cudaStream_t stream);

// Tensor-core forward (mma.sync m16n8k16) for head_dim 64 and 128, fp16/bf16.
template <typename T, int kHeadDim>
void run_fast_forward(const ForwardParams& p, int64_t max_len_q, cudaStream_t stream);
template <typename T, int kHeadDim>
void run_fast_split_kv_forward(const ForwardParams& p, const SplitKVParams& split,
                               cudaStream_t stream);

// Hopper kernels (wgmma, sm_90a) for head_dim 64 and 128, fp16/bf16. Usable where the device is
// a Hopper GPU and the build carries sm_90a code for it. `gate_suffix` is a float32 workspace laid
// out like the keys' gates, (batch, num_heads, seqlen_k); the forward's `workspace` is that and
// one word more, the persistent forward's tile counter (forward_workspace_words).
bool hopper_kernels_available();
// (A packed batch, cu_seqlens, has one row of gates per head: batch_index is 0.)
inline int64_t forward_tile_counter_offset(const ForwardParams& p) {
  return (p.cu_seqlens != nullptr ? 1 : p.batch) * p.num_heads * p.seqlen_k;
}
inline int64_t forward_workspace_words(const ForwardParams& p) { return forward_tile_counter_offset(p) + 1; }
template <typename T, int kHeadDim>
void run_hopper_forward(const ForwardParams& p, float* workspace, int64_t max_len_q,
                        int64_t max_len_k, cudaStream_t stream);
template <typename T, int kHeadDim>
void run_hopper_split_kv_forward(const ForwardParams& p, const SplitKVParams& split,
                                 float* gate_suffix, cudaStream_t stream);
template <typename T, int kHeadDim>
void run_hopper_backward(const BackwardParams& p, const BackwardWorkspace& ws, float* gate_suffix,
                         int64_t max_len_q, int64_t max_len_k, cudaStream_t stream);

// Decoding (seqlen_q <= 16, no cu_seqlens) for head_dim 64 and 128, fp16/bf16: the query heads of a
// KV group packed into one tile, the cache split into num_splits chunks per row (decode.cuh). With
// num_splits > 1 the workspaces are (num_splits, num_heads, batch * seqlen_q, head_dim),
// (num_splits, num_heads, batch * seqlen_q) and (num_splits, batch, num_heads) float32.
constexpr int kDecodeMaxSplits = 256;
// Keys per tile of the decoding kernel: head dim 64 takes 128 keys to move as many bytes per tile
// (two barriers and a gate scan) as head dim 128 does with 64.
constexpr int decode_keys_per_tile(int head_dim) { return head_dim <= 64 ? 128 : 64; }
// The decoding kernel's plan: chunks per row, and paired blocks (two groups of warps, each a half
// of the chunk, merged in the block: decode.cuh) or single ones.
struct DecodePlan {
  int num_splits = 1;
  bool paired = false;
};
// half_gates: log_fgate is float16 (else float32). Resident single (or paired) blocks per SM; 0
// for paired blocks that do not fit an SM.
template <typename T, int kHeadDim>
int decode_blocks_per_sm(bool half_gates, bool paired);
template <typename T, int kHeadDim>
void run_decode_forward(const ForwardParams& p, bool half_gates, const DecodePlan& plan,
                        float* out_partial, float* lse_partial, float* gate_total,
                        cudaStream_t stream);

// Tensor-core backward for head_dim 64 and 128, fp16/bf16.
template <typename T, int kHeadDim>
void run_fast_backward(const BackwardParams& p, const BackwardWorkspace& ws, int64_t max_len_q,
                       int64_t max_len_k, cudaStream_t stream);

}  // namespace fox::cuda
