// Tensor-core forward of Forgetting Attention for head dim 64 / 128 in fp16 / bf16
// (FlashAttention-2 structure on mma.sync m16n8k16, sm_80+).
//
// A block owns 64 queries of one (sequence, head); each of its 4 warps owns 16 query rows and
// keeps Q, the scores S and the output O in registers. Key tiles of 64 keys are walked from the
// diagonal downwards, double-buffered in shared memory by cp.async (rows are XOR-swizzled in 16-byte
// chunks so ldmatrix is conflict-free). The gate bias follows the generic kernels: R relative to
// the first query of the tile, built by sums that start there (common.cuh); every warp walks the
// gates itself (cheap) so that the pruning decision needs no barrier.
#pragma once

#include "common.cuh"
#include "generic_kernels.cuh"
#include "launch.h"
#include "mma.cuh"

namespace fox::cuda::fast {

constexpr int kBlockM = 64;
constexpr int kBlockN = 64;
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;

// Tuning knobs (compile-time; bench/NOTES.md has the measurements behind the defaults).
#ifndef FOX_FWD_MTILES_64
#define FOX_FWD_MTILES_64 1
#endif
#ifndef FOX_FWD_MTILES_128
#define FOX_FWD_MTILES_128 1
#endif
#ifndef FOX_FWD_Q_IN_REGISTERS_64
#define FOX_FWD_Q_IN_REGISTERS_64 1
#endif
// A forward block has 4 warps; each warp owns kForwardMTiles m-tiles of 16 query rows (rows
// 64 * mt + 16 * warp + 0..15), so every K/V fragment read from shared memory feeds kForwardMTiles
// mma (FlashAttention-2's layout): with one m-tile the kernel was bound by ldmatrix bandwidth.
template <int kHeadDim>
constexpr int kForwardWarps = 4;
template <int kHeadDim>
constexpr int kForwardMTiles = kHeadDim <= 64 ? FOX_FWD_MTILES_64 : FOX_FWD_MTILES_128;
// Q fragments stay in registers for head dim 64; for 128 they are re-read from shared memory
// (registers would not fit next to two m-tiles of O).
template <int kHeadDim>
constexpr bool kForwardQInRegisters =
    kHeadDim <= 64 ? FOX_FWD_Q_IN_REGISTERS_64 : kForwardMTiles<kHeadDim> == 1;

template <int kHeadDim>
struct SmemLayout {
  static constexpr int kWarpsF = kForwardWarps<kHeadDim>;
  static constexpr int kQRows = 16 * kWarpsF * kForwardMTiles<kHeadDim>;
  static constexpr int kTileElems = 64 * kHeadDim;  // one 64-row K or V tile
  // Q, then 2 stages of (K, V), in elements of 2 bytes; then per-warp R of the keys, R of queries.
  static constexpr int kK0 = kQRows * kHeadDim;
  static constexpr size_t kBytesTiles = sizeof(uint16_t) * (kK0 + 4 * kTileElems);
  static constexpr size_t kBytes = kBytesTiles + sizeof(float) * (kWarpsF * kBlockN + kQRows);
};

// Element offset of (row, 8-element chunk) in a swizzled 64 x kHeadDim tile.
template <int kHeadDim>
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * kHeadDim + ((chunk ^ (row & 7)) << 3);
}

// Copies rows [0, rows) of a 64 x kHeadDim tile (row stride `ld` elements) into shared memory;
// the other rows become zero.
template <typename T, int kHeadDim, int kRows = 64, int kNumThreads = kThreads>
__device__ __forceinline__ void async_load_tile(T* smem, const T* src, int64_t ld, int rows) {
  constexpr int kChunks = kHeadDim / 8;
#pragma unroll
  for (int i = 0; i < kRows * kChunks / kNumThreads; ++i) {
    const int idx = threadIdx.x + i * kNumThreads;
    const int row = idx / kChunks, chunk = idx % kChunks;
    const bool valid = row < rows;
    const T* g = src + (valid ? row : 0) * ld + chunk * 8;
    cp_async_16(smem + swizzled<kHeadDim>(row, chunk), g, valid);
  }
}

