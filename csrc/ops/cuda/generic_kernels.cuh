// Portable CUDA kernels of Forgetting Attention: any head dim in [1, 256], fp16/bf16/fp32 inputs,
// fp32 arithmetic on CUDA cores. They define the reference behaviour of the CUDA backend (every
// feature: GQA, cu_seqlens, seq_start, Tq < Tk, strides, pruning, split-KV decoding); the
// tensor-core paths specialise the forward for common head dims.
//
// Tiles are 32 queries x 32 keys, aligned to multiples of 32 within each sequence, so the forward,
// dQ and dK/dV passes prune exactly the same (query tile, key tile) pairs. A block has 4 warps;
// warp w owns the rows w, w+4, ..., w+28 of a tile and lane c its key column c, so the softmax
// statistics of a row live in one warp. Head-dim loops run over lane + 32*m (m < 8) so register
// arrays keep compile-time indices for any runtime head dim.
//
// Scores are kept in the log2 domain (exp2 is one instruction): s2 = log2e * (scale q.k + d).
// Gate sums R are doubles here (see common.cuh); d_ij is rounded to float once, after the
// subtraction.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common.cuh"
#include "launch.h"

namespace fox::cuda::generic {

constexpr int kTile = 32;          // queries per query tile == keys per key tile == warp size
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerWarp = kTile / kWarps;  // 8
constexpr int kMaxDimChunks = 8;              // head_dim <= 256 = 8 * 32

// Row stride (in floats) of a tile in shared memory: odd, so that 32 lanes reading one column of
// 32 different rows hit 32 different banks.
__host__ __device__ inline int padded_ld(int D) { return D | 1; }

// Copies rows [0, rows) of a (32, D) tile to shared memory as float; rows >= `rows` become zero so
// that products with masked (zero) probabilities stay finite.
template <typename T>
__device__ __forceinline__ void load_tile(float* dst, int ld, const T* src, int64_t src_row,
                                          int rows, int D) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorizable = D % kVec == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                            (src_row * static_cast<int64_t>(sizeof(T))) % 16 == 0;
  if (vectorizable) {
    const int vecs_per_row = D / kVec;
    for (int idx = threadIdx.x; idx < kTile * vecs_per_row; idx += kThreads) {
      const int r = idx / vecs_per_row, d = (idx - r * vecs_per_row) * kVec;
      float* out = dst + r * ld + d;
      if (r < rows) {
        const uint4 raw = *reinterpret_cast<const uint4*>(src + r * src_row + d);
        const T* x = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int e = 0; e < kVec; ++e) out[e] = to_float(x[e]);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) out[e] = 0.f;
      }
    }
  } else {
    for (int idx = threadIdx.x; idx < kTile * D; idx += kThreads) {
      const int r = idx / D, d = idx - r * D;
      dst[r * ld + d] = r < rows ? to_float(src[r * src_row + d]) : 0.f;
    }
  }
}

// Which (sequence, head, tile) a block of a 1-D grid handles: x = tile + tiles * (head + H * seq).
struct BlockCoords {
  int64_t tile, head, seq;
};
__device__ __forceinline__ BlockCoords block_coords(int64_t tiles, int64_t heads) {
  const int64_t b = blockIdx.x;
  return {b % tiles, (b / tiles) % heads, b / (tiles * heads)};
}

// R of the 32 keys of key tile [j0, j0+32) for a query tile anchored at a with last position L:
// keys >= a take the query tile's own R, keys below continue the downward walk.
using GateAcc = double;

__device__ __forceinline__ GateAcc key_tile_R(DownwardGateWalk<GateAcc>& walk, const float* g,
                                              int64_t g_row, int64_t j0, int64_t a, int64_t L,
                                              const GateAcc* Rq, int lane) {
  GateAcc rk = walk.step(g, g_row, j0, lane);
  const int64_t j = j0 + lane;
  if (j >= a) rk = j <= L ? Rq[j - a] : GateAcc(0);
  return rk;
}

// Shared memory of the generic kernels: R of the 32 queries (doubles) first, then float tiles.
struct GenericSmem {
  GateAcc* Rq;
  float* floats;
  __device__ __forceinline__ GenericSmem(unsigned char* raw)
      : Rq(reinterpret_cast<GateAcc*>(raw)), floats(reinterpret_cast<float*>(raw + 32 * sizeof(GateAcc))) {}
};

// ---- forward ---------------------------------------------------------------------------------
// Grid: one block per (sequence, head, query tile), or with kSplit per (sequence, head, key chunk)
// for a single query tile. Without split, writes out (T) and lse (natural log); with split, the
// unnormalised-by-nothing partial out (fp32, already divided by its own sum) and log2-domain lse.
// acc[k][m] += sum_c rows(r, c) * tile(c, d) for the rows r = warp + kWarps * k of this warp and
// the columns d = lane + 32 * m: the P.V (forward) and dS.K (dQ) products of the generic kernels.
// rows is (kTile, kTile + 1) in shared memory, tile is (kTile, tile_ld).
__device__ __forceinline__ void accumulate_rows_times_tile(float (&acc)[kRowsPerWarp][kMaxDimChunks],
                                                           const float* rows, const float* tile,
                                                           int tile_ld, int nq, int D, int warp,
                                                           int lane) {
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int r = warp + kWarps * k;
    if (r >= nq) continue;
    const float* row = rows + r * (kTile + 1);
#pragma unroll
    for (int m = 0; m < kMaxDimChunks; ++m) {
      const int d = lane + 32 * m;
      if (d < D) {
        float sum = acc[k][m];
        for (int c = 0; c < kTile; ++c) sum += row[c] * tile[c * tile_ld + d];
        acc[k][m] = sum;
      }
    }
  }
}

