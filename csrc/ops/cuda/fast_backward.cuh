// Tensor-core backward of Forgetting Attention for head dim 64 / 128 in fp16 / bf16 (mma.sync
// m16n8k16, sm_80+). Deterministic: no atomics, every output element has exactly one writer.
//
//   dkdv_kernel: one block per (sequence, kv head, 64-key tile). Each of its 4 warps owns 16 keys
//     and computes the transposed tiles S^T = K Q^T and dP^T = V dO^T, so that dV += P^T dO and
//     dK += dS^T Q accumulate in its registers; it loops over the heads of the GQA group and the
//     64-query tiles upwards from the diagonal (stopping at the first pruned tile). Column sums of
//     dS (dc = -colsum) are row sums of its dS^T.
//   dq_kernel: one block per (sequence, head, 64-query tile), like the forward: S = Q K^T,
//     dP = dO V^T, dQ += dS K, walking key tiles downwards from the diagonal; also writes the row
//     sums of dS (see BackwardWorkspace::dq_rowsum).
// The delta and gate-gradient kernels are the generic ones.
#pragma once

#include "common.cuh"
#include "fast_forward.cuh"
#include "generic_kernels.cuh"
#include "launch.h"
#include "mma.cuh"

namespace fox::cuda::fast {

// A fragments (16 rows x kHeadDim) of rows [row0, row0 + 16) of a swizzled tile, k-step ks.
template <int kHeadDim>
__device__ __forceinline__ void load_a_fragment(uint32_t (&frag)[4], const void* tile, int row0,
                                                int ks, int lane) {
  const int row = row0 + (lane & 15);
  ldmatrix_x4(frag, static_cast<const uint16_t*>(tile) + swizzled<kHeadDim>(row, ks * 2 + (lane >> 4)));
}

// acc (16 x 64) += A (16 rows of tile_a from row0) * B^T, B = the 64 rows of tile_b (both
// kHeadDim wide): scores of 16 rows against 64 columns.
template <typename T, int kHeadDim>
__device__ __forceinline__ void mma_rows_by_tile(float (&acc)[8][4], const T* tile_a, int row0,
                                                 const T* tile_b, int lane) {
  using Mma = MmaTraits<T>;
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    uint32_t a[4];
    load_a_fragment<kHeadDim>(a, tile_a, row0, ks, lane);
#pragma unroll
    for (int n2 = 0; n2 < 4; ++n2) {
      uint32_t b[4];
      const int row = n2 * 16 + (lane & 7) + ((lane >> 4) << 3);
      ldmatrix_x4(b, tile_b + swizzled<kHeadDim>(row, ks * 2 + ((lane >> 3) & 1)));
      Mma::mma(acc[2 * n2], a, b[0], b[1]);
      Mma::mma(acc[2 * n2 + 1], a, b[2], b[3]);
    }
  }
}

// out (16 x kHeadDim) += P (16 x 64, C fragments) * tile (64 rows x kHeadDim).
template <typename T, int kHeadDim>
__device__ __forceinline__ void mma_probs_by_tile(float (&out)[kHeadDim / 8][4],
                                                  const float (&probs)[8][4], const T* tile,
                                                  int lane) {
  using Mma = MmaTraits<T>;
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    uint32_t a[4];
    a[0] = Mma::pack(probs[2 * ks][0], probs[2 * ks][1]);
    a[1] = Mma::pack(probs[2 * ks][2], probs[2 * ks][3]);
    a[2] = Mma::pack(probs[2 * ks + 1][0], probs[2 * ks + 1][1]);
    a[3] = Mma::pack(probs[2 * ks + 1][2], probs[2 * ks + 1][3]);
#pragma unroll
    for (int n2 = 0; n2 < kHeadDim / 16; ++n2) {
      uint32_t b[4];
      const int row = ks * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
      ldmatrix_x4_trans(b, tile + swizzled<kHeadDim>(row, n2 * 2 + (lane >> 4)));
      Mma::mma(out[2 * n2], a, b[0], b[1]);
      Mma::mma(out[2 * n2 + 1], a, b[2], b[3]);
    }
  }
}