// kSplit: split-KV decoding (a single query tile; one block per (sequence, head, key chunk) writes
// a partial result in fp32 with its log2-domain lse, merged by generic::split_combine_kernel).
// Blocks per SM the register budget is sized for (more blocks hide more latency): 3 for head dim
// 64 (168 registers, no spills), 2 for 128 (255 registers; a cap for 3 spills ~180 bytes).
#ifndef FOX_FWD_MIN_BLOCKS_64
#define FOX_FWD_MIN_BLOCKS_64 3
#endif
#ifndef FOX_FWD_MIN_BLOCKS_128
#define FOX_FWD_MIN_BLOCKS_128 2
#endif
template <int kHeadDim>
constexpr int kForwardMinBlocks = kHeadDim <= 64 ? FOX_FWD_MIN_BLOCKS_64 : FOX_FWD_MIN_BLOCKS_128;
template <int kHeadDim>
constexpr int kForwardThreads = 32 * kForwardWarps<kHeadDim>;

template <typename T, int kHeadDim, bool kSplit>
__global__ void __launch_bounds__(kForwardThreads<kHeadDim>, kForwardMinBlocks<kHeadDim>)
    forward_kernel(const ForwardParams p, const SplitKVParams split, int64_t num_tiles) {
  using Layout = SmemLayout<kHeadDim>;
  constexpr int kWarpsF = Layout::kWarpsF, kThreadsF = 32 * kWarpsF, kBlockMF = Layout::kQRows;
  constexpr int kMT = kForwardMTiles<kHeadDim>;
  constexpr bool kQRegs = kForwardQInRegisters<kHeadDim>;
  using Mma = MmaTraits<T>;
  constexpr int kDimTiles = kHeadDim / 8;   // n-tiles of O
  constexpr int kDimSteps = kHeadDim / 16;  // k-steps of Q K^T
  constexpr int kKeyTiles = kBlockN / 8;    // n-tiles of S
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);
  T* KV = Qs + Layout::kK0;  // stage s: K at KV + 2s*tile, V at KV + (2s+1)*tile
  float* Rk_all = reinterpret_cast<float*>(smem_raw + Layout::kBytesTiles);
  float* Rq = Rk_all + kWarpsF * kBlockN;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group = lane >> 2, quad = lane & 3;
  float* Rk = Rk_all + warp * kBlockN;

  const int64_t b = blockIdx.x;  // (kSplit: b % num_tiles is the block's key chunk)
  const QueryTile qt = block_query_tile(p, num_tiles, kBlockMF, kSplit);
  if (qt.nq == 0) return;
  const SequenceView s = qt.s;
  const int64_t h = qt.h, i0 = qt.i0, a = qt.a, L = qt.L;
  const int nq = qt.nq;
  const HeadPointers<T> hp = head_pointers<T>(p, s, h);
  const float scale_log2 = static_cast<float>(p.scale) * kLog2e;
  auto mtile_row0 = [&](int mt) { return 64 * mt + 16 * warp; };
  // m-tiles of this warp that hold queries (decoding has one row: skip the empty ones' math)
  int live_mtiles = 0;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) live_mtiles += mtile_row0(mt) < nq;

  int64_t kt_hi = L / kBlockN, kt_lo = s.first_key / kBlockN;
  DownwardGateWalk<float> walk;
  walk.carry = 0.f;
  walk.boundary = a;
  if constexpr (kSplit) {  // this block's chunk of key tiles; R at its top comes precomputed
    const int64_t chunk = b % num_tiles;
    const int64_t chunk_top = min64(kt_hi, (chunk + 1) * split.tiles_per_split - 1);
    kt_lo = max64(kt_lo, chunk * split.tiles_per_split);
    kt_hi = chunk_top;
    const int64_t top_boundary = (chunk_top + 1) * kBlockN;
    if (top_boundary < a) {
      walk.boundary = top_boundary;
      walk.carry = split.carry[(b / num_tiles) * split.num_splits + chunk];  // b / num_tiles = seq * H + h
    }
  }
  async_load_tile<T, kHeadDim, kBlockMF, kThreadsF>(Qs, hp.q + i0 * hp.q_row, hp.q_row, nq);
  cp_async_commit();
  if (kt_hi >= kt_lo) {
    const int64_t j0 = kt_hi * kBlockN;
    const int nk = static_cast<int>(min64(kBlockN, s.len_k - j0));
    async_load_tile<T, kHeadDim, 64, kThreadsF>(KV, hp.k + j0 * hp.k_row, hp.k_row, nk);
    async_load_tile<T, kHeadDim, 64, kThreadsF>(KV + Layout::kTileElems, hp.v + j0 * hp.v_row, hp.v_row, nk);
  }
  cp_async_commit();  // (an empty group when the chunk has no tile: keeps the wait counts right)
  if (warp == 0) {
    float run = 0.f;
#pragma unroll
    for (int c = 0; c < kBlockMF / 32; ++c)
      Rq[32 * c + lane] = query_tile_R(hp.g, hp.g_row, a, 32 * c + lane, nq, lane, run);
  }
  cp_async_wait<1>();  // Q has landed
  __syncthreads();

  // Q fragments (head dim 64) and R of this thread's rows: row_of(mt, hi).
  uint32_t q_frag[kQRegs ? kMT : 1][kQRegs ? kDimSteps : 1][4];
  if constexpr (kQRegs) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int ks = 0; ks < kDimSteps; ++ks)
        ldmatrix_x4(q_frag[mt][ks],
                    Qs + swizzled<kHeadDim>(mtile_row0(mt) + (lane & 15), ks * 2 + (lane >> 4)));
  }
  auto row_of = [&](int mt, int hi) { return mtile_row0(mt) + group + 8 * hi; };
  float rq[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) rq[mt][hi] = Rq[row_of(mt, hi)] * kLog2e;

  float o[kMT][kDimTiles][4];
  float row_max[kMT][2], row_sum[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }

  for (int64_t kt = kt_hi, it = 0; kt >= kt_lo; --kt, ++it) {
    const int64_t j0 = kt * kBlockN;
    // Every warp is done with the previous tile (its Rk and the K/V stage prefetched below).
    __syncthreads();
    // R of the 64 keys (upper 32 first: the walk goes downwards), then the pruning test. Every
    // warp writes the same values and reads its own.
#pragma unroll
    for (int half = 1; half >= 0; --half) {
      const int64_t jh = j0 + 32 * half;
      float r = walk.step(hp.g, hp.g_row, jh, lane);
      const int64_t j = jh + lane;
      if (j >= a) r = j <= L ? Rq[j - a] : 0.f;
      Rk[32 * half + lane] = r * kLog2e;  // log2 domain from here on
    }
    __syncwarp();
    if (-Rk[min64(j0 + kBlockN - 1, L) - j0] < p.prune_threshold * kLog2e) break;

    const int stage = static_cast<int>(it & 1);
    const T* Ks = KV + (2 * stage) * Layout::kTileElems;
    const T* Vs = Ks + Layout::kTileElems;
    if (kt - 1 >= kt_lo) {  // prefetch the next tile into the other stage
      const int64_t jn = j0 - kBlockN;
      T* Kn = KV + (2 * (stage ^ 1)) * Layout::kTileElems;
      async_load_tile<T, kHeadDim, 64, kThreadsF>(Kn, hp.k + jn * hp.k_row, hp.k_row, kBlockN);
      async_load_tile<T, kHeadDim, 64, kThreadsF>(Kn + Layout::kTileElems, hp.v + jn * hp.v_row, hp.v_row, kBlockN);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    if (live_mtiles > 0) {
      // S = Q K^T for this warp's m-tiles x 64 keys; each K fragment feeds every m-tile.
      float sc[kMT][kKeyTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) sc[mt][n][0] = sc[mt][n][1] = sc[mt][n][2] = sc[mt][n][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < kDimSteps; ++ks) {
        uint32_t qa[kMT][4];
        if constexpr (!kQRegs) {
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt)
            if (mt < live_mtiles)
              ldmatrix_x4(qa[mt], Qs + swizzled<kHeadDim>(mtile_row0(mt) + (lane & 15), ks * 2 + (lane >> 4)));
        }
#pragma unroll
        for (int n2 = 0; n2 < kKeyTiles / 2; ++n2) {
          uint32_t kf[4];
          const int key = n2 * 16 + (lane & 7) + ((lane >> 4) << 3);
          ldmatrix_x4(kf, Ks + swizzled<kHeadDim>(key, ks * 2 + ((lane >> 3) & 1)));
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            if (mt >= live_mtiles) continue;
            const uint32_t(&qf)[4] = kQRegs ? q_frag[kQRegs ? mt : 0][kQRegs ? ks : 0] : qa[mt];
            Mma::mma(sc[mt][2 * n2], qf, kf[0], kf[1]);
            Mma::mma(sc[mt][2 * n2 + 1], qf, kf[2], kf[3]);
          }
        }
      }

      // Bias, masks (only near the diagonal or first_key) and the online softmax, log2 domain.
      const bool needs_mask = j0 + kBlockN - 1 > a || j0 < s.first_key;
      uint32_t p_frag[kMT][kKeyTiles / 2][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
          const float2 rk2 = *reinterpret_cast<const float2*>(Rk + n * 8 + quad * 2);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = n * 8 + quad * 2 + (e & 1);
            const int hi = e >> 1;
            float x = fmaf(sc[mt][n][e], scale_log2, rq[mt][hi] - ((e & 1) ? rk2.y : rk2.x));
            if (needs_mask) {
              const int64_t j = j0 + col;
              if (j > a + row_of(mt, hi) || j < s.first_key) x = -INFINITY;
            }
            sc[mt][n][e] = x;
            tile_max[hi] = fmaxf(tile_max[hi], x);
          }
        }
        float correction[2];
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
          float m = tile_max[hi];
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
          const float new_max = fmaxf(row_max[mt][hi], m);
          // A row that has seen no key yet keeps max -inf: subtract 0 instead (all its p are 0).
          const float base = new_max == -INFINITY ? 0.f : new_max;
          correction[hi] = exp2f(row_max[mt][hi] - base);
          row_max[mt][hi] = new_max;
          tile_max[hi] = base;
        }
        float tile_sum[2] = {0.f, 0.f};
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
          const float p0 = exp2f(sc[mt][n][0] - tile_max[0]), p1 = exp2f(sc[mt][n][1] - tile_max[0]);
          const float p2 = exp2f(sc[mt][n][2] - tile_max[1]), p3 = exp2f(sc[mt][n][3] - tile_max[1]);
          tile_sum[0] += p0 + p1;
          tile_sum[1] += p2 + p3;
          // C fragments of n-tiles 2k, 2k+1 form the A fragment of k-step k.
          p_frag[mt][n / 2][(n & 1) * 2 + 0] = Mma::pack(p0, p1);
          p_frag[mt][n / 2][(n & 1) * 2 + 1] = Mma::pack(p2, p3);
        }
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) row_sum[mt][hi] = row_sum[mt][hi] * correction[hi] + tile_sum[hi];
#pragma unroll
        for (int n = 0; n < kDimTiles; ++n) {
          o[mt][n][0] *= correction[0];
          o[mt][n][1] *= correction[0];
          o[mt][n][2] *= correction[1];
          o[mt][n][3] *= correction[1];
        }
      }

      // O += P V; each V fragment feeds every m-tile.