template <typename T, bool kSplit>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const ForwardParams p, const SplitKVParams split, int64_t num_tiles) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const GenericSmem sm(smem_raw);
  const int D = static_cast<int>(p.head_dim), ld = padded_ld(D);
  GateAcc* Rq = sm.Rq;
  float* Qs = sm.floats;
  float* Ks = Qs + kTile * ld;
  float* Vs = Ks + kTile * ld;
  float* Ps = Vs + kTile * D;          // (32, 33)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const BlockCoords bc = block_coords(num_tiles, p.num_heads);
  const int64_t h = bc.head;
  const SequenceView s = p.sequence(bc.seq);
  const int64_t i0 = kSplit ? 0 : bc.tile * kTile;
  if (i0 >= s.len_q) return;
  const int nq = static_cast<int>(min64(kTile, s.len_q - i0));
  const int64_t a = s.query_position(i0), L = a + nq - 1;
  const HeadPointers<T> hp = head_pointers<T>(p, s, h);
  const float scale_log2 = static_cast<float>(p.scale) * kLog2e;

  load_tile(Qs, ld, hp.q + i0 * hp.q_row, hp.q_row, nq, D);
  if (warp == 0) {
    GateAcc run = 0;
    Rq[lane] = query_tile_R(hp.g, hp.g_row, a, lane, nq, lane, run);
  }
  __syncthreads();

  // Key tiles from the diagonal down to the one holding first_key; a split handles one chunk.
  int64_t kt_hi = L / kTile;
  const int64_t kt_lo_all = s.first_key / kTile;
  int64_t kt_lo = kt_lo_all;
  DownwardGateWalk<GateAcc> walk;
  walk.carry = 0;
  walk.boundary = a;
  if constexpr (kSplit) {
    const int64_t chunk = bc.tile;
    const int64_t chunk_top = min64(kt_hi, (chunk + 1) * split.tiles_per_split - 1);
    kt_lo = max64(kt_lo_all, chunk * split.tiles_per_split);
    kt_hi = chunk_top;
    const int64_t top_boundary = (chunk_top + 1) * kTile;
    if (top_boundary < a) {
      walk.boundary = top_boundary;
      walk.carry = split.carry[(bc.seq * p.num_heads + h) * split.num_splits + chunk];
    }
  }

  float o[kRowsPerWarp][kMaxDimChunks];
  float row_max[kRowsPerWarp], row_sum[kRowsPerWarp];
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    row_max[k] = -INFINITY;
    row_sum[k] = 0.f;
#pragma unroll
    for (int m = 0; m < kMaxDimChunks; ++m) o[k][m] = 0.f;
  }

  for (int64_t kt = kt_hi; kt >= kt_lo; --kt) {
    const int64_t j0 = kt * kTile;
    const GateAcc rk = key_tile_R(walk, hp.g, hp.g_row, j0, a, L, Rq, lane);
    // Largest bias of the pair: first query (R = 0) against the last visible key. Lower tiles
    // only have smaller biases: the rest of the row is pruned too. Every warp agrees.
    const GateAcc r_last = __shfl_sync(0xffffffffu, rk, static_cast<int>(min64(j0 + 31, L) - j0));
    if (-r_last < p.prune_threshold) break;

    const int nk = static_cast<int>(min64(kTile, s.len_k - j0));
    __syncthreads();  // the previous tile's K/V are no longer read
    load_tile(Ks, ld, hp.k + j0 * hp.k_row, hp.k_row, nk, D);
    load_tile(Vs, D, hp.v + j0 * hp.v_row, hp.v_row, nk, D);
    __syncthreads();

    float acc[kRowsPerWarp];
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k) acc[k] = 0.f;
    if (nq == kTile) {
      for (int d = 0; d < D; ++d) {
        const float kd = Ks[lane * ld + d];
#pragma unroll
        for (int k = 0; k < kRowsPerWarp; ++k) acc[k] += Qs[(warp + kWarps * k) * ld + d] * kd;
      }
    } else {  // a partial tile (decoding: often 1 row): skip the rows that do not exist
#pragma unroll
      for (int k = 0; k < kRowsPerWarp; ++k) {
        const int r = warp + kWarps * k;
        if (r >= nq) continue;
        float sum = 0.f;
        for (int d = 0; d < D; ++d) sum += Qs[r * ld + d] * Ks[lane * ld + d];
        acc[k] = sum;
      }
    }
    const int64_t j = j0 + lane;
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k) {
      const int r = warp + kWarps * k;
      const bool visible = r < nq && j >= s.first_key && j <= a + r;
      const float s2 =
          visible ? acc[k] * scale_log2 + static_cast<float>(Rq[r] - rk) * kLog2e : -INFINITY;
      const float new_max = fmaxf(row_max[k], warp_max(s2));
      float prob = 0.f, correction = 1.f;
      if (new_max != -INFINITY) {  // uniform across the warp
        prob = exp2f(s2 - new_max);
        correction = exp2f(row_max[k] - new_max);
        row_sum[k] = row_sum[k] * correction + warp_sum(prob);
        row_max[k] = new_max;
      }
      Ps[r * (kTile + 1) + lane] = prob;
#pragma unroll
      for (int m = 0; m < kMaxDimChunks; ++m) o[k][m] *= correction;
    }
    __syncwarp();
    accumulate_rows_times_tile(o, Ps, Vs, D, nq, D, warp, lane);
    __syncwarp();
  }

