// Device helpers shared by the CUDA kernels: element conversions, warp scans and reductions,
// per-(sequence, head) pointers and the tile-local gate sums. No ATen here: kernels see params.h.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../params.h"

namespace fox::cuda {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---- element conversions ----------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// ---- warp primitives --------------------------------------------------------------------------
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
// (xor butterflies give every lane the bitwise same result)
template <typename Acc>
__device__ __forceinline__ Acc warp_sum(Acc x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
// Inclusive prefix sum over lanes 0..lane.
template <typename Acc>
__device__ __forceinline__ Acc warp_inclusive_scan(Acc x, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const Acc y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  return x;
}
// Inclusive suffix sum over lanes lane..31.
template <typename Acc>
__device__ __forceinline__ Acc warp_inclusive_suffix_scan(Acc x, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const Acc y = __shfl_down_sync(0xffffffffu, x, o);
    if (lane + o < 32) x += y;
  }
  return x;
}

// Quotients in 32 bits of values that stay below 2^31 (block and item indices, rows of (sequence,
// head), heads: the grid's limit, check_grid): a 64-bit division is a routine of ~100
// instructions, and a chain of them took ~1400 cycles at the start of every block.
__device__ __forceinline__ int64_t quotient32(int64_t a, int64_t b) {
  return static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
}

// ---- where one (sequence, head) lives ----------------------------------------------------------
// The kv head that query head h reads (GQA).
__device__ __forceinline__ int64_t kv_head_of(const ForwardParams& p, int64_t h) {
  return quotient32(h, p.heads_per_kv_head());
}
template <typename T>
struct HeadPointers {
  const T* q;       // row i of the sequence at q + i * q_row
  const T* k;
  const T* v;
  const float* g;   // log f of position x at g + x * g_row
  int64_t q_row, k_row, v_row, g_row;
};

template <typename T>
__device__ __forceinline__ HeadPointers<T> head_pointers(const ForwardParams& p,
                                                         const SequenceView& s, int64_t h) {
  const int64_t hk = kv_head_of(p, h);
  HeadPointers<T> hp;
  hp.q = static_cast<const T*>(p.q) + s.batch_index * p.q_batch_stride + s.row_q * p.q_row_stride +
         h * p.q_head_stride;
  hp.k = static_cast<const T*>(p.k) + s.batch_index * p.k_batch_stride + s.row_k * p.k_row_stride +
         hk * p.k_head_stride;
  hp.v = static_cast<const T*>(p.v) + s.batch_index * p.v_batch_stride + s.row_k * p.v_row_stride +
         hk * p.v_head_stride;
  hp.g = static_cast<const float*>(p.log_fgate) + s.batch_index * p.g_batch_stride +
         s.row_k * p.g_row_stride + h * p.g_head_stride;
  hp.q_row = p.q_row_stride;
  hp.k_row = p.k_row_stride;
  hp.v_row = p.v_row_stride;
  hp.g_row = p.g_row_stride;
  return hp;
}

// Order of the blocks of a causal walk over (row = sequence * heads + head, tile). Rows are
// taken in sections of about section_bytes of walked tiles (K and V, or Q and dO), which stay in
// L2 while the section runs; inside a section the tiles of most work come first for every row
// (rank 0 = the longest walk), so that a section's short walks run beside the next section's long
// ones and the shortest walks of the last section make the tail. One row per section is the
// order of (row, tile), tile fastest. Blocks per key tile (dK/dV, walking query tiles): 8 MB at
// head dim 64 (on an H200 4 MB measured slower and 32 MB gained at one size only, bench/NOTES.md
// version 39), 16 MB at 128 in the Hopper kernel (key_block_section_bytes).
// Blocks per query tile (forward, dQ, walking key tiles): 16 MB, -1% to -2% forward time at head
// dim 64 against 8 MB and the same at 128 (version 91); both leave room in a 40 MB L2.
struct TileOrder {
  int64_t row = 0, rank = 0;
};
#ifndef FOX_SECTION_MIB_KEY_BLOCKS
#define FOX_SECTION_MIB_KEY_BLOCKS 8
#endif
#ifndef FOX_SECTION_MIB_QUERY_BLOCKS
#define FOX_SECTION_MIB_QUERY_BLOCKS 16
#endif
constexpr int64_t kSectionBytesKeyBlocks = int64_t{FOX_SECTION_MIB_KEY_BLOCKS} << 20;  // a block per key tile
constexpr int64_t kSectionBytesQueryBlocks = int64_t{FOX_SECTION_MIB_QUERY_BLOCKS} << 20;  // per query tile
// Rows of block_tile_order's sections, for the host (block_tile_order divides by quotient32: a
// 64-bit division at every block's start cost 1.6-2.9%, bench/NOTES.md version 59).
__host__ __device__ constexpr int64_t rows_per_section(int64_t rows, int64_t row_bytes, int64_t section_bytes) {
  const int64_t fitting = row_bytes > section_bytes ? 0 : section_bytes / (row_bytes > 1 ? row_bytes : 1);
  const int64_t per = rows < fitting ? rows : fitting;
  return per > 1 ? per : 1;
}
// Bytes a dK/dV block's row walks (Q and dO of every head of the group, at 2 bytes an element).
__host__ __device__ inline int64_t key_block_row_bytes(const ForwardParams& p) {
  return 4 * p.seqlen_q * p.head_dim * p.heads_per_kv_head();
}
// A section of the Hopper dK/dV kernel's blocks (128-key tiles, one block an SM): the same number
// of blocks at either head dim (8 MB of Q and dO at 64, 16 MB at 128: 256 blocks without GQA, two
// waves of 132 SMs). 8 MB at 128 too cost the D=128 backward 0.6-1.6% from N = 4k; 24 and 32 MB
// cost 3% and 15% at 2k (bench/NOTES.md, version 97). The portable kernel keeps 8 MB.
__host__ __device__ inline int64_t key_block_section_bytes(const ForwardParams& p) {
  return kSectionBytesKeyBlocks * (p.head_dim > 64 ? p.head_dim / 64 : 1);
}
__device__ __forceinline__ TileOrder block_tile_order(int64_t rows, int64_t num_tiles, int64_t row_bytes,
                                                      int64_t section_bytes, int64_t b = blockIdx.x) {
  const int64_t rows_fitting = row_bytes > section_bytes ? 0 : quotient32(section_bytes, max64(row_bytes, 1));
  const int64_t per_section = max64(1, min64(rows, rows_fitting));
  const int64_t section = quotient32(b, per_section * num_tiles), first_row = section * per_section;
  const int64_t in_section = b - first_row * num_tiles;
  const int64_t width = min64(per_section, rows - first_row);  // the last section may be narrower
  const int64_t rank = quotient32(in_section, width);
  return {first_row + in_section - rank * width, rank};
}

// The query tile a block owns (the longest causal rows first, block_tile_order), or item `index`
// of that order (query_tile_at: a persistent kernel's blocks walk several). Split-KV decoding
// (first_tile_only) enumerates (row, key chunk) instead, chunk fastest.
// nq == 0: the tile lies past the end of its sequence (a shorter one of a varlen batch).
struct QueryTile {
  SequenceView s;
  int64_t h = 0, i0 = 0;  // head, first query row
  int nq = 0;             // queries in the tile
  int64_t a = 0, L = 0;   // positions of its first and last query
};
__device__ __forceinline__ QueryTile query_tile(const ForwardParams& p, int64_t row, int64_t tile, int block_m) {
  QueryTile t;
  const int64_t sequence = quotient32(row, p.num_heads);
  t.h = row - sequence * p.num_heads;
  t.s = p.sequence(sequence);
  t.i0 = tile * block_m;
  if (t.i0 >= t.s.len_q) return t;
  t.nq = static_cast<int>(min64(block_m, t.s.len_q - t.i0));
  t.a = t.s.query_position(t.i0);
  t.L = t.a + t.nq - 1;
  return t;
}
__device__ __forceinline__ QueryTile query_tile_at(const ForwardParams& p, int64_t num_tiles, int block_m,
                                                   int64_t index) {
  const TileOrder o =
      block_tile_order(p.batch * p.num_heads, num_tiles, 4 * p.seqlen_k * p.head_dim, kSectionBytesQueryBlocks, index);
  return query_tile(p, o.row, num_tiles - 1 - o.rank, block_m);
}
__device__ __forceinline__ QueryTile block_query_tile(const ForwardParams& p, int64_t num_tiles, int block_m,
                                                      bool first_tile_only = false) {
  if (first_tile_only) return query_tile(p, blockIdx.x / num_tiles, 0, block_m);
  return query_tile_at(p, num_tiles, block_m, blockIdx.x);
}

// The key tile a dK/dV block owns: the first key tiles (seen by the most queries) first, or with
// `last_first` the last ones first (the fused backward in turns, its walks going up: a block only
// waits for the key tiles after its own, so these must start no later). From block `down_from` on
// (the last section, fused_down_from) `last_first` takes the first ones first again and the walks
// go down (`walk_down`): a block then waits only for the key tiles before its own, which started
// before it, and the grid no longer ends on the longest walks. Its walk covers the queries of every
// head of the kv head's group.
struct KeyTile {
  SequenceView s;
  int64_t hk = 0, j0 = 0;  // kv head, first key
  bool walk_down = false;
};
__device__ __forceinline__ KeyTile block_key_tile(const ForwardParams& p, int64_t num_tiles, int block_n,
                                                  bool last_first = false, int64_t down_from = INT64_MAX,
                                                  int64_t section_bytes = kSectionBytesKeyBlocks) {
  const TileOrder o = block_tile_order(p.batch * p.num_kv_heads, num_tiles, key_block_row_bytes(p),
                                       section_bytes);
  const bool down = last_first && static_cast<int64_t>(blockIdx.x) >= down_from;
  const int64_t tile = last_first && !down ? num_tiles - 1 - o.rank : o.rank;
  const int64_t sequence = quotient32(o.row, p.num_kv_heads);
  return {p.sequence(sequence), o.row - sequence * p.num_kv_heads, tile * block_n, down};
}

// Offset of (sequence, head, query row 0) in the (batch, heads, seqlen_q) float32 buffers lse/delta.
__device__ __forceinline__ int64_t row_stat_offset(const ForwardParams& p, const SequenceView& s,
                                                   int64_t h) {
  return (s.batch_index * p.num_heads + h) * p.seqlen_q + s.row_q;
}

// ---- tile-local gate sums ----------------------------------------------------------------------
// R_x = c_x - c_a for an anchor a, always computed by sums that start at a, so the error of the
// bias d_ij = R_{p_i} - R_j grows with the distance i - j and never with the absolute position.
// Acc is the type of R: float in the tensor-core kernels (far below bf16/fp16 noise), double in
// the generic kernels: within a 32-64 token tile |R| reaches ~600 for fast-forgetting heads, and
// one fp32 ulp of that (6e-5) in d_ij is above fp32 attention noise.

// Walks 32-key tiles downwards from an anchor a. `carry` holds R at `boundary` (a position <= a);
// keys below it get R_j = carry - sum_{l=j+1..boundary} g_l through a suffix scan of one warp.
template <typename Acc>
struct DownwardGateWalk {
  Acc carry = 0;          // R at `boundary`
  int64_t boundary = 0;   // every key >= boundary already has its R