#pragma unroll
      for (int ks = 0; ks < kBlockN / 16; ++ks) {
#pragma unroll
        for (int n2 = 0; n2 < kDimTiles / 2; ++n2) {
          uint32_t vf[4];
          const int key = ks * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
          ldmatrix_x4_trans(vf, Vs + swizzled<kHeadDim>(key, n2 * 2 + (lane >> 4)));
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            if (mt >= live_mtiles) continue;
            Mma::mma(o[mt][2 * n2], p_frag[mt][ks], vf[0], vf[1]);
            Mma::mma(o[mt][2 * n2 + 1], p_frag[mt][ks], vf[2], vf[3]);
          }
        }
      }
    }
    __syncthreads();  // this stage may be overwritten by the next prefetch
  }
  cp_async_wait<0>();  // nothing may land in shared memory after the block is gone

#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    // The quad's partial row sums -> full sums; write O / sum and lse.
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      row_sum[mt][hi] += __shfl_xor_sync(0xffffffffu, row_sum[mt][hi], 1);
      row_sum[mt][hi] += __shfl_xor_sync(0xffffffffu, row_sum[mt][hi], 2);
    }
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int r = row_of(mt, hi);
      if (r >= nq) continue;
      const bool empty = row_sum[mt][hi] == 0.f;
      const float inv = empty ? 0.f : 1.f / row_sum[mt][hi];
      const float lse2 = empty ? -INFINITY : row_max[mt][hi] + log2f(row_sum[mt][hi]);
      if constexpr (kSplit) {
        const int64_t row = s.batch_index * p.seqlen_q + s.row_q + i0 + r;
        const int64_t base = ((b % num_tiles) * p.num_heads + h) * split.total_rows + row;
        float* out = split.out_partial + base * kHeadDim;
#pragma unroll
        for (int n = 0; n < kDimTiles; ++n)
          *reinterpret_cast<float2*>(out + n * 8 + quad * 2) =
              make_float2(o[mt][n][2 * hi] * inv, o[mt][n][2 * hi + 1] * inv);
        if (quad == 0) split.lse_partial[base] = lse2;
        continue;
      }
      T* out = static_cast<T*>(p.out) + s.batch_index * p.o_batch_stride +
               (s.row_q + i0 + r) * p.o_row_stride + h * p.o_head_stride;
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
        const uint32_t packed = Mma::pack(o[mt][n][2 * hi] * inv, o[mt][n][2 * hi + 1] * inv);
        *reinterpret_cast<uint32_t*>(out + n * 8 + quad * 2) = packed;
      }
      if (quad == 0) static_cast<float*>(p.lse)[row_stat_offset(p, s, h) + i0 + r] = lse2 * kLn2;
    }
  }
}

}  // namespace fox::cuda::fast