template <typename T, int kHeadDim>
__device__ __forceinline__ void store_rows(T* base, int64_t row_stride, int row, int nrows,
                                           const float (&acc)[kHeadDim / 8][4], float scale,
                                           int lane) {
  using Mma = MmaTraits<T>;
  const int group = lane >> 2, quad = lane & 3;
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    const int r = row + group + 8 * hi;
    if (r >= nrows) continue;
    T* out = base + r * row_stride;
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n)
      *reinterpret_cast<uint32_t*>(out + n * 8 + quad * 2) =
          Mma::pack(acc[n][2 * hi] * scale, acc[n][2 * hi + 1] * scale);
  }
}

// Blocks per SM the backward kernels' register budget is sized for (bench/NOTES.md): 3 for head
// dim 64 (168 registers, <80 bytes of spills, +12% over 2 blocks of 255 registers); head dim 128
// keeps 255 registers (2 blocks; a cap for 3 spills over 1 KB).
#ifndef FOX_BWD_MIN_BLOCKS_64
#define FOX_BWD_MIN_BLOCKS_64 3
#endif
#ifndef FOX_BWD_MIN_BLOCKS_128
#define FOX_BWD_MIN_BLOCKS_128 1
#endif
template <int kHeadDim>
constexpr int kBackwardMinBlocks = kHeadDim <= 64 ? FOX_BWD_MIN_BLOCKS_64 : FOX_BWD_MIN_BLOCKS_128;