#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int r = warp + kWarps * k;
    if (r >= nq) continue;
    const bool empty = row_sum[k] == 0.f;
    const float inv = empty ? 0.f : 1.f / row_sum[k];
    const float lse2 = empty ? -INFINITY : row_max[k] + log2f(row_sum[k]);
    if constexpr (kSplit) {
      const int64_t row = s.batch_index * p.seqlen_q + s.row_q + i0 + r;
      const int64_t base = (bc.tile * p.num_heads + h) * split.total_rows + row;
      float* out = split.out_partial + base * D;
#pragma unroll
      for (int m = 0; m < kMaxDimChunks; ++m) {
        const int d = lane + 32 * m;
        if (d < D) out[d] = o[k][m] * inv;
      }
      if (lane == 0) split.lse_partial[base] = lse2;
    } else {
      T* out = static_cast<T*>(p.out) + s.batch_index * p.o_batch_stride +
               (s.row_q + i0 + r) * p.o_row_stride + h * p.o_head_stride;
#pragma unroll
      for (int m = 0; m < kMaxDimChunks; ++m) {
        const int d = lane + 32 * m;
        if (d < D) out[d] = from_float<T>(o[k][m] * inv);
      }
      if (lane == 0) static_cast<float*>(p.lse)[row_stat_offset(p, s, h) + i0 + r] = lse2 * kLn2;
    }
  }
}

// ---- split-KV helpers ----------------------------------------------------------------------------
// For each (sequence, head) and chunk c: R at the chunk's top boundary B_c = (c+1) * chunk_len
// relative to the anchor a (the first query), i.e. -(sum of g over (B_c, a]). Whole-chunk sums
// are added from the anchor downwards, so the error grows with the distance only.
static __global__ void __launch_bounds__(256)
    split_carry_kernel(const ForwardParams p, const SplitKVParams split) {
  __shared__ float chunk_sum[1024];
  const int64_t h = blockIdx.x % p.num_heads, seq = blockIdx.x / p.num_heads;
  const SequenceView s = p.sequence(seq);
  if (s.len_q == 0) return;
  const int64_t a = s.query_position(0);
  const int64_t chunk_len = split.tiles_per_split * split.key_tile;
  const float* g = static_cast<const float*>(p.log_fgate) + s.batch_index * p.g_batch_stride +
                   s.row_k * p.g_row_stride + h * p.g_head_stride;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // chunk_sum[c] = sum of g over (c * chunk_len, (c+1) * chunk_len] clipped to <= a.
  for (int c = warp; c < split.num_splits; c += 8) {
    const int64_t lo = c * chunk_len + 1, hi = min64((c + 1) * chunk_len, a);
    float sum = 0.f;
    for (int64_t x = lo + lane; x <= hi; x += 32) sum += g[x * p.g_row_stride];
    sum = warp_sum(sum);
    if (lane == 0) chunk_sum[c] = sum;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float* carry = split.carry + (seq * p.num_heads + h) * split.num_splits;
    float run = 0.f;  // -(sum of g over (B_c, a])
    for (int c = split.num_splits - 1; c >= 0; --c) {
      carry[c] = run;
      run -= chunk_sum[c];
    }
  }
}

// Merges the chunks of split-KV decoding: one block per (row, head). The chunks' weights are
// computed once into shared memory (the plan caps the chunks at 1024); reductions in a fixed order.
template <typename T>
__global__ void __launch_bounds__(128)
    split_combine_kernel(const ForwardParams p, const SplitKVParams split) {
  constexpr int kMaxSplits = 1024;
  __shared__ float weight[kMaxSplits];
  __shared__ float partial[4];
  const int64_t row = blockIdx.x / p.num_heads, h = blockIdx.x % p.num_heads;
  const int64_t b = row / p.seqlen_q, t = row % p.seqlen_q;
  const int D = static_cast<int>(p.head_dim);
  const int S = split.num_splits, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  auto slot = [&](int c) { return (c * p.num_heads + h) * split.total_rows + row; };
  // block-wide max / sum: xor butterflies in each warp, then the 4 warps in order
  auto block_reduce = [&](float x, bool is_max) {
    x = is_max ? warp_max(x) : warp_sum(x);
    __syncthreads();  // `partial` is free again
    if (lane == 0) partial[warp] = x;
    __syncthreads();
    x = partial[0];
    for (int w = 1; w < 4; ++w) x = is_max ? fmaxf(x, partial[w]) : x + partial[w];
    return x;
  };
  float m = -INFINITY;
  for (int c = threadIdx.x; c < S; c += blockDim.x) {
    weight[c] = split.lse_partial[slot(c)];
    m = fmaxf(m, weight[c]);
  }
  const float max_lse = block_reduce(m, true);
  float sum = 0.f;
  for (int c = threadIdx.x; c < S; c += blockDim.x) {
    weight[c] = max_lse == -INFINITY ? 0.f : exp2f(weight[c] - max_lse);
    sum += weight[c];
  }
  const float total = block_reduce(sum, false);  // (its barriers publish `weight` too)
  T* out = static_cast<T*>(p.out) + b * p.o_batch_stride + t * p.o_row_stride + h * p.o_head_stride;
  const float inv = total > 0.f ? 1.f / total : 0.f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.f;
#pragma unroll 8
    for (int c = 0; c < S; ++c)
      if (weight[c] > 0.f) acc += weight[c] * split.out_partial[slot(c) * D + d];
    out[d] = from_float<T>(acc * inv);
  }
  if (threadIdx.x == 0)
    static_cast<float*>(p.lse)[(b * p.num_heads + h) * p.seqlen_q + t] =
        total > 0.f ? (max_lse + log2f(total)) * kLn2 : -INFINITY;
}