  // R of key j = j0 + lane (j0 + 32 <= boundary + 32). Keys >= boundary are left to the caller
  // (they lie at or after the anchor); all lanes return the same updated carry.
  __device__ __forceinline__ Acc step(const float* g, int64_t g_row, int64_t j0, int lane) {
    const int64_t j = j0 + lane;
    const bool below = j < boundary;
    const Acc term = below ? static_cast<Acc>(g[(j + 1) * g_row]) : Acc(0);
    const Acc suffix = warp_inclusive_suffix_scan(term, lane);
    const Acc r = carry - suffix;
    const Acc total = __shfl_sync(0xffffffffu, suffix, 0);
    if (j0 < boundary) {
      carry -= total;
      boundary = j0;
    }
    return below ? r : Acc(0);
  }
};

// Walks 32-query tiles upwards from an anchor b (the last key of a key tile): `carry` holds R at
// `boundary` (>= b); positions after it get R_p = carry + sum_{l=boundary+1..p} g_l.
template <typename Acc>
struct UpwardGateWalk {
  Acc carry = 0;
  int64_t boundary = 0;

  // Adds the gates of the positions (boundary, target] (the keys between a key tile and the first
  // query when seqlen_q < seqlen_k), 32 at a time, from the anchor upwards.
  __device__ __forceinline__ void advance_to(const float* g, int64_t g_row, int64_t target,
                                             int lane) {
    while (boundary < target) {
      const int64_t pos = boundary + 1 + lane;
      const Acc term = pos <= target ? static_cast<Acc>(g[pos * g_row]) : Acc(0);
      carry += warp_sum(term);
      boundary = min64(boundary + 32, target);
    }
  }