template <int kHeadDim>
struct BackwardSmem {
  static constexpr int kTileElems = 64 * kHeadDim;
  static constexpr size_t kBytesTiles = sizeof(uint16_t) * 4 * kTileElems;
  // per-warp R of keys and queries (64 each), lse2 and delta of the query tile
  static constexpr size_t kBytes = kBytesTiles + sizeof(float) * (kWarps * 128 + 128);
};

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreads, kBackwardMinBlocks<kHeadDim>)
    dkdv_kernel(const BackwardParams p, const BackwardWorkspace ws, int64_t num_tiles) {
  using Smem = BackwardSmem<kHeadDim>;
  constexpr int kDimTiles = kHeadDim / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* Ks = reinterpret_cast<T*>(smem_raw);
  T* Vs = Ks + Smem::kTileElems;
  T* Qs = Vs + Smem::kTileElems;
  T* dOs = Qs + Smem::kTileElems;
  float* warp_R = reinterpret_cast<float*>(smem_raw + Smem::kBytesTiles);
  float* lse2 = warp_R + kWarps * 128;
  float* delta = lse2 + 64;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group_id = lane >> 2, quad = lane & 3;
  float* Rk = warp_R + warp * 128;  // this warp's copy: R of the 64 keys, then of the 64 queries
  float* Rq = Rk + 64;

  const KeyTile kt = block_key_tile(p, num_tiles, kBlockN);
  const SequenceView s = kt.s;
  const int64_t hk = kt.hk, j0 = kt.j0;
  if (j0 >= s.len_k) return;
  const int nk = static_cast<int>(min64(kBlockN, s.len_k - j0));
  const int64_t anchor = j0 + nk - 1;
  const int64_t offset = s.len_k - s.len_q;
  const int64_t group = p.heads_per_kv_head();
  const float scale_log2 = static_cast<float>(p.scale) * kLog2e;
  const int key_lo = warp * 16 + group_id, key_hi = key_lo + 8;  // this thread's two keys

  {
    const HeadPointers<T> hp = head_pointers<T>(p, s, hk * group);
    async_load_tile<T, kHeadDim>(Ks, hp.k + j0 * hp.k_row, hp.k_row, nk);
    async_load_tile<T, kHeadDim>(Vs, hp.v + j0 * hp.v_row, hp.v_row, nk);
    cp_async_commit();
  }

  float dk[kDimTiles][4], dv[kDimTiles][4];
#pragma unroll
  for (int n = 0; n < kDimTiles; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.f;

  const int64_t qt_begin = max64(0, j0 - offset) / kBlockM;
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    const HeadPointers<T> hp = head_pointers<T>(p, s, h);
    const T* dout = static_cast<const T*>(p.dout) + s.batch_index * p.do_batch_stride +
                    s.row_q * p.do_row_stride + h * p.do_head_stride;
    const float* lse_h = static_cast<const float*>(p.lse) + row_stat_offset(p, s, h);
    const float* delta_h = ws.delta + row_stat_offset(p, s, h);

    // R of the keys relative to the anchor (the last key): upper 32 first. The barrier: every
    // warp is done reading the previous head's Rk.
    __syncthreads();
    DownwardGateWalk<float> down;
    down.carry = 0.f;
    down.boundary = anchor;
#pragma unroll
    for (int half = 1; half >= 0; --half) Rk[32 * half + lane] = down.step(hp.g, hp.g_row, j0 + 32 * half, lane);
    __syncwarp();
    const float rk_lo = Rk[key_lo], rk_hi = Rk[key_hi];
    UpwardGateWalk<float> up;
    up.carry = 0.f;
    up.boundary = anchor;
    float colsum[2] = {0.f, 0.f};

    if (anchor >= s.first_key) {
      up.advance_to(hp.g, hp.g_row, qt_begin * kBlockM + offset - 1, lane);
      for (int64_t qt = qt_begin; qt * kBlockM < s.len_q; ++qt) {
        const int64_t i0 = qt * kBlockM, p0 = i0 + offset;
        const int nq = static_cast<int>(min64(kBlockM, s.len_q - i0));
        __syncthreads();  // every warp is done with the previous query tile's Rq
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int64_t pos = p0 + 32 * half + lane;
          float r = up.step(hp.g, hp.g_row, p0 + 32 * half, s.len_k, lane);
          if (pos <= anchor) r = pos >= j0 ? Rk[pos - j0] : 0.f;
          Rq[32 * half + lane] = r;
        }
        __syncwarp();
        // Largest bias of the pair: R at max(first query, last key) minus R at the last key (0).
        const float max_bias = p0 <= anchor ? 0.f : Rq[0];
        if (max_bias < p.prune_threshold) break;

        __syncthreads();  // the previous Q/dO tiles and lse/delta are no longer read
        async_load_tile<T, kHeadDim>(Qs, hp.q + i0 * hp.q_row, hp.q_row, nq);
        async_load_tile<T, kHeadDim>(dOs, dout + i0 * p.do_row_stride, p.do_row_stride, nq);
        cp_async_commit();
        if (threadIdx.x < 64) {
          const int c = threadIdx.x;
          lse2[c] = c < nq ? lse_h[i0 + c] * kLog2e : -INFINITY;
          delta[c] = c < nq ? delta_h[i0 + c] : 0.f;
        }
        cp_async_wait<0>();
        __syncthreads();

        float st[8][4], dpt[8][4];  // S^T and dP^T: this warp's 16 keys x 64 queries
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.f;
        mma_rows_by_tile<T, kHeadDim>(st, Ks, warp * 16, Qs, lane);
        mma_rows_by_tile<T, kHeadDim>(dpt, Vs, warp * 16, dOs, lane);

        const bool needs_mask = p0 < j0 + kBlockN - 1 || j0 < s.first_key || nq < kBlockM || nk < kBlockN;
#pragma unroll
        for (int n = 0; n < 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = n * 8 + quad * 2 + (e & 1);  // query
            const int hi = e >> 1;
            const int key = hi ? key_hi : key_lo;
            bool visible = true;
            if (needs_mask) {
              const int64_t j = j0 + key;
              visible = col < nq && key < nk && j >= s.first_key && j <= p0 + col;
            }
            const float prob =
                visible ? exp2f(st[n][e] * scale_log2 + (Rq[col] - (hi ? rk_hi : rk_lo)) * kLog2e - lse2[col])
                        : 0.f;
            const float ds = prob * (dpt[n][e] - delta[col]);
            st[n][e] = prob;
            dpt[n][e] = ds;
            colsum[hi] += ds;
          }
        }
        mma_probs_by_tile<T, kHeadDim>(dv, st, dOs, lane);
        mma_probs_by_tile<T, kHeadDim>(dk, dpt, Qs, lane);
      }
    }
    store_quad_colsums(key_stat(ws.dc, p, s, h, j0), key_lo, nk, colsum);  // dc = -colsum(dS)
  }
  cp_async_wait<0>();

  const KeyGradRows<T> out = key_grad_rows<T>(p, s, hk, j0);
  store_rows<T, kHeadDim>(out.dk, p.dk_row_stride, warp * 16, nk, dk, static_cast<float>(p.scale), lane);
  store_rows<T, kHeadDim>(out.dv, p.dv_row_stride, warp * 16, nk, dv, 1.f, lane);
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreads, kBackwardMinBlocks<kHeadDim>)
    dq_kernel(const BackwardParams p, const BackwardWorkspace ws, int64_t num_tiles) {
  using Smem = BackwardSmem<kHeadDim>;
  constexpr int kDimTiles = kHeadDim / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);
  T* dOs = Qs + Smem::kTileElems;
  T* Ks = dOs + Smem::kTileElems;
  T* Vs = Ks + Smem::kTileElems;
  float* warp_R = reinterpret_cast<float*>(smem_raw + Smem::kBytesTiles);
  float* Rq = warp_R + kWarps * 128;  // block-wide: R of the 64 queries

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group_id = lane >> 2, quad = lane & 3;
  float* Rk = warp_R + warp * 128;

  const QueryTile qt = block_query_tile(p, num_tiles, kBlockM);
  if (qt.nq == 0) return;
  const SequenceView s = qt.s;
  const int64_t h = qt.h, i0 = qt.i0, a = qt.a, L = qt.L;
  const int nq = qt.nq;
  const HeadPointers<T> hp = head_pointers<T>(p, s, h);
  const T* dout = static_cast<const T*>(p.dout) + s.batch_index * p.do_batch_stride +
                  (s.row_q + i0) * p.do_row_stride + h * p.do_head_stride;
  const float scale_log2 = static_cast<float>(p.scale) * kLog2e;

  async_load_tile<T, kHeadDim>(Qs, hp.q + i0 * hp.q_row, hp.q_row, nq);
  async_load_tile<T, kHeadDim>(dOs, dout, p.do_row_stride, nq);
  cp_async_commit();
  if (warp == 0) {
    float run = 0.f;
    Rq[lane] = query_tile_R(hp.g, hp.g_row, a, lane, nq, lane, run);
    Rq[lane + 32] = query_tile_R(hp.g, hp.g_row, a, lane + 32, nq, lane, run);
  }
  const int row_lo = warp * 16 + group_id, row_hi = row_lo + 8;
  const int64_t stat = row_stat_offset(p, s, h) + i0;
  // Rows past the tile's end get lse 0 (finite): they are computed and never written.
  const float lse2_lo = row_lo < nq ? static_cast<const float*>(p.lse)[stat + row_lo] * kLog2e : 0.f;
  const float lse2_hi = row_hi < nq ? static_cast<const float*>(p.lse)[stat + row_hi] * kLog2e : 0.f;
  const float delta_lo = row_lo < nq ? ws.delta[stat + row_lo] : 0.f;
  const float delta_hi = row_hi < nq ? ws.delta[stat + row_hi] : 0.f;
  __syncthreads();
  const float rq_lo = Rq[row_lo], rq_hi = Rq[row_hi];

  float dq[kDimTiles][4];