// ---- backward ------------------------------------------------------------------------------------

// delta_i = dO_i . O_i for every (row, head). kVec elements per load: 16-byte loads (kVec =
// 16 / sizeof(T)) where both tensors allow them, a group of lanes per row (one warp per row left
// 3/4 of the lanes idle at head dim 64, and took 5x the time of reading the two tensors), else
// one element per lane and one warp per row.
template <typename T, int kVec>
__global__ void __launch_bounds__(256)
    delta_kernel(const BackwardParams p, float* delta, int64_t total_rows, int lanes_per_row) {
  const int lane = threadIdx.x & 31;
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t task = w * (32 / lanes_per_row) + lane / lanes_per_row;  // (row, head)
  const int sub = lane % lanes_per_row;
  const bool valid = task < total_rows * p.num_heads;
  const int64_t row = valid ? task / p.num_heads : 0, h = valid ? task % p.num_heads : 0;
  const int64_t b = row / p.seqlen_q, t = row % p.seqlen_q;
  const T* o = static_cast<const T*>(p.out) + b * p.o_batch_stride + t * p.o_row_stride + h * p.o_head_stride;
  const T* dout = static_cast<const T*>(p.dout) + b * p.do_batch_stride + t * p.do_row_stride +
                  h * p.do_head_stride;
  float sum = 0.f;
  for (int d = sub * kVec; valid && d < p.head_dim; d += lanes_per_row * kVec) {
    if constexpr (kVec == 1) {
      sum += to_float(o[d]) * to_float(dout[d]);
    } else {
      const uint4 ro = *reinterpret_cast<const uint4*>(o + d), rd = *reinterpret_cast<const uint4*>(dout + d);
      const T* xo = reinterpret_cast<const T*>(&ro);
      const T* xd = reinterpret_cast<const T*>(&rd);
#pragma unroll
      for (int e = 0; e < kVec; ++e) sum += to_float(xo[e]) * to_float(xd[e]);
    }
  }
  for (int offset = lanes_per_row / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (valid && sub == 0) delta[(b * p.num_heads + h) * p.seqlen_q + t] = sum;
}

// Launches delta_kernel over every row (the first step of each backward).
template <typename T>
void launch_delta(const BackwardParams& p, float* delta, cudaStream_t stream) {
  const int64_t total_rows = (p.cu_seqlens ? 1 : p.batch) * p.seqlen_q;
  const int64_t tasks = total_rows * p.num_heads;
  if (tasks == 0) return;
  constexpr int kVec = 16 / sizeof(T);
  auto aligned = [](const void* ptr, int64_t row, int64_t head, int64_t batch) {
    return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && row % kVec == 0 && head % kVec == 0 &&
           batch % kVec == 0;
  };
  const bool vectorized = p.head_dim % kVec == 0 &&
                          aligned(p.out, p.o_row_stride, p.o_head_stride, p.o_batch_stride) &&
                          aligned(p.dout, p.do_row_stride, p.do_head_stride, p.do_batch_stride);
  int lanes = 32;
  if (vectorized)
    while (lanes > 1 && (lanes / 2) * kVec >= p.head_dim) lanes /= 2;  // fewest lanes covering a row
  const int64_t warps = (tasks + 32 / lanes - 1) / (32 / lanes);
  const auto blocks = static_cast<unsigned>((warps + 7) / 8);
  if (vectorized)
    delta_kernel<T, kVec><<<blocks, 256, 0, stream>>>(p, delta, total_rows, lanes);
  else
    delta_kernel<T, 1><<<blocks, 256, 0, stream>>>(p, delta, total_rows, 32);
}

// P and dS of row r / key column `lane` of one tile pair (zero where masked or the row is empty).
struct ProbAndDScore {
  float p, ds;
};
__device__ __forceinline__ ProbAndDScore prob_and_dscore(bool visible, float qk, float dp,
                                                         float scale_log2, float bias,
                                                         float lse2, float delta) {
  if (!visible || lse2 == -INFINITY) return {0.f, 0.f};
  const float prob = exp2f(qk * scale_log2 + bias * kLog2e - lse2);
  return {prob, prob * (dp - delta)};
}

// dK, dV and dc of one key tile for every head of its GQA group; anchored at the tile's last key.
// Walks query tiles upwards from the diagonal and stops at the first pruned one.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    dkdv_kernel(const BackwardParams p, const BackwardWorkspace ws, int64_t num_tiles) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const GenericSmem sm(smem_raw);
  const int D = static_cast<int>(p.head_dim), ld = padded_ld(D);
  GateAcc* Rq = sm.Rq;
  float* Ks = sm.floats;
  float* Vs = Ks + kTile * ld;
  float* Qs = Vs + kTile * ld;
  float* dOs = Qs + kTile * ld;
  float* Ps = dOs + kTile * ld;              // (32, 33)
  float* dSs = Ps + kTile * (kTile + 1);     // (32, 33)
  float* lse2 = dSs + kTile * (kTile + 1);
  float* delta = lse2 + kTile;
  float* colsum = delta + kTile;             // (4, 32)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const BlockCoords bc = block_coords(num_tiles, p.num_kv_heads);
  const int64_t hk = bc.head;
  const SequenceView s = p.sequence(bc.seq);
  const int64_t j0 = bc.tile * kTile;
  if (j0 >= s.len_k) return;
  const int nk = static_cast<int>(min64(kTile, s.len_k - j0));
  const int64_t anchor = j0 + nk - 1;
  const int64_t offset = s.len_k - s.len_q;
  const float scale_log2 = static_cast<float>(p.scale) * kLog2e;
  const int64_t group = p.heads_per_kv_head();

  {
    const HeadPointers<T> hp = head_pointers<T>(p, s, hk * group);
    load_tile(Ks, ld, hp.k + j0 * hp.k_row, hp.k_row, nk, D);
    load_tile(Vs, ld, hp.v + j0 * hp.v_row, hp.v_row, nk, D);
  }

  float dk[kRowsPerWarp][kMaxDimChunks], dv[kRowsPerWarp][kMaxDimChunks];
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k)
#pragma unroll
    for (int m = 0; m < kMaxDimChunks; ++m) dk[k][m] = dv[k][m] = 0.f;

  const int64_t qt_begin = max64(0, j0 - offset) / kTile;
  const int64_t j = j0 + lane;  // this lane's key
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    const HeadPointers<T> hp = head_pointers<T>(p, s, h);
    const T* dout = static_cast<const T*>(p.dout) + s.batch_index * p.do_batch_stride +
                    s.row_q * p.do_row_stride + h * p.do_head_stride;
    const float* lse_h = static_cast<const float*>(p.lse) + row_stat_offset(p, s, h);
    const float* delta_h = ws.delta + row_stat_offset(p, s, h);

    DownwardGateWalk<GateAcc> down;
    down.carry = 0;
    down.boundary = anchor;
    const GateAcc rk = down.step(hp.g, hp.g_row, j0, lane);  // R_j = c_j - c_anchor
    UpwardGateWalk<GateAcc> up;
    up.carry = 0;
    up.boundary = anchor;
    float col_dscore = 0.f;  // this thread's part of sum_i dS_{i j}

    if (anchor >= s.first_key) {
      up.advance_to(hp.g, hp.g_row, qt_begin * kTile + offset - 1, lane);
      for (int64_t qt = qt_begin; qt * kTile < s.len_q; ++qt) {
        const int64_t i0 = qt * kTile, p0 = i0 + offset;
        const int nq = static_cast<int>(min64(kTile, s.len_q - i0));
        GateAcc rq = up.step(hp.g, hp.g_row, p0, s.len_k, lane);
        const int64_t pos = p0 + lane;
        const GateAcc rk_at_pos = __shfl_sync(0xffffffffu, rk, static_cast<int>(min64(max64(pos - j0, 0), 31)));
        if (pos <= anchor) rq = pos >= j0 ? rk_at_pos : GateAcc(0);
        // Largest bias of the pair: R at max(first query, last key) minus R at the last key (0).
        const GateAcc max_bias = p0 <= anchor ? GateAcc(0) : __shfl_sync(0xffffffffu, rq, 0);
        if (max_bias < p.prune_threshold) break;

        __syncthreads();  // previous Q/dO/P/dS tiles are no longer read
        load_tile(Qs, ld, hp.q + i0 * hp.q_row, hp.q_row, nq, D);
        load_tile(dOs, ld, dout + i0 * p.do_row_stride, p.do_row_stride, nq, D);
        if (warp == 0) {
          Rq[lane] = rq;
          lse2[lane] = lane < nq ? lse_h[i0 + lane] * kLog2e : -INFINITY;
          delta[lane] = lane < nq ? delta_h[i0 + lane] : 0.f;
        }
        __syncthreads();

        float qk[kRowsPerWarp], dp[kRowsPerWarp];
#pragma unroll
        for (int k = 0; k < kRowsPerWarp; ++k) qk[k] = dp[k] = 0.f;
        for (int d = 0; d < D; ++d) {
          const float kd = Ks[lane * ld + d], vd = Vs[lane * ld + d];
#pragma unroll
          for (int k = 0; k < kRowsPerWarp; ++k) {
            const int r = warp + kWarps * k;
            qk[k] += Qs[r * ld + d] * kd;
            dp[k] += dOs[r * ld + d] * vd;
          }
        }
#pragma unroll
        for (int k = 0; k < kRowsPerWarp; ++k) {
          const int r = warp + kWarps * k;
          const bool visible = r < nq && lane < nk && j >= s.first_key && j <= p0 + r;
          const ProbAndDScore pd = prob_and_dscore(visible, qk[k], dp[k], scale_log2,
                                                   static_cast<float>(Rq[r] - rk), lse2[r], delta[r]);
          Ps[r * (kTile + 1) + lane] = pd.p;
          dSs[r * (kTile + 1) + lane] = pd.ds;
          col_dscore += pd.ds;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < kRowsPerWarp; ++k) {
          const int c = warp + kWarps * k;  // this warp's keys
#pragma unroll
          for (int m = 0; m < kMaxDimChunks; ++m) {
            const int d = lane + 32 * m;
            if (d < D) {
              float sv = dv[k][m], sk = dk[k][m];
              for (int r = 0; r < nq; ++r) {
                sv += Ps[r * (kTile + 1) + c] * dOs[r * ld + d];
                sk += dSs[r * (kTile + 1) + c] * Qs[r * ld + d];
              }
              dv[k][m] = sv;
              dk[k][m] = sk;
            }
          }
        }
      }
    }
    // dc_j = -sum_i dS_ij, the warps' partial sums added in a fixed order.
    colsum[warp * kTile + lane] = col_dscore;
    __syncthreads();
    if (warp == 0 && lane < nk) {
      const float total = colsum[lane] + colsum[kTile + lane] + colsum[2 * kTile + lane] +
                          colsum[3 * kTile + lane];
      key_stat(ws.dc, p, s, h, j0)[lane] = -total;
    }
    __syncthreads();
  }

  const float scale = static_cast<float>(p.scale);
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int c = warp + kWarps * k;
    if (c >= nk) continue;
    const KeyGradRows<T> row = key_grad_rows<T>(p, s, hk, j0 + c);
    T* dk_row = row.dk;
    T* dv_row = row.dv;