  // R of position p = p0 + lane (valid when p > boundary, p < limit); returns 0 elsewhere.
  // Needs p0 <= boundary + 1 (contiguous walk).
  __device__ __forceinline__ Acc step(const float* g, int64_t g_row, int64_t p0, int64_t limit,
                                      int lane) {
    const int64_t pos = p0 + lane;
    const bool above = pos > boundary && pos < limit;
    const Acc term = above ? static_cast<Acc>(g[pos * g_row]) : Acc(0);
    const Acc prefix = warp_inclusive_scan(term, lane);
    const Acc r = carry + prefix;
    const int64_t last = min64(p0 + 31, limit - 1);
    if (last > boundary) {
      carry += __shfl_sync(0xffffffffu, prefix, 31);
      boundary = last;
    }
    return above ? r : Acc(0);
  }
};

// Query-tile R relative to its first position a: R_{a+r} = sum_{l=a+1..a+r} g_l, for r < n (one
// warp per 32 positions; `run` carries the sum of the previous 32-position chunks of the tile).
template <typename Acc>
__device__ __forceinline__ Acc query_tile_R(const float* g, int64_t g_row, int64_t a, int r, int n,
                                           int lane, Acc& run) {
  const Acc term = (r > 0 && r < n) ? static_cast<Acc>(g[(a + r) * g_row]) : Acc(0);
  const Acc prefix = warp_inclusive_scan(term, lane);
  const Acc out = run + prefix;
  run += __shfl_sync(0xffffffffu, prefix, 31);
  return out;
}

// ---- backward epilogues ------------------------------------------------------------------------
// Key row j0 of kv head hk in dK and dV.
template <typename T>
struct KeyGradRows {
  T* dk;
  T* dv;
};
template <typename T>
__device__ __forceinline__ KeyGradRows<T> key_grad_rows(const BackwardParams& p, const SequenceView& s,
                                                        int64_t hk, int64_t j0) {
  return {static_cast<T*>(p.dk) + s.batch_index * p.dk_batch_stride + (s.row_k + j0) * p.dk_row_stride +
              hk * p.dk_head_stride,
          static_cast<T*>(p.dv) + s.batch_index * p.dv_batch_stride + (s.row_k + j0) * p.dv_row_stride +
              hk * p.dv_head_stride};
}

// Entry of key j0 of head h in the (batch, num_heads, seqlen_k) float32 buffer dc.
__device__ __forceinline__ float* key_stat(float* buffer, const ForwardParams& p,
                                           const SequenceView& s, int64_t h, int64_t j0) {
  return buffer + (s.batch_index * p.num_heads + h) * p.seqlen_k + s.row_k + j0;
}

// Tensor-core layout (mma C fragments): the 4 threads of a quad hold parts of the column sums of
// dS for key rows key0 and key0 + 8. Sums them in a fixed order; the quad's first thread writes
// dc = -sum for the rows below nk.
__device__ __forceinline__ void store_quad_colsums(float* dc, int key0, int nk, float (&colsum)[2]) {
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    colsum[hi] += __shfl_xor_sync(0xffffffffu, colsum[hi], 1);
    colsum[hi] += __shfl_xor_sync(0xffffffffu, colsum[hi], 2);
    const int key = key0 + 8 * hi;
    if ((threadIdx.x & 3) == 0 && key < nk) dc[key] = -colsum[hi];
  }
}

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

}  // namespace fox::cuda