#pragma unroll
  for (int n = 0; n < kDimTiles; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.f;
  float rowsum[2] = {0.f, 0.f};

  DownwardGateWalk<float> walk;
  walk.carry = 0.f;
  walk.boundary = a;
  for (int64_t kt = L / kBlockN; kt >= s.first_key / kBlockN; --kt) {
    const int64_t j0 = kt * kBlockN;
    __syncthreads();  // every warp is done with the previous tile's Rk, K and V
#pragma unroll
    for (int half = 1; half >= 0; --half) {
      const int64_t jh = j0 + 32 * half;
      float r = walk.step(hp.g, hp.g_row, jh, lane);
      const int64_t j = jh + lane;
      if (j >= a) r = j <= L ? Rq[j - a] : 0.f;
      Rk[32 * half + lane] = r;  // every warp writes the same values: each reads its own
    }
    __syncwarp();
    if (-Rk[min64(j0 + kBlockN - 1, L) - j0] < p.prune_threshold) break;

    const int nk = static_cast<int>(min64(kBlockN, s.len_k - j0));
    async_load_tile<T, kHeadDim>(Ks, hp.k + j0 * hp.k_row, hp.k_row, nk);
    async_load_tile<T, kHeadDim>(Vs, hp.v + j0 * hp.v_row, hp.v_row, nk);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    float sc[8][4], dp[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[n][e] = dp[n][e] = 0.f;
    mma_rows_by_tile<T, kHeadDim>(sc, Qs, warp * 16, Ks, lane);
    mma_rows_by_tile<T, kHeadDim>(dp, dOs, warp * 16, Vs, lane);

    const bool needs_mask = j0 + kBlockN - 1 > a || j0 < s.first_key;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = n * 8 + quad * 2 + (e & 1);
        const int hi = e >> 1;
        bool visible = true;
        if (needs_mask) {
          const int64_t j = j0 + col;
          visible = j <= a + (hi ? row_hi : row_lo) && j >= s.first_key;
        }
        const float prob = visible ? exp2f(sc[n][e] * scale_log2 +
                                           ((hi ? rq_hi : rq_lo) - Rk[col]) * kLog2e -
                                           (hi ? lse2_hi : lse2_lo))
                                   : 0.f;
        const float ds = prob * (dp[n][e] - (hi ? delta_hi : delta_lo));
        sc[n][e] = ds;
        rowsum[hi] += ds;
      }
    }
    mma_probs_by_tile<T, kHeadDim>(dq, sc, Ks, lane);
  }
  cp_async_wait<0>();