#pragma unroll
    for (int m = 0; m < kMaxDimChunks; ++m) {
      const int d = lane + 32 * m;
      if (d < D) {
        dk_row[d] = from_float<T>(dk[k][m] * scale);
        dv_row[d] = from_float<T>(dv[k][m]);
      }
    }
  }
}

// dQ of one query tile, walking key tiles from the diagonal downwards like the forward.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    dq_kernel(const BackwardParams p, const BackwardWorkspace ws, int64_t num_tiles) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const GenericSmem sm(smem_raw);
  const int D = static_cast<int>(p.head_dim), ld = padded_ld(D);
  GateAcc* Rq = sm.Rq;
  float* Qs = sm.floats;
  float* dOs = Qs + kTile * ld;
  float* Ks = dOs + kTile * ld;
  float* Vs = Ks + kTile * ld;
  float* dSs = Vs + kTile * ld;  // (32, 33)
  float* lse2 = dSs + kTile * (kTile + 1);
  float* delta = lse2 + kTile;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const BlockCoords bc = block_coords(num_tiles, p.num_heads);
  const int64_t h = bc.head;
  const SequenceView s = p.sequence(bc.seq);
  const int64_t i0 = bc.tile * kTile;
  if (i0 >= s.len_q) return;
  const int nq = static_cast<int>(min64(kTile, s.len_q - i0));
  const int64_t a = s.query_position(i0), L = a + nq - 1;
  const HeadPointers<T> hp = head_pointers<T>(p, s, h);
  const T* dout = static_cast<const T*>(p.dout) + s.batch_index * p.do_batch_stride +
                  (s.row_q + i0) * p.do_row_stride + h * p.do_head_stride;
  const float scale_log2 = static_cast<float>(p.scale) * kLog2e;

  load_tile(Qs, ld, hp.q + i0 * hp.q_row, hp.q_row, nq, D);
  load_tile(dOs, ld, dout, p.do_row_stride, nq, D);
  if (warp == 0) {
    GateAcc run = 0;
    Rq[lane] = query_tile_R(hp.g, hp.g_row, a, lane, nq, lane, run);
    const int64_t stat = row_stat_offset(p, s, h) + i0 + lane;
    lse2[lane] = lane < nq ? static_cast<const float*>(p.lse)[stat] * kLog2e : -INFINITY;
    delta[lane] = lane < nq ? ws.delta[stat] : 0.f;
  }
  __syncthreads();

  float dq[kRowsPerWarp][kMaxDimChunks], ds_rowsum[kRowsPerWarp];
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    ds_rowsum[k] = 0.f;
#pragma unroll
    for (int m = 0; m < kMaxDimChunks; ++m) dq[k][m] = 0.f;
  }

  DownwardGateWalk<GateAcc> walk;
  walk.carry = 0;
  walk.boundary = a;
  for (int64_t kt = L / kTile; kt >= s.first_key / kTile; --kt) {
    const int64_t j0 = kt * kTile;
    const GateAcc rk = key_tile_R(walk, hp.g, hp.g_row, j0, a, L, Rq, lane);
    const GateAcc r_last = __shfl_sync(0xffffffffu, rk, static_cast<int>(min64(j0 + 31, L) - j0));
    if (-r_last < p.prune_threshold) break;

    const int nk = static_cast<int>(min64(kTile, s.len_k - j0));
    __syncthreads();
    load_tile(Ks, ld, hp.k + j0 * hp.k_row, hp.k_row, nk, D);
    load_tile(Vs, ld, hp.v + j0 * hp.v_row, hp.v_row, nk, D);
    __syncthreads();

    float qk[kRowsPerWarp], dp[kRowsPerWarp];
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k) qk[k] = dp[k] = 0.f;
    for (int d = 0; d < D; ++d) {
      const float kd = Ks[lane * ld + d], vd = Vs[lane * ld + d];
#pragma unroll
      for (int k = 0; k < kRowsPerWarp; ++k) {
        const int r = warp + kWarps * k;
        qk[k] += Qs[r * ld + d] * kd;
        dp[k] += dOs[r * ld + d] * vd;
      }
    }
    const int64_t j = j0 + lane;
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k) {
      const int r = warp + kWarps * k;
      const bool visible = r < nq && j >= s.first_key && j <= a + r;
      const float ds = prob_and_dscore(visible, qk[k], dp[k], scale_log2,
                                       static_cast<float>(Rq[r] - rk), lse2[r], delta[r]).ds;
      dSs[r * (kTile + 1) + lane] = ds;
      ds_rowsum[k] += warp_sum(ds);
    }
    __syncwarp();
    accumulate_rows_times_tile(dq, dSs, Ks, ld, nq, D, warp, lane);
    __syncwarp();
  }

  const float scale = static_cast<float>(p.scale);
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int r = warp + kWarps * k;
    if (r >= nq) continue;
    if (lane == 0) ws.dq_rowsum[row_stat_offset(p, s, h) + i0 + r] = ds_rowsum[k];
    T* dq_row = static_cast<T*>(p.dq) + s.batch_index * p.dq_batch_stride +
                (s.row_q + i0 + r) * p.dq_row_stride + h * p.dq_head_stride;
