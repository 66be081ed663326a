// Plain description of one forgetting-attention call, shared by every backend.
//
// Only the backend entry points (cpu/forgetting_attention_cpu.cpp, cuda/api.cu) build these from
// tensors; kernels see pointers, strides and sizes and nothing of ATen.
//
// Layout: q is (batch, seqlen_q, num_heads, head_dim), k and v are (batch, seqlen_k, num_kv_heads,
// head_dim), log_fgate is (batch, seqlen_k, num_heads); strides are in elements and the head_dim
// stride is 1. With cu_seqlens the batch is packed: batch == 1 in the tensors, the sequences are the
// row ranges [cu_seqlens[s], cu_seqlens[s+1]) and seqlen_q == seqlen_k == total length.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define FOX_HOST_DEVICE __host__ __device__
#else
#define FOX_HOST_DEVICE
#endif

namespace fox {

// Where one sequence of the batch lives and which of its keys are visible.
struct SequenceView {
  int64_t batch_index;  // index into the batch dimension of the tensors
  int64_t row_q;        // first query row of this sequence in the seqlen_q dimension
  int64_t row_k;        // first key row in the seqlen_k dimension
  int64_t len_q;        // number of queries; they are the LAST len_q of the len_k positions
  int64_t len_k;        // number of keys (positions 0 .. len_k-1)
  int64_t first_key;    // keys before this position are masked out (left padding)

  // Position (among the keys) of query i.
  FOX_HOST_DEVICE int64_t query_position(int64_t i) const { return i + (len_k - len_q); }
};

struct ForwardParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* log_fgate = nullptr;  // float32 (float64 in the CPU float64 path)
  void* out = nullptr;   // same layout rules as q
  void* lse = nullptr;  // (batch, num_heads, seqlen_q), contiguous, float32 (float64 in the CPU
                        // float64 path); natural log

  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t g_batch_stride = 0, g_row_stride = 0, g_head_stride = 0;  // log_fgate
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;

  int64_t batch = 0;  // number of sequences (== len(cu_seqlens) - 1 when packed)
  int64_t seqlen_q = 0, seqlen_k = 0;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;

  const int64_t* seq_start = nullptr;   // (batch,) or null
  const int64_t* cu_seqlens = nullptr;  // (batch + 1,) or null
  // (batch,) or null: number of valid keys of each row (a static KV cache filled to different
  // lengths); row b's queries are the last seqlen_q of its cache_seqlens[b] keys.
  const int64_t* cache_seqlens = nullptr;

  double scale = 1.0;  // kernels cast it to their accumulation type
  // Adaptive computation pruning: key tiles whose largest possible gate bias d_ij lies below this
  // value are skipped. -inf disables pruning.
  float prune_threshold = -INFINITY;

  // (In 32 bits: head counts are small, and a 64-bit division is a long routine on the GPU.)
  FOX_HOST_DEVICE int64_t heads_per_kv_head() const {
    return static_cast<uint32_t>(num_heads) / static_cast<uint32_t>(num_kv_heads);
  }

  // cu_seqlens and seq_start point to memory of the backend's device.
  FOX_HOST_DEVICE SequenceView sequence(int64_t s) const {
    if (cu_seqlens != nullptr) {
      const int64_t begin = cu_seqlens[s], len = cu_seqlens[s + 1] - begin;
      return {0, begin, begin, len, len, 0};
    }
    int64_t len_k = seqlen_k;
    if (cache_seqlens != nullptr) {  // clamped: values are not checked under CUDA graph capture
      len_k = cache_seqlens[s] < seqlen_q ? seqlen_q : cache_seqlens[s];
      len_k = len_k > seqlen_k ? seqlen_k : len_k;
    }
    return {s, 0, 0, seqlen_q, len_k, seq_start != nullptr ? seq_start[s] : 0};
  }
};

struct BackwardParams : ForwardParams {
  const void* dout = nullptr;  // same layout rules as q
  int64_t do_batch_stride = 0, do_row_stride = 0, do_head_stride = 0;
  void* dq = nullptr;          // same strides as described below
  void* dk = nullptr;
  void* dv = nullptr;
  void* dlog_fgate = nullptr;  // dtype of log_fgate
  int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;
  int64_t dg_batch_stride = 0, dg_row_stride = 0, dg_head_stride = 0;
};

}  // namespace fox