namespace fox::cuda {

template <typename T, int kHeadDim>
void run_fast_forward(const ForwardParams& p, int64_t max_len_q, cudaStream_t stream) {
  using namespace fast;
  constexpr int kBlockMF = SmemLayout<kHeadDim>::kQRows;
  const int64_t tiles = (max_len_q + kBlockMF - 1) / kBlockMF;
  const int64_t blocks = tiles * p.num_heads * p.batch;
  if (blocks == 0) return;
  constexpr size_t smem = SmemLayout<kHeadDim>::kBytes;
  auto kernel = forward_kernel<T, kHeadDim, false>;
  if (smem > 48 * 1024)
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  kernel<<<static_cast<unsigned>(blocks), kForwardThreads<kHeadDim>, smem, stream>>>(p, SplitKVParams{}, tiles);
}

template <typename T, int kHeadDim>
void run_fast_split_kv_forward(const ForwardParams& p, const SplitKVParams& split,
                               cudaStream_t stream) {
  using namespace fast;
  generic::split_carry_kernel<<<static_cast<unsigned>(p.batch * p.num_heads), 256, 0, stream>>>(p, split);
  constexpr size_t smem = SmemLayout<kHeadDim>::kBytes;
  auto kernel = forward_kernel<T, kHeadDim, true>;
  if (smem > 48 * 1024)
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  const int64_t blocks = split.num_splits * p.num_heads * p.batch;
  kernel<<<static_cast<unsigned>(blocks), kForwardThreads<kHeadDim>, smem, stream>>>(p, split, split.num_splits);
  generic::split_combine_kernel<T>
      <<<static_cast<unsigned>(split.total_rows * p.num_heads), 128, 0, stream>>>(p, split);
}

}  // namespace fox::cuda