#pragma unroll
    for (int m = 0; m < kMaxDimChunks; ++m) {
      const int d = lane + 32 * m;
      if (d < D) dq_row[d] = from_float<T>(dq[k][m] * scale);
    }
  }
}

// dlog_fgate_t = sum_{u >= t} dc_u within each sequence, dc_u = dc_row[u] + the row sum of dS of query
// u - offset, added up in double. One block per (sequence, head, chunk of whole pieces of kGatePiece
// positions), so that a batch of one long sequence still fills the GPU: a block first adds up every
// position after its chunk itself (no workspace and no order between blocks, so the same bits in every
// run; kGateMaxChunks bounds how often a position is read), then scans its chunk piece by piece from
// the end, each thread owning kGatePerThread consecutive positions (the warp's reads contiguous).
constexpr int kGateThreads = 256, kGateWarps = kGateThreads / 32, kGatePerThread = 4;
constexpr int64_t kGatePiece = kGateThreads * kGatePerThread, kGateMaxChunks = 64;

static __global__ void __launch_bounds__(kGateThreads)
    gate_grad_kernel(const BackwardParams p, const BackwardWorkspace ws, int64_t chunks) {
  __shared__ double warp_total[kGateWarps];
  const int64_t chunk = blockIdx.x % chunks, h = (blockIdx.x / chunks) % p.num_heads;
  const SequenceView s = p.sequence(blockIdx.x / (chunks * p.num_heads));
  const int64_t pieces_per_chunk = (s.len_k + kGatePiece * chunks - 1) / (kGatePiece * chunks);
  const int64_t lo = chunk * pieces_per_chunk * kGatePiece;
  if (lo >= s.len_k) return;
  const int64_t hi = min64(s.len_k, lo + pieces_per_chunk * kGatePiece);
  const float* dc_row = key_stat(ws.dc, p, s, h, 0);
  const float* rowsum = ws.dq_rowsum + row_stat_offset(p, s, h);
  const int64_t offset = s.len_k - s.len_q;  // key position t holds query t - offset
  auto dc_at = [&](int64_t t) {
    return static_cast<double>(dc_row[t]) + (t >= offset ? rowsum[t - offset] : 0.f);
  };
  float* dg = static_cast<float*>(p.dlog_fgate) + s.batch_index * p.dg_batch_stride +
              s.row_k * p.dg_row_stride + h * p.dg_head_stride;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  // Every position after the chunk: strided over the threads, summed in each warp (every lane gets
  // the same bits), then the warp totals from the last.
  double after = 0.0;
  for (int64_t t = hi + threadIdx.x; t < s.len_k; t += kGateThreads) after += dc_at(t);
  after = warp_sum(after);
  if (lane == 0) warp_total[warp] = after;
  __syncthreads();
  after = 0.0;
  for (int w = kGateWarps - 1; w >= 0; --w) after += warp_total[w];

  for (int64_t base = lo + (hi - lo - 1) / kGatePiece * kGatePiece; base >= lo; base -= kGatePiece) {
    const int64_t t0 = base + kGatePerThread * threadIdx.x;
    double suffix[kGatePerThread], run = 0.0;  // this thread's positions from the end
#pragma unroll
    for (int k = kGatePerThread - 1; k >= 0; --k) {
      run += t0 + k < hi ? dc_at(t0 + k) : 0.0;
      suffix[k] = run;
    }
    // The sums of this lane's and the later lanes' positions, then of the later lanes' alone.
    const double lanes = warp_inclusive_suffix_scan(run, lane);
    double later_lanes = __shfl_down_sync(0xffffffffu, lanes, 1);
    if (lane == 31) later_lanes = 0.0;
    __syncthreads();  // every thread has read warp_total (the previous piece)
    if (lane == 0) warp_total[warp] = lanes;
    __syncthreads();
    double rest = after;  // the positions after this piece, then after this warp in it
    for (int w = kGateWarps - 1; w > warp; --w) rest += warp_total[w];
    rest += later_lanes;
#pragma unroll
    for (int k = 0; k < kGatePerThread; ++k)
      if (t0 + k < hi) dg[(t0 + k) * p.dg_row_stride] = static_cast<float>(rest + suffix[k]);
    for (int w = kGateWarps - 1; w >= 0; --w) after += warp_total[w];
  }
}