#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    rowsum[hi] += __shfl_xor_sync(0xffffffffu, rowsum[hi], 1);
    rowsum[hi] += __shfl_xor_sync(0xffffffffu, rowsum[hi], 2);
    const int r = hi ? row_hi : row_lo;
    if (quad == 0 && r < nq) ws.dq_rowsum[stat + r] = rowsum[hi];
  }
  T* dq_base = static_cast<T*>(p.dq) + s.batch_index * p.dq_batch_stride +
               (s.row_q + i0) * p.dq_row_stride + h * p.dq_head_stride;
  store_rows<T, kHeadDim>(dq_base, p.dq_row_stride, warp * 16, nq, dq, static_cast<float>(p.scale), lane);
}

}  // namespace fox::cuda::fast

namespace fox::cuda {

template <typename T, int kHeadDim>
void run_fast_backward(const BackwardParams& p, const BackwardWorkspace& ws, int64_t max_len_q,
                       int64_t max_len_k, cudaStream_t stream) {
  using namespace fast;
  generic::launch_delta<T>(p, ws.delta, stream);
  constexpr size_t smem = BackwardSmem<kHeadDim>::kBytes;
  const int64_t k_tiles = (max_len_k + kBlockN - 1) / kBlockN;
  const int64_t kv_blocks = k_tiles * p.num_kv_heads * p.batch;
  if (kv_blocks > 0) {
    auto kernel = fast::dkdv_kernel<T, kHeadDim>;
    if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    kernel<<<static_cast<unsigned>(kv_blocks), kThreads, smem, stream>>>(p, ws, k_tiles);
  }
  const int64_t q_tiles = (max_len_q + kBlockM - 1) / kBlockM;
  const int64_t q_blocks = q_tiles * p.num_heads * p.batch;
  if (q_blocks > 0) {
    auto kernel = fast::dq_kernel<T, kHeadDim>;
    if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    kernel<<<static_cast<unsigned>(q_blocks), kThreads, smem, stream>>>(p, ws, q_tiles);
  }
  generic::launch_gate_grad(p, ws, max_len_k, stream);
}

}  // namespace fox::cuda