// Launches gate_grad_kernel (the last step of each backward: the portable, Hopper and generic paths).
static inline void launch_gate_grad(const BackwardParams& p, const BackwardWorkspace& ws, int64_t max_len_k,
                                    cudaStream_t stream) {
  const int64_t chunks = std::max<int64_t>(1, std::min(kGateMaxChunks, (max_len_k + kGatePiece - 1) / kGatePiece));
  const int64_t blocks = p.batch * p.num_heads * chunks;
  if (blocks > 0) gate_grad_kernel<<<static_cast<unsigned>(blocks), kGateThreads, 0, stream>>>(p, ws, chunks);
}

// ---- launchers -----------------------------------------------------------------------------------

inline size_t forward_smem_bytes(int D) {
  return sizeof(GateAcc) * kTile +
         sizeof(float) * (2 * kTile * padded_ld(D) + kTile * D + kTile * (kTile + 1));
}
inline size_t dkdv_smem_bytes(int D) {
  return sizeof(GateAcc) * kTile +
         sizeof(float) * (4 * kTile * padded_ld(D) + 2 * kTile * (kTile + 1) + 2 * kTile + kWarps * kTile);
}
inline size_t dq_smem_bytes(int D) {
  return sizeof(GateAcc) * kTile +
         sizeof(float) * (4 * kTile * padded_ld(D) + kTile * (kTile + 1) + 2 * kTile);
}

template <typename Kernel>
inline void allow_smem(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

}  // namespace fox::cuda::generic

namespace fox::cuda {

template <typename T>
void run_generic_forward(const ForwardParams& p, int64_t max_len_q, cudaStream_t stream) {
  using namespace generic;
  const int64_t tiles = (max_len_q + kTile - 1) / kTile;
  const int64_t blocks = tiles * p.num_heads * p.batch;
  if (blocks == 0) return;
  const size_t smem = forward_smem_bytes(static_cast<int>(p.head_dim));
  auto kernel = forward_kernel<T, false>;
  allow_smem(kernel, smem);
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p, SplitKVParams{}, tiles);
}

template <typename T>
void run_split_kv_forward(const ForwardParams& p, const SplitKVParams& split, cudaStream_t stream) {
  using namespace generic;
  split_carry_kernel<<<static_cast<unsigned>(p.batch * p.num_heads), 256, 0, stream>>>(p, split);
  const size_t smem = forward_smem_bytes(static_cast<int>(p.head_dim));
  auto kernel = forward_kernel<T, true>;
  allow_smem(kernel, smem);
  const int64_t blocks = split.num_splits * p.num_heads * p.batch;
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p, split, split.num_splits);
  split_combine_kernel<T><<<static_cast<unsigned>(split.total_rows * p.num_heads), 128, 0, stream>>>(p, split);
}

template <typename T>
void run_generic_backward(const BackwardParams& p, const BackwardWorkspace& ws, int64_t max_len_q,
                          int64_t max_len_k, cudaStream_t stream) {
  using namespace generic;
  const int D = static_cast<int>(p.head_dim);
  launch_delta<T>(p, ws.delta, stream);

  const int64_t k_tiles = (max_len_k + kTile - 1) / kTile;
  const int64_t kv_blocks = k_tiles * p.num_kv_heads * p.batch;
  if (kv_blocks > 0) {
    auto kernel = dkdv_kernel<T>;
    allow_smem(kernel, dkdv_smem_bytes(D));
    kernel<<<static_cast<unsigned>(kv_blocks), kThreads, dkdv_smem_bytes(D), stream>>>(p, ws, k_tiles);
  }
  const int64_t q_tiles = (max_len_q + kTile - 1) / kTile;
  const int64_t q_blocks = q_tiles * p.num_heads * p.batch;
  if (q_blocks > 0) {
    auto kernel = dq_kernel<T>;
    allow_smem(kernel, dq_smem_bytes(D));
    kernel<<<static_cast<unsigned>(q_blocks), kThreads, dq_smem_bytes(D), stream>>>(p, ws, q_tiles);
  }
  launch_gate_grad(p, ws, max_len_k, stream);
}

}  // namespace fox::cuda
