// Hopper (sm_90a) backward of Forgetting Attention for head dim 64 / 128 in fp16 / bf16: the
// structure of the portable backward (fast_backward.cuh: deterministic, no atomics, one writer per
// output element) on warpgroup MMA, with the gate bias from the tile suffix sums T of the forward
// (hopper_forward.cuh) and double-buffered tiles (the walked tiles by TMA where the layout allows
// it, as in the forward).
//
//   dkdv_kernel: one block (two warpgroups) per (sequence, kv head, 128-key tile), in the order
//     of block_key_tile (common.cuh); each warpgroup owns 64 keys: S^T = K Q^T and dP^T = V dO^T
//     (both operands in shared memory), then dV += P^T dO and dK += dS^T Q (P^T, dS^T from
//     registers, dO and Q read transposed), walking query tiles (kDkdvQueries) upwards from the
//     diagonal for every head of the GQA group (the fused form in turns: downwards in the grid's
//     last section, fused_down_from).
//     dc = -colsum(dS).
//     Fused (kFusedDq, the five-product backward; the default at any length at head dim 128 and
//     from 1024 queries at 64, api.cu): the same kernel also computes this key tile's part of dQ,
//     dQ^T = K^T dS^T (dS^T through shared memory; each warpgroup over its own keys first, then
//     the other's), and stages it with the row sums of dS for a third warpgroup, whose producer
//     warp loads the query tiles (TMA) and whose writer warp adds each staged tile to a float32
//     accumulator by one bulk reduction, in turns (bitwise reproducible, the first turn storing:
//     write_dq_tiles) or in any order; dq_from_accumulator then scales and rounds it.
//     The math warpgroups only wait for tiles and staging space, and get the third warpgroup's
//     registers (setmaxnreg).
//   dq_kernel: one block per (sequence, head, 128-query tile), each warpgroup 64 queries:
//     S = Q K^T, dP = dO V^T, dQ += dS K, walking key tiles (kDqKeys) downwards; row sums of dS.
//
// Bias: with C and T as in the forward, R_x = C_{tile(x)} - T[x] relative to an anchor; the dkdv
// kernel anchors at its first key j0 (C = T[j0] on the key tile, then C += T[boundary] at each
// 128-position boundary the query tiles cross), the dq kernel at its first query like the forward.
#pragma once

#include <cstdlib>

#include "generic_kernels.cuh"
#include "hopper_forward.cuh"

namespace fox::cuda::hopper {

// Query tile of the dkdv kernel: 128 at head dim 64, where the products of 64-query tiles are too
// short to keep the tensor cores busy; 64 at head dim 128 (registers).
#ifndef FOX_HOPPER_DKDV_QUERIES_64
#define FOX_HOPPER_DKDV_QUERIES_64 128
#endif
template <int kHeadDim>
constexpr int kDkdvQueries = kHeadDim <= 64 ? FOX_HOPPER_DKDV_QUERIES_64 : 64;
// Key tile of the dq kernel: 128 at head dim 128 (-10% time against 64: half the waits, stage
// handoffs and statistics loads per key, longer wgmma chains; 160 bytes of spills); 64 at head
// dim 64, where 128 would cost the second block per SM (+15%).
#ifndef FOX_HOPPER_DQ_KEYS_64
#define FOX_HOPPER_DQ_KEYS_64 64
#endif
#ifndef FOX_HOPPER_DQ_KEYS_128
#define FOX_HOPPER_DQ_KEYS_128 128
#endif
template <int kHeadDim>
constexpr int kDqKeys = kHeadDim <= 64 ? FOX_HOPPER_DQ_KEYS_64 : FOX_HOPPER_DQ_KEYS_128;

// Blocks per SM of the dq kernel: at head dim 64 its tiles are small and a block waits on its own
// short wgmma chains, so two blocks (shared memory ~66 KB each) overlap, at the price of a
// 128-register cap (~120 bytes of spills). The dkdv kernel keeps two more accumulators and
// would spill ~830 bytes under that cap: one block.
// The dK/dV kernel's stage handoff with TMA: decoupled (-4% time at D=64, even at D=128; without
// TMA it measured +20%: registers) or 0: one barrier per tile.
#ifndef FOX_HOPPER_DKDV_DECOUPLED
#define FOX_HOPPER_DKDV_DECOUPLED 1
#endif

#ifndef FOX_HOPPER_DQ_MIN_BLOCKS_64
#define FOX_HOPPER_DQ_MIN_BLOCKS_64 2
#endif
template <int kHeadDim>
constexpr int kDqMinBlocks = kHeadDim <= 64 ? FOX_HOPPER_DQ_MIN_BLOCKS_64 : 1;

// Row of the fused backward's float32 dQ accumulator and staging tiles (launch.h).
template <int kHeadDim>
constexpr int kDqAccRow = fused_dq_row(kHeadDim);

#ifndef FOX_HOPPER_FUSED_STAGED_STORE
#define FOX_HOPPER_FUSED_STAGED_STORE 1
#endif

// The fused backward's dQ^T = K^T dS^T by each warpgroup over its own keys first, then the other's
// (1: -1% to -5% backward time against 0, bench/NOTES.md version 68), or over all 128 keys once
// both warpgroups have stored their dS^T (0: a barrier of all math warps in every tile, which
// lines the two warpgroups up, so that their elementwise work leaves the tensor cores idle at once).
#ifndef FOX_HOPPER_FUSED_DQ_OWN_KEYS_FIRST
#define FOX_HOPPER_FUSED_DQ_OWN_KEYS_FIRST 1
#endif
// Warpgroup `wg` has stored its rows of dS^T (named barrier 6 + wg: its 128 threads arrive, the
// other warpgroup's 128 wait). Once a tile, in step: a warpgroup stores the next tile's dS^T only
// after every math warp's dQ^T of this one is done (dst_free), which the waiting side's wait precedes.
__device__ __forceinline__ void dst_written_arrive(int wg) { warpgroup_pair_arrive<6, 256>(wg); }
__device__ __forceinline__ void dst_written_wait(int wg) { warpgroup_pair_sync<6, 256>(wg); }

template <int kHeadDim, bool kFusedDq = false>
struct DkdvSmem {
  static constexpr int kQueries = kDkdvQueries<kHeadDim>;
  static constexpr int kKV = kBlockN * kHeadDim;      // K or V: 128 keys
  static constexpr int kQ = kQueries * kHeadDim;   // one Q or dO tile
  static constexpr size_t kBytesTiles = 2 * (2 * kKV + 2 * 2 * kQ);  // K, V, 2 stages of (Q, dO)
  // T of the keys; per stage T, -(T + lse) and delta of the queries
  static constexpr size_t kBytesStats = sizeof(float) * (kBlockN + 2 * 3 * kQueries);
  static constexpr size_t kBytesHandoff = TileHandoff::kBytes;
  // Fused: dS^T (keys x queries, 2-byte elements, load_tile's layout), two float32 staging tiles
  // of dQ for the bulk reduction (one may still be read by the previous reduction), and the row
  // sums of dS of each warp, for two tiles (one may still be read while the next is written).
  static constexpr size_t kBytesDst = kFusedDq ? 2 * kBlockN * kQueries : 0;
  static constexpr size_t kBytesDqStage = sizeof(float) * kQueries * kDqAccRow<kHeadDim>;
  static constexpr size_t kBytesRowSums = 2 * sizeof(float) * kWarps * kQueries;
  // The writer's barriers (full[2], empty[2]), the two staging tiles' slots (DqWriterSlot: 16
  // bytes each) and the barrier that frees dS^T for the next tile.
  static constexpr size_t kBytesWriter = 4 * sizeof(uint64_t) + 2 * 16 + sizeof(uint64_t);
  static constexpr size_t kBytesFused = kFusedDq ? kBytesDst + 2 * kBytesDqStage + kBytesRowSums + kBytesWriter : 0;
  static constexpr size_t kBytes = kBytesTiles + kBytesStats + kBytesHandoff + kBytesFused;
  static constexpr size_t kAllocBytes = kBytes + 1024;
  // [K, V, Q/dO stages][dS^T][statistics][handoff][dQ staging x 2][row sums][writer]: the tiles
  // wgmma reads 1024-byte aligned, the staging tiles 16-byte aligned.
  static constexpr size_t kOffDst = kBytesTiles;
  static constexpr size_t kOffStats = kOffDst + kBytesDst;
  static constexpr size_t kOffHandoff = kOffStats + kBytesStats;
  static constexpr size_t kOffDqStage = kOffHandoff + kBytesHandoff;
  static constexpr size_t kOffRowSums = kOffDqStage + 2 * kBytesDqStage;
  static constexpr size_t kOffWriter = kOffRowSums + kBytesRowSums;
  static_assert(!kFusedDq || kQueries * kHeadDim == 128 * 64, "fused dQ: two 64 x 64 halves per tile");
};

template <int kHeadDim>
struct DqSmem {
  static constexpr int kQ = kBlockM * kHeadDim;     // Q or dO: 128 queries
  static constexpr int kKeys = kDqKeys<kHeadDim>;
  static constexpr int kKV = kKeys * kHeadDim;      // one K or V tile
  static constexpr size_t kBytesTiles = 2 * (2 * kQ + 2 * 2 * kKV);  // Q, dO, 2 stages of (K, V)
  static constexpr size_t kBytesT = sizeof(float) * 2 * kKeys;  // T per stage
  static constexpr size_t kBytes = kBytesTiles + kBytesT + TileHandoff::kBytes;
  static constexpr size_t kAllocBytes = kBytes + 1024;
};

// Gradient rows to global memory: staged (kStaged) through shared memory (store_rows_staged, after
// a block barrier; `stage` is a tile whose rows of this warpgroup nothing reads any more), else
// straight from the accumulators. Staged by default at head dim 64. Measured per kernel (H100,
// ncu): staged, dK/dV -4.3% and dQ -2.2% at D=64 N=2k (-1.1% / -0.7% at 16k); at D=128, dK/dV
// -4.8% at N=2k but +2.5% at 16k, dQ +1.7% (the staging code changes the register allocation of
// their loops at the 255 cap). The fused backward stages at 128 too (its math threads have 240
// registers after setmaxnreg; its end took 7700 cycles a block unstaged, 2400 at D=64 staged):
// -5% at N=2k, -1.6% at 16k (FOX_HOPPER_FUSED_STAGED_STORE=0 builds the unstaged form).
template <typename T, int kRows, int kHeadDim, bool kStaged = (kHeadDim <= 64)>
__device__ __forceinline__ void store_accumulator(T* stage, T* base, int64_t row_stride, int row0,
                                                  int nrows, const float (&acc)[kHeadDim / 2], float scale) {
  if constexpr (kStaged) {
    const float row_scale[2] = {scale, scale};
    store_rows_staged<T, kRows, kHeadDim>(stage, acc, row_scale, base, row_stride, nrows);
    return;
  }
  using Mma = MmaTraits<T>;
  const int lane = threadIdx.x & 31, group = lane >> 2, quad = lane & 3;
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    const int r = row0 + group + 8 * hi;
    if (r >= nrows) continue;
    T* out = base + r * row_stride;
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n)
      *reinterpret_cast<uint32_t*>(out + n * 8 + quad * 2) =
          Mma::pack(acc[4 * n + 2 * hi] * scale, acc[4 * n + 2 * hi + 1] * scale);
  }
}

// C fragments (rows x kCols columns) -> A fragments of the kCols / 16 k-steps of the next product.
template <typename T, int kCols>
__device__ __forceinline__ void to_a_fragments(uint32_t (&frag)[kCols / 16][4], const float (&c)[kCols / 2]) {
  using Mma = MmaTraits<T>;
#pragma unroll
  for (int n = 0; n < kCols / 8; ++n) {
    frag[n / 2][(n & 1) * 2 + 0] = Mma::pack(c[4 * n + 0], c[4 * n + 1]);
    frag[n / 2][(n & 1) * 2 + 1] = Mma::pack(c[4 * n + 2], c[4 * n + 3]);
  }
}

// dQ^T of one tile pair in the fused backward: 64 x 64 per warpgroup, both operands MN-major (the
// rows of K and of dS^T are the k dimension, the keys): k-steps of 16 rows (2048 bytes), the leading
// byte offset the next 64-column block of a kRows-row tile.
template <typename T>
struct GmmaTransposed;
template <>
struct GmmaTransposed<__nv_bfloat16> {
  using SS = gmma::MMA_64x64x16_F32BF16BF16_SS<gmma::Major::MN, gmma::Major::MN>;
};
template <>
struct GmmaTransposed<__half> {
  using SS = gmma::MMA_64x64x16_F32F16F16_SS<gmma::Major::MN, gmma::Major::MN>;
};
// `accumulate`: onto acc, else the first k-step starts it.
template <class Op, int kRows, int N, int... KS>
__device__ __forceinline__ void gemm_transposed_tiles(uint32_t a, uint32_t b, float (&acc)[N], bool accumulate,
                                                      std::integer_sequence<int, KS...>) {
  (gmma_ss<Op>(sw128_descriptor<KS * 16 * 128, kRows * 128, 1024>(a),
               sw128_descriptor<KS * 16 * 128, kRows * 128, 1024>(b), acc, accumulate || KS > 0),
   ...);
}

// Bulk asynchronous reduction of shared memory into global memory (the copy engine adds `bytes`
// of float32, 16-byte aligned, at `dst`), its group commit and waits.
__device__ __forceinline__ void bulk_reduce_add(float* dst, const float* src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_address(src)), "r"(bytes)
               : "memory");
}
// The same copy without the addition (stores `bytes`).
__device__ __forceinline__ void bulk_store(float* dst, const float* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(smem_address(src)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// At most N groups still reading shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// At most N groups not complete (their writes done).
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// The fused backward's writer (one thread of a warpgroup of its own, so that the math warpgroups
// never wait for a reduction or a turn): staging tile n % 2 is handed over by full[n % 2] together
// with its slot (the accumulator row of the query tile; the turn, the number of key tiles that add
// to that query tile before this one; its rows inside the sequence); a slot row < 0 ends the block.
// With `turns`, a query tile's key tiles add from the diagonal down: each waits until the counter
// of its tile reaches its turn and moves it on once its own addition has landed, so dQ's float32
// sums come out in one order on every run. The tiles after this block's are started no later than
// it (block_key_tile's last_first), and they reach each query tile first, so a block only waits on
// blocks running ahead. In the last section of the grid the walks go down and the key tiles add
// from first_key's up, each after those started before it (fused_down_from). The first turn stores
// its rows instead of adding them, so that only the counters need zeros (dq_from_accumulator
// writes the rows no key tile reaches: the queries before seq_start).
struct DqWriterSlot {
  int64_t row;
  int32_t turn;
  int32_t rows;
};
__device__ __forceinline__ int load_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
template <int kDqRow>
__device__ __forceinline__ void write_dq_tiles(float* accum, int* turns, const float* stage, uint64_t* full,
                                               uint64_t* empty, const DqWriterSlot* slots, int stage_floats) {
  for (int64_t n = 0;; ++n) {
    const int b = static_cast<int>(n & 1);
    mbarrier_wait(full + b, static_cast<uint32_t>((n >> 1) & 1));
    const DqWriterSlot slot = slots[b];
    if (slot.row < 0) break;
    if (turns != nullptr) {
      while (load_acquire_gpu(turns + slot.row) != slot.turn) {
      }
      asm volatile("fence.proxy.async.global;\n" ::: "memory");  // the earlier additions, for the copy engine
    }
    const uint32_t bytes = static_cast<uint32_t>(sizeof(float) * kDqRow * slot.rows);
    if (turns != nullptr && slot.turn == 0)
      bulk_store(accum + slot.row * kDqRow, stage + b * stage_floats, bytes);
    else
      bulk_reduce_add(accum + slot.row * kDqRow, stage + b * stage_floats, bytes);
    bulk_commit();
    bulk_wait_read<0>();
    mbarrier_arrive(empty + b);  // the staging tile may be written again
    if (turns != nullptr) {
      bulk_wait<0>();  // landed
      asm volatile("fence.proxy.async.global;\n" ::: "memory");
      asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(turns + slot.row) : "memory");
    }
  }
  bulk_wait<0>();
}

// Sums each of the K values of v over the 8 rows (`group`) of a C fragment's column, in a fixed
// order, scattering the sums: three halving exchanges (xor 16, 8, 4) leave this lane the sums of
// entries [first, first + K / 8), first = (lane & 16 ? K / 2 : 0) + (lane & 8 ? K / 4 : 0) +
// (lane & 4 ? K / 8 : 0). 7 K / 8 shuffles instead of the 3 K of a butterfly per value.
template <int kMask, int kHalf, int K>
__device__ __forceinline__ void halve_column_sums(float (&v)[K], int& first) {
  const bool upper = (threadIdx.x & kMask) != 0;
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    const float send = upper ? v[i] : v[i + kHalf];
    const float keep = upper ? v[i + kHalf] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, kMask);
  }
  if (upper) first += kHalf;
}
template <int K>
__device__ __forceinline__ int column_sums_scattered(float (&v)[K]) {
  int first = 0;
  halve_column_sums<16, K / 2>(v, first);
  halve_column_sums<8, K / 4>(v, first);
  halve_column_sums<4, K / 8>(v, first);
  return first;
}

// The per-query statistics of a query tile (first query i0, nq inside the sequence) into its stage
// `sn`: T at the queries' positions (T_q: T from the first query's position), -(T + lse) and
// delta, zeros past the end; by the block's first kLoaders threads (or a producer warp: 32).
template <int kQueries, int kLoaders>
__device__ __forceinline__ void load_query_stats(float* sn, const float* T_q, const float* qbias, const float* delta,
                                                 int64_t i0, int nq) {
#pragma unroll
  for (int c = threadIdx.x % kLoaders; c < kQueries; c += kLoaders) {
    const bool ok = c < nq;
    const int64_t i = ok ? i0 + c : 0;
    cp_async_4(sn + c, T_q + i, ok);
    cp_async_4(sn + kQueries + c, qbias + i, ok);
    cp_async_4(sn + 2 * kQueries + c, delta + i, ok);
  }
}

// The fused dK/dV kernel's producer warp: the query tiles of the block's walk (every head of the
// kv head's group, from qt_begin up, or from the last tile down to qt_begin with `walk_down`; no
// pruning in the fused form, so every walk covers all of them),
// into the stage of tile `it` once the math threads have released it: Q and dO by TMA (lane 0's
// transaction), a partial last tile by cp.async with zeros past the end, and the per-query T,
// -(T + lse) and delta by cp.async (the 32 lanes' arrivals).
template <typename T, int kQueries, int kHeadDim>
__device__ __forceinline__ void produce_query_tiles(const BackwardParams& p, const BackwardWorkspace& ws,
                                                    const float* suffix, const SequenceView& s, int64_t hk,
                                                    int64_t qt_begin, bool walk_down, T* QdO, float* stats,
                                                    const TileHandoff& handoff, const TileMaps& maps) {
  constexpr int kQ = kQueries * kHeadDim;
  const int lane = threadIdx.x & 31;
  const int64_t offset = s.len_k - s.len_q;
  const int64_t heads_per_group = p.heads_per_kv_head();
  int64_t it = 0;
  for (int64_t h = hk * heads_per_group; h < (hk + 1) * heads_per_group; ++h) {
    const HeadPointers<T> hp = head_pointers<T>(p, s, h);
    const T* dout = static_cast<const T*>(p.dout) + s.batch_index * p.do_batch_stride +
                    s.row_q * p.do_row_stride + h * p.do_head_stride;
    const int64_t stat = row_stat_offset(p, s, h);
    const float* T_ = suffix + (s.batch_index * p.num_heads + h) * p.seqlen_k + s.row_k;
    const int64_t qt_end = (s.len_q + kQueries - 1) / kQueries;
    for (int64_t k = 0; qt_begin + k < qt_end; ++k, ++it) {
      const int64_t qt = walk_down ? qt_end - 1 - k : qt_begin + k;
      const int st = static_cast<int>(it & 1);
      if (it >= 2) {  // tile it - 2 released (and so its phase of full done: for synccheck)
        const uint32_t parity = static_cast<uint32_t>(((it - 2) >> 1) & 1);
        mbarrier_wait(handoff.empty + st, parity);
        mbarrier_wait(handoff.full + st, parity);
      }
      const int64_t i0 = qt * kQueries;
      const int nq = static_cast<int>(min64(kQueries, s.len_q - i0));
      T* Qn = QdO + 2 * st * kQ;
      if (nq == kQueries) {
        handoff.copy<kQueries, kHeadDim>(Qn, Qn + kQ, maps, it, s.row_q + i0, h, s.batch_index, lane == 0);
      } else {
        if (lane == 0) mbarrier_arrive(handoff.full + st);
        load_tile<T, kQueries, kHeadDim, 32>(Qn, hp.q + i0 * hp.q_row, hp.q_row, nq);
        load_tile<T, kQueries, kHeadDim, 32>(Qn + kQ, dout + i0 * p.do_row_stride, p.do_row_stride, nq);
      }
      load_query_stats<kQueries, 32>(stats + 3 * st * kQueries, T_ + offset, ws.query_bias + stat,
                                     ws.delta + stat, i0, nq);
      cp_async_arrive(handoff.full + st);
    }
  }
  cp_async_wait<0>();
}

// Threads of the dK/dV kernel: two math warpgroups, and in the fused form a warpgroup of a producer
// warp (the query tiles) and a writer warp (the reductions of dQ).
template <bool kFusedDq>
constexpr int kDkdvThreads = kThreads + (kFusedDq ? 128 : 0);

template <typename T, int kHeadDim, bool kFusedDq>
__global__ void __launch_bounds__(kDkdvThreads<kFusedDq>, 1)
    dkdv_kernel(const BackwardParams p, const BackwardWorkspace ws, const float* __restrict__ suffix,
                int64_t num_tiles, const __grid_constant__ TileMaps maps, int64_t down_from) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Smem = DkdvSmem<kHeadDim, kFusedDq>;
  constexpr int kQueries = Smem::kQueries;
  using GmmaS = typename Gmma<T, kQueries>::SS;
  using GmmaD = typename Gmma<T, kHeadDim>::RS;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* base = smem_raw + ((1024 - smem_address(smem_raw) % 1024) % 1024);
  T* Ks = reinterpret_cast<T*>(base);
  T* Vs = Ks + Smem::kKV;
  T* QdO = Vs + Smem::kKV;  // stage s: Q at QdO + 2s * kQ, dO at QdO + (2s + 1) * kQ
  float* Tk = reinterpret_cast<float*>(base + Smem::kOffStats);
  float* stats = Tk + kBlockN;  // stage s: T, -(T + lse), delta of the queries at stats + 3s * kQueries
  // Fused dQ: dS^T (keys x queries), the float32 staging tiles [query][kDqAccRow] and the row sums
  // of dS per warp [tile % 2][warp][query].
  T* Dst = reinterpret_cast<T*>(base + Smem::kOffDst);
  float* dq_stage = reinterpret_cast<float*>(base + Smem::kOffDqStage);
  float* warp_rowsums = reinterpret_cast<float*>(base + Smem::kOffRowSums);
  uint64_t* dq_full = reinterpret_cast<uint64_t*>(base + Smem::kOffWriter);
  uint64_t* dq_empty = dq_full + 2;
  DqWriterSlot* dq_slots = reinterpret_cast<DqWriterSlot*>(dq_full + 4);
  // Completes once every math warp's product dQ^T has read dS^T: the next tile may write it. (An
  // mbarrier, not a second barrier of the math warps in every tile: -3% to -6%, version 53.)
  uint64_t* dst_free = reinterpret_cast<uint64_t*>(dq_slots + 2);
  constexpr int kDqRow = kDqAccRow<kHeadDim>;
  constexpr int kStageFloats = kQueries * kDqRow;
  // Fused: dS^T goes to shared memory while dV and dK are computed at D=128 (-1% to -2%); at D=64
  // before them, since keeping dS^T's float32 values across them spills (+2%). The row sums of dS
  // follow the products at both (-1% to -3% at D=64). (bench/NOTES.md, version 68)
  constexpr bool kStoreDstLate = kHeadDim > 64;
  // Barrier of the threads that walk: the math warpgroups (the writer's warpgroup does not take part).
  auto sync_math = [] {
    if constexpr (kFusedDq)
      math_barrier();
    else
      __syncthreads();
  };

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp_uniform(warp >> 2);
  const int group = lane >> 2, quad = lane & 3;
  const int warp_row0 = 64 * wg + 16 * (warp & 3);  // this warp's first key in the tile

  const bool in_turns = kFusedDq && ws.dq_turns != nullptr;
  const KeyTile kt = block_key_tile(p, num_tiles, kBlockN, in_turns, down_from, key_block_section_bytes(p));
  const bool walk_down = kFusedDq && kt.walk_down;
  const SequenceView s = kt.s;
  // Positions inside the sequence in 32 bits (a sequence stays below 2^31 of them).
  const int len_q = static_cast<int>(s.len_q), len_k = static_cast<int>(s.len_k);
  const int first_key = static_cast<int>(s.first_key);
  const int64_t hk = kt.hk;
  const int j0 = static_cast<int>(kt.j0), tile = j0 / kBlockN;
  if (j0 >= len_k) return;
  const int nk = min(kBlockN, len_k - j0);
  const int offset = len_k - len_q;  // query i sits at position i + offset
  const int64_t heads_per_group = p.heads_per_kv_head();
  const float scale_log2 = static_cast<float>(p.scale) * kLog2e;
  // Full query tiles come by TMA (Q and dO maps), a partial last one by cp.async. With TMA the
  // stage handoff is decoupled (the tiles are counted across the heads: `it`).
  // Fused: the producer warp fills the stages (its lane 0's transaction and its 32 lanes' copies),
  // and the maps are there (run_hopper_backward fuses only with TMA): known when it compiles, the
  // handoff's branches leave its tile loop (-0.3% to -1.0% backward time, bench/NOTES.md version 98).
  const bool use_tma = kFusedDq || maps.enabled != 0;
  const TileHandoff handoff(base + Smem::kOffHandoff, use_tma && FOX_HOPPER_DKDV_DECOUPLED, use_tma,
                            kFusedDq ? 1 + 32 : -1);
  const int qt_begin = max(0, j0 - offset) / kQueries;
  const bool any_key = j0 + nk - 1 >= first_key;
  int it = 0;  // ring position of the query tiles
  int n_staged = 0;  // fused: dQ tiles handed to the writer
  if constexpr (kFusedDq) {
    // (run_hopper_backward fuses only with TMA and without pruning)
    if (threadIdx.x == 0) {
      for (int b = 0; b < 2; ++b) {
        mbarrier_init(dq_full + b, kWarps);  // each math warp, once its part of the staging tile is written
        mbarrier_init(dq_empty + b, 1);
      }
      mbarrier_init(dst_free, kWarps);
      fence_async_proxy();
    }
    __syncthreads();
    if (warp >= kWarps) {  // the producer and writer's warpgroup
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(24) : "memory");
      if (warp == kWarps && any_key)
        produce_query_tiles<T, kQueries, kHeadDim>(p, ws, suffix, s, hk, qt_begin, walk_down, QdO, stats, handoff,
                                                   maps);
      else if (warp == kWarps + 1 && lane == 0)
        write_dq_tiles<kDqRow>(ws.dq_accum, ws.dq_turns, dq_stage, dq_full, dq_empty, dq_slots, kStageFloats);
      return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(240) : "memory");
  }
  {
    const HeadPointers<T> hp = head_pointers<T>(p, s, hk * heads_per_group);
    load_tile<T, kBlockN, kHeadDim>(Ks, hp.k + j0 * hp.k_row, hp.k_row, nk);
    load_tile<T, kBlockN, kHeadDim>(Vs, hp.v + j0 * hp.v_row, hp.v_row, nk);
    cp_async_commit();
  }

  float dk[kHeadDim / 2], dv[kHeadDim / 2];
#pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) dk[i] = dv[i] = 0.f;

  for (int64_t h = hk * heads_per_group; h < (hk + 1) * heads_per_group; ++h) {
    const HeadPointers<T> hp = head_pointers<T>(p, s, h);
    const T* dout = static_cast<const T*>(p.dout) + s.batch_index * p.do_batch_stride +
                    s.row_q * p.do_row_stride + h * p.do_head_stride;
    const int64_t stat = row_stat_offset(p, s, h);
    const float* qbias_h = ws.query_bias + stat;
    const float* delta_h = ws.delta + stat;
    const float* T_ = suffix + (s.batch_index * p.num_heads + h) * p.seqlen_k + s.row_k;
    float colsum[2] = {0.f, 0.f};

    // Q, dO and the row statistics of query tile qt into the stage of tile `tile_it` (zeros past
    // the end).
    auto load_queries = [&](int64_t qt, int64_t tile_it) {
      const int64_t i0 = qt * kQueries;
      const int nq = static_cast<int>(min64(kQueries, s.len_q - i0));
      const int st = static_cast<int>(tile_it & 1);
      T* Qn = QdO + 2 * st * Smem::kQ;
      const bool by_tma = use_tma && nq == kQueries;
      if (by_tma) {
        handoff.copy<kQueries, kHeadDim>(Qn, Qn + Smem::kQ, maps, tile_it, s.row_q + i0, h, s.batch_index);
      } else {
        load_tile<T, kQueries, kHeadDim>(Qn, hp.q + i0 * hp.q_row, hp.q_row, nq);
        load_tile<T, kQueries, kHeadDim>(Qn + Smem::kQ, dout + i0 * p.do_row_stride, p.do_row_stride, nq);
      }
      load_query_stats<kQueries, kThreads>(stats + 3 * st * kQueries, T_ + offset, qbias_h, delta_h, i0, nq);
      handoff.loaded(tile_it, by_tma);
    };

    sync_math();  // every warp is done with the previous head's tiles and Tk
    if (threadIdx.x < kBlockN) {
      const int64_t j = j0 + threadIdx.x;
      cp_async_4(Tk + threadIdx.x, T_ + (j < s.len_k ? j : 0), j < s.len_k);
    }
    const bool any_query = any_key && qt_begin * kQueries < len_q;
    if (!kFusedDq && any_query) {
      handoff.wait_free(it);  // (free since the barrier above; the wait keeps the phases in step)
      load_queries(qt_begin, it);
    }
    cp_async_commit();
    cp_async_wait<0>();
    sync_math();
    // Anchor j0: C of the key tile is T[j0]; R of this thread's keys (T in log2 units).
    float c_cur = Tk[0];
    float rk[2];
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) rk[hi] = c_cur - Tk[warp_row0 + group + 8 * hi];
    const float r_last = c_cur - Tk[nk - 1];  // R of the last key (c_cur moves on with the queries)
    // When the first query lies tiles above the keys (seqlen_q < seqlen_k), C of its 128-tile:
    // the T of the boundaries in between, summed by every warp alike (xor butterfly).
    const int first_tile = (qt_begin * kQueries + offset) / kBlockN;
    if (any_query && first_tile > tile) {
      float sum = 0.f;
      for (int u = tile + 1 + lane; u <= first_tile; u += 32) sum += T_[static_cast<int64_t>(u) * kBlockN];
      c_cur += warp_sum(sum);
    }
    // first position of the 128-tile after the one c_cur belongs to
    int boundary = (max(first_tile, tile) + 1) * kBlockN;
    const float prune_log2 = p.prune_threshold * kLog2e;
    // A walk down: C of the 128-tile of each query tile's first position, from C of the top one
    // down, one T subtracted at each boundary crossed. In double, since C there holds the sum of
    // the whole walk (~10^4 for a fast-forgetting head at N = 16k): in float the subtractions
    // would leave the tiles near the keys an error of that size's ulps; in double it stays far
    // below the float sums of the walk up.
    const int qt_end = (len_q + kQueries - 1) / kQueries;
    int c_tile = tile;  // the 128-tile c_down belongs to
    double c_down = 0.0;
    if (walk_down && any_query) {
      c_tile = max(tile, ((qt_end - 1) * kQueries + offset) / kBlockN);
      double sum = 0.0;
      for (int u = tile + 1 + lane; u <= c_tile; u += 32) sum += T_[static_cast<int64_t>(u) * kBlockN];
      c_down = static_cast<double>(Tk[0]) + warp_sum(sum);
    }

    for (int k = 0; any_query && qt_begin + k < qt_end; ++k, ++it) {
      const int qt = walk_down ? qt_end - 1 - k : qt_begin + k;
      const int st = warp_uniform(static_cast<int>(it & 1));
      const T* Qs = QdO + 2 * st * Smem::kQ;
      const T* dOs = Qs + Smem::kQ;
      const float* Tq = stats + 3 * st * kQueries;
      const float* qbias = Tq + kQueries;
      const float* delta_q = qbias + kQueries;
      const int i0 = qt * kQueries, p0 = i0 + offset;
      const int nq = min(kQueries, len_q - i0);
      if (walk_down) {
        const int u0 = max(tile, p0 / kBlockN);
        for (; c_tile > u0; --c_tile) c_down -= T_[static_cast<int64_t>(c_tile) * kBlockN];
        c_cur = static_cast<float>(c_down);
        boundary = (u0 + 1) * kBlockN;
      }
      handoff.wait_loaded(it);
      // C of the positions at and after the boundary, when it falls in this query tile.
      const int kb = boundary - p0;
      const float c_next = kb >= 0 && kb < kQueries ? c_cur + Tq[kb] : c_cur;
      // Largest bias of the pair: the first query against the last key (0 when they overlap).
      const float r_first = (p0 >= boundary ? c_next : c_cur) - Tq[0];
      const float max_bias = p0 <= j0 + nk - 1 ? 0.f : r_first - r_last;
      if (!kFusedDq && max_bias < prune_log2) {  // (the fused form runs without pruning)
        handoff.release(it++);
        break;
      }
      if (!kFusedDq && (qt + 1) * kQueries < len_q) {
        handoff.wait_free(it + 1);
        load_queries(qt + 1, it + 1);
      }

      float sT[kQueries / 2], dpT[kQueries / 2];  // S^T and dP^T: 64 keys of this warpgroup x the queries
      cute::warpgroup_arrive();
      gemm_rows_by_tile<GmmaS, kHeadDim, kBlockN, kQueries>(Ks, 64 * wg, Qs, sT);
      gemm_rows_by_tile<GmmaS, kHeadDim, kBlockN, kQueries>(Vs, 64 * wg, dOs, dpT);
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<0>();
      fence_registers(sT);
      fence_registers(dpT);

      // P^T and dS^T: x = S^T * scale_log2 + R_p - lse2 - R_k, where R_p - lse2 = C_p + qbias_p and
      // C_p is c_cur before the boundary and c_next from it on, so that a tile the boundary does not
      // cross costs one shift per key row and no arithmetic per column. The masked variant (the
      // tiles that meet the diagonal, first_key, an end or the boundary) picks C per column.
      const int kb32 = max(-1, min(kQueries, kb));
      const bool crossing = kb32 > 0 && kb32 < kQueries;
      float shift_lo[2], shift_hi[2];  // C - R_k before and from the boundary
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        shift_lo[hi] = (kb32 <= 0 ? c_next : c_cur) - rk[hi];
        shift_hi[hi] = c_next - rk[hi];
      }
      auto probabilities = [&](auto masked) {
        int shift = 0, key_lo = 0;
        if constexpr (decltype(masked)::value) {
          shift = max(-4 * kBlockN, min(4 * kBlockN, j0 - p0));
          key_lo = max(0, min(kBlockN, first_key - j0));
        }
#pragma unroll
        for (int n = 0; n < kQueries / 8; ++n) {
          const int c = n * 8 + quad * 2;
          const float2 b2 = *reinterpret_cast<const float2*>(qbias + c);
          const float2 d2 = *reinterpret_cast<const float2*>(delta_q + c);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int hi = e >> 1, col = c + (e & 1);
            float row_term = shift_lo[hi];
            if constexpr (decltype(masked)::value) row_term = col >= kb32 ? shift_hi[hi] : shift_lo[hi];
            float x = fmaf(sT[4 * n + e], scale_log2, (e & 1) ? b2.y : b2.x) + row_term;
            if constexpr (decltype(masked)::value) {
              const int key = warp_row0 + group + 8 * hi;
              // key j0 + key <= query position p0 + col, and both inside their sequences
              if (col < key + shift || col >= nq || key >= nk || key < key_lo) x = -INFINITY;
            }
            const float prob = exp2f(x);
            const float ds = prob * (dpT[4 * n + e] - ((e & 1) ? d2.y : d2.x));
            sT[4 * n + e] = prob;
            dpT[4 * n + e] = ds;
            colsum[hi] += ds;
          }
        }
      };
      if (p0 < j0 + kBlockN - 1 || j0 < first_key || nq < kQueries || nk < kBlockN || crossing)
        probabilities(std::true_type{});
      else
        probabilities(std::false_type{});
      // Fused: dS^T of this warpgroup's keys into shared memory (rounded as dK's product rounds it),
      // once every warp's dQ^T of the tile before is done; this thread's sums of dS per query over
      // its two keys, and this warp's row sums of dS (float32) per query, in one of two buffers
      // (warpgroup 0's first kQueries threads read a tile's after both warpgroups' barriers of the
      // exchange below; every warp writes the tile after next's only once it has passed the
      // exchange of the next tile, and so after those reads).
      float part[kQueries / 4];  // entry 2n + e: query 8n + 2 quad + e, this thread's two keys
      auto row_parts = [&] {
#pragma unroll
        for (int n = 0; n < kQueries / 8; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) part[2 * n + e] = dpT[4 * n + e] + dpT[4 * n + 2 + e];
      };
      auto store_dst = [&] {
        using Mma = MmaTraits<T>;
        if (n_staged >= 1) mbarrier_wait(dst_free, static_cast<uint32_t>((n_staged - 1) & 1));
#pragma unroll
        for (int hi = 0; hi < 2; ++hi)
#pragma unroll
          for (int n = 0; n < kQueries / 8; ++n)
            *reinterpret_cast<uint32_t*>(Dst + sw128_offset(warp_row0 + group + 8 * hi, n, kBlockN) + quad * 2) =
                Mma::pack(dpT[4 * n + 2 * hi], dpT[4 * n + 2 * hi + 1]);
      };
      auto store_row_sums = [&] {
        float* rowsums = warp_rowsums + (n_staged & 1) * kWarps * kQueries;
        const int first = column_sums_scattered(part);
#pragma unroll
        for (int i = 0; i < kQueries / 32; i += 2)
          *reinterpret_cast<float2*>(rowsums + warp * kQueries + 8 * ((first + i) >> 1) + 2 * quad) =
              make_float2(part[i], part[i + 1]);
      };
      if constexpr (kFusedDq && !kStoreDstLate) {
        store_dst();
        row_parts();
      }
      uint32_t pT[kQueries / 16][4], dsT[kQueries / 16][4];
      to_a_fragments<T, kQueries>(pT, sT);
      to_a_fragments<T, kQueries>(dsT, dpT);

      // dV += P^T dO, dK += dS^T Q
      fence_registers(dv);
      fence_registers(dk);
      cute::warpgroup_arrive();
      gemm_frags_by_tile<GmmaD, kQueries>(pT, dOs, dv);
      gemm_frags_by_tile<GmmaD, kQueries>(dsT, Qs, dk);
      cute::warpgroup_commit_batch();
      // At D=128 the row sums come first: they fill dst_free's wait before dS^T's store (-1.2% to
      // -1.5% backward time against after it, bench/NOTES.md version 100).
      if constexpr (kFusedDq) {
        if constexpr (kStoreDstLate) row_parts();
        store_row_sums();
        if constexpr (kStoreDstLate) store_dst();
      }
      // Fused: dQ^T = K^T dS^T, summed over the 128 keys of both warpgroups' dS^T. Each warpgroup
      // takes one 64 x 64 half: 64 columns of the head dim at D=128 (one query tile of 64), 64 of
      // the 128 queries at D=64.
      float dqT[32];
      if constexpr (kFusedDq) {
        using GmmaT = typename GmmaTransposed<T>::SS;
        const uint32_t a = tile_address(Ks + (kHeadDim > 64 ? wg * kBlockN * 64 : 0));
        const uint32_t b = tile_address(Dst + (kHeadDim > 64 ? 0 : wg * kBlockN * 64));
        fence_async_proxy();
#if FOX_HOPPER_FUSED_DQ_OWN_KEYS_FIRST
        // The warpgroup's own 64 keys first (k-steps of its rows of K and dS^T, 64 rows of 128
        // bytes in: tile_address counts 16-byte units), as soon as its own warps have stored their
        // dS^T; then the other warpgroup's, once that one has. A warpgroup waits for the other only
        // after issuing three products, so the two need not meet at the same point of every tile.
        const uint32_t own = static_cast<uint32_t>(wg) * (64 * 128 / 16), other = 64 * 128 / 16 - own;
        // This thread's stores are done: it tells the other warpgroup (whose wait completes once all
        // 128 threads have arrived) before meeting its own, which may take longer (with the row sums
        // first, -0.3% to -0.6% at D=128: version 100).
        dst_written_arrive(wg);
        warpgroup_barrier(wg);
        // Once dV and dK are done, nothing reads this stage's Q, dO or statistics: the producer may
        // refill it before dQ^T is issued (backward time -1.0% to -1.6% at D=64 against a release
        // after the staging, version 99; at D=128 -0.1% to -0.3% against one between dQ^T's
        // halves, version 100).
        cute::warpgroup_wait<0>();
        handoff.release(it);
        cute::warpgroup_arrive();
        gemm_transposed_tiles<GmmaT, kBlockN>(a + own, b + own, dqT, false, std::make_integer_sequence<int, 4>{});
        cute::warpgroup_commit_batch();
        dst_written_wait(1 - wg);
        cute::warpgroup_arrive();
        gemm_transposed_tiles<GmmaT, kBlockN>(a + other, b + other, dqT, true, std::make_integer_sequence<int, 4>{});
        cute::warpgroup_commit_batch();
#else
        sync_math();
        cute::warpgroup_arrive();
        gemm_transposed_tiles<GmmaT, kBlockN>(a, b, dqT, false, std::make_integer_sequence<int, kBlockN / 16>{});
        cute::warpgroup_commit_batch();
        cute::warpgroup_wait<1>();
        handoff.release(it);
#endif
      }
      if (!walk_down && p0 + kQueries > boundary) {  // the next query tile starts past the boundary
        c_cur = c_next;
        boundary += kBlockN;
      }
      cute::warpgroup_wait<0>();
      fence_registers(dv);
      fence_registers(dk);
      if constexpr (kFusedDq) {
        fence_registers(dqT);
        // Staging tile [query][kDqRow]: dQ (unscaled), then the row sum of dS.
        // Staging tile n_staged % 2, once the writer has read what it held two tiles ago.
        const int sb = static_cast<int>(n_staged & 1);
        if (n_staged >= 2) mbarrier_wait(dq_empty + sb, static_cast<uint32_t>(((n_staged - 2) >> 1) & 1));
        float* stage = dq_stage + sb * kStageFloats;
        const int d0 = (kHeadDim > 64 ? 64 * wg : 0) + 16 * (warp & 3) + group;
        const int c0 = (kHeadDim > 64 ? 0 : 64 * wg) + 2 * quad;
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int hi = 0; hi < 2; ++hi)
#pragma unroll
            for (int e = 0; e < 2; ++e) stage[(c0 + 8 * j + e) * kDqRow + d0 + 8 * hi] = dqT[4 * j + 2 * hi + e];
        if (threadIdx.x < kQueries) {
          const float* rowsums = warp_rowsums + (n_staged & 1) * kWarps * kQueries;
          float sum = 0.f;
#pragma unroll
          for (int w = 0; w < kWarps; ++w) sum += rowsums[w * kQueries + threadIdx.x];
          stage[threadIdx.x * kDqRow + kHeadDim] = sum;
        }
        fence_async_proxy();
        if (threadIdx.x == 0) {
          // The turn: the key tiles after this one up to the diagonal's add first (walks up), or
          // those from first_key's up to this one (walks down).
          const int diagonal = min((p0 + nq - 1) / kBlockN, (len_k - 1) / kBlockN);
          dq_slots[sb] = {stat + i0, walk_down ? tile - first_key / kBlockN : diagonal - tile, nq};
        }
        __syncwarp();
        // This warp's dQ^T has read dS^T, its part of the staging tile is written. (At the end of
        // the tile: deferring dst_free's arrival to the next tile's products, which paid at D=128
        // in version 99, is even since the row sums fill its wait, version 100; every earlier point
        // measured +0.8% to +3.9%.)
        if (lane == 0) {
          mbarrier_arrive(dst_free);
          mbarrier_arrive(dq_full + sb);
        }
        ++n_staged;
      }
      if constexpr (!kFusedDq) handoff.release(it);
    }
    cp_async_wait<0>();
    store_quad_colsums(key_stat(ws.dc, p, s, h, j0), warp_row0 + group, nk, colsum);  // dc = -colsum(dS)
  }
  cp_async_wait<0>();
  if constexpr (kFusedDq)
    if (threadIdx.x == 0) {  // the end, in the slot after the last tile
      const int sb = static_cast<int>(n_staged & 1);
      if (n_staged >= 2) mbarrier_wait(dq_empty + sb, static_cast<uint32_t>(((n_staged - 2) >> 1) & 1));
      dq_slots[sb] = {-1, 0, 0};
      mbarrier_arrive(dq_full + sb, kWarps);
    }

  constexpr bool kStagedKeys = kHeadDim <= 64 || (kFusedDq && FOX_HOPPER_FUSED_STAGED_STORE);
  if constexpr (kStagedKeys) sync_math();  // (store_accumulator: staged through K and V)
  const KeyGradRows<T> out = key_grad_rows<T>(p, s, hk, j0);
  store_accumulator<T, kBlockN, kHeadDim, kStagedKeys>(Ks, out.dk, p.dk_row_stride, warp_row0, nk, dk,
                                                       static_cast<float>(p.scale));
  store_accumulator<T, kBlockN, kHeadDim, kStagedKeys>(Vs, out.dv, p.dv_row_stride, warp_row0, nk, dv, 1.f);
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreads, kDqMinBlocks<kHeadDim>)
    dq_kernel(const BackwardParams p, const BackwardWorkspace ws, const float* __restrict__ suffix,
              int64_t num_tiles, const __grid_constant__ TileMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Smem = DqSmem<kHeadDim>;
  constexpr int kKeys = Smem::kKeys;
  using GmmaS = typename Gmma<T, kKeys>::SS;
  using GmmaD = typename Gmma<T, kHeadDim>::RS;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* base = smem_raw + ((1024 - smem_address(smem_raw) % 1024) % 1024);
  T* Qs = reinterpret_cast<T*>(base);
  T* dOs = Qs + Smem::kQ;
  T* KV = dOs + Smem::kQ;  // stage s: K at KV + 2s * kKV, V at KV + (2s + 1) * kKV
  float* Ts = reinterpret_cast<float*>(base + Smem::kBytesTiles);  // stage s: T of its keys

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp_uniform(warp >> 2);
  const int group = lane >> 2, quad = lane & 3;
  const int warp_row0 = 64 * wg + 16 * (warp & 3);

  const QueryTile qt = block_query_tile(p, num_tiles, kBlockM);
  if (qt.nq == 0) return;
  const SequenceView s = qt.s;
  const int64_t h = qt.h, i0 = qt.i0, a = qt.a, L = qt.L;
  const int nq = qt.nq;
  const HeadPointers<T> hp = head_pointers<T>(p, s, h);
  const T* dout = static_cast<const T*>(p.dout) + s.batch_index * p.do_batch_stride +
                  (s.row_q + i0) * p.do_row_stride + h * p.do_head_stride;
  const float* T_ = suffix + (s.batch_index * p.num_heads + h) * p.seqlen_k + s.row_k;
  const float scale_log2 = static_cast<float>(p.scale) * kLog2e;
  const int64_t kt_hi = L / kKeys, kt_lo = s.first_key / kKeys;

  // Stage handoff as in the forward: the key tiles after the first (all full, inside the sequence)
  // by TMA where the layout allows it; decoupled at head dim 128 when both warpgroups hold queries
  // (dQ -11% against one barrier per tile with cp.async, and -8% more with TMA).
  const bool use_tma = maps.enabled != 0;
  const TileHandoff handoff(base + Smem::kBytesTiles + Smem::kBytesT,
                            kHeadDim > 64 && nq > 64 &&
                                (!use_tma || FOX_HOPPER_TMA_DECOUPLED),
                            use_tma);
  const int64_t kv_head = kv_head_of(p, h);
  auto load_keys = [&](int64_t kt, int64_t tile_it, bool by_tma) {  // into the stage of tile_it
    const int64_t j0 = kt * kKeys;
    const int st = static_cast<int>(tile_it & 1);
    const int nk = static_cast<int>(min64(kKeys, s.len_k - j0));
    T* Kn = KV + 2 * st * Smem::kKV;
    if (by_tma) {
      handoff.copy<kKeys, kHeadDim>(Kn, Kn + Smem::kKV, maps, tile_it, s.row_k + j0, kv_head, s.batch_index);
    } else {
      load_tile<T, kKeys, kHeadDim>(Kn, hp.k + j0 * hp.k_row, hp.k_row, nk);
      load_tile<T, kKeys, kHeadDim>(Kn + Smem::kKV, hp.v + j0 * hp.v_row, hp.v_row, nk);
    }
    if (threadIdx.x < kKeys) {
      const int64_t j = j0 + threadIdx.x;
      cp_async_4(Ts + st * kKeys + threadIdx.x, T_ + (j < s.len_k ? j : 0), j < s.len_k);
    }
  };
  __syncthreads();  // the initialized barriers, for every thread
  load_tile<T, kBlockM, kHeadDim>(Qs, hp.q + i0 * hp.q_row, hp.q_row, nq);
  load_tile<T, kBlockM, kHeadDim>(dOs, dout, p.do_row_stride, nq);
  if (kt_hi >= kt_lo) load_keys(kt_hi, 0, false);
  handoff.loaded(0);

  const int64_t ta = a / kBlockN;
  const float c_a = T_[a];
  const float c_above = ta + 1 < (s.len_k + kBlockN - 1) / kBlockN ? c_a + T_[(ta + 1) * kBlockN] : 0.f;
  auto row_of = [&](int hi) { return warp_row0 + group + 8 * hi; };
  const int64_t stat = row_stat_offset(p, s, h) + i0;
  float rq[2], delta[2];  // R of the row minus its lse (log2 domain); delta of the row
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    const int r = row_of(hi);
    const int64_t pos = min64(a + r, L);
    // rows past the end get lse 0 (finite): computed, never written
    const float lse2 = r < nq ? static_cast<const float*>(p.lse)[stat + r] * kLog2e : 0.f;
    rq[hi] = (pos / kBlockN == ta ? c_a : c_above) - T_[pos] - lse2;
    delta[hi] = r < nq ? ws.delta[stat + r] : 0.f;
  }
  float carry = (kt_hi * kKeys) / kBlockN == ta ? c_a : c_above;  // C of the keys' 128-tile
  const float prune_log2 = p.prune_threshold * kLog2e;

  float dq[kHeadDim / 2];
#pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) dq[i] = 0.f;
  float rowsum[2] = {0.f, 0.f};

  for (int64_t kt = kt_hi, it = 0; kt >= kt_lo; --kt, ++it) {
    const int64_t j0 = kt * kKeys;
    const int st = warp_uniform(static_cast<int>(it & 1));
    const T* Ks = KV + 2 * st * Smem::kKV;
    const T* Vs = Ks + Smem::kKV;
    const float* Tk = Ts + st * kKeys;
    handoff.wait_loaded(it);
    if (walk_stops_at<kKeys>(carry, Tk, j0, L, prune_log2)) break;
    auto prefetch_next = [&] {  // the next tile into the other stage
      if (kt - 1 < kt_lo) return;
      handoff.wait_free(it + 1);
      load_keys(kt - 1, it + 1, use_tma);
      handoff.loaded(it + 1, use_tma);
    };
    if (!handoff.decoupled) prefetch_next();

    float sc[kKeys / 2], dp[kKeys / 2];
    cute::warpgroup_arrive();
    gemm_rows_by_tile<GmmaS, kHeadDim, kBlockM, kKeys>(Qs, 64 * wg, Ks, sc);
    gemm_rows_by_tile<GmmaS, kHeadDim, kBlockM, kKeys>(dOs, 64 * wg, Vs, dp);
    cute::warpgroup_commit_batch();
    if (handoff.decoupled) prefetch_next();
    cute::warpgroup_wait<0>();
    fence_registers(sc);
    fence_registers(dp);

    // dS = P (dP - delta), P = 2^(x - lse2) (rq holds R - lse2; the tile's C joins it per row)
    const int64_t last_col[2] = {a + row_of(0) - j0, a + row_of(1) - j0};
    const float shift[2] = {rq[0] - carry, rq[1] - carry};
    auto scores_grad = [&](int i, int hi, float x) {
      const float ds = exp2f(x) * (dp[i] - delta[hi]);
      sc[i] = ds;
      rowsum[hi] += ds;
    };
    if (j0 + kKeys - 1 > a || j0 < s.first_key)
      for_each_score<true, kKeys, true>(sc, Tk, shift, scale_log2, last_col, s.first_key - j0, scores_grad);
    else
      for_each_score<false, kKeys, true>(sc, Tk, shift, scale_log2, last_col, s.first_key - j0, scores_grad);
    uint32_t ds_frag[kKeys / 16][4];
    to_a_fragments<T, kKeys>(ds_frag, sc);

    // dQ += dS K
    fence_registers(dq);
    cute::warpgroup_arrive();
    gemm_frags_by_tile<GmmaD, kKeys>(ds_frag, Ks, dq);
    cute::warpgroup_commit_batch();
    if (j0 % kBlockN == 0) carry -= Tk[0];  // crossing into the 128-tile below: C -= T[j0]
    cute::warpgroup_wait<0>();
    fence_registers(dq);
    handoff.release(it);
  }
  cp_async_wait<0>();

#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    rowsum[hi] += __shfl_xor_sync(0xffffffffu, rowsum[hi], 1);
    rowsum[hi] += __shfl_xor_sync(0xffffffffu, rowsum[hi], 2);
    const int r = row_of(hi);
    if (quad == 0 && r < nq) ws.dq_rowsum[stat + r] = rowsum[hi];
  }
  T* dq_base = static_cast<T*>(p.dq) + s.batch_index * p.dq_batch_stride +
               (s.row_q + i0) * p.dq_row_stride + h * p.dq_head_stride;
  if constexpr (kHeadDim <= 64) __syncthreads();  // (store_accumulator: staged through Q)
  store_accumulator<T, kBlockM, kHeadDim>(Qs, dq_base, p.dq_row_stride, warp_row0, nq, dq,
                                          static_cast<float>(p.scale));
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

// The fused backward's last step: dQ = scale * accumulator, rounded to T, and the row sums of dS
// (ws.dq_rowsum). Each thread takes 8 columns of a row (two 16-byte loads, one 16-byte store);
// a block takes kDqConvertRows consecutive rows of one (sequence, head) (blockIdx.x), the heads
// and sequences striding over blockIdx.y, so that a thread's index arithmetic is one 32-bit
// quotient. (One warp a row, as before, left half the lanes idle at head dim 64 and ran at half
// the bandwidth: 133 us against 79 at head dim 128 for the same 33.5M values.) Queries before
// seq_start have no keys: zeros (no key tile writes their rows when dQ is added in turns).
constexpr int kDqConvertThreads = 256;
template <int kHeadDim>
constexpr int kDqConvertRows = kDqConvertThreads / (kHeadDim / 8);
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kDqConvertThreads) dq_from_accumulator(const BackwardParams p,
                                                                           const BackwardWorkspace ws) {
  constexpr int kDqRow = kDqAccRow<kHeadDim>, kPerRow = kHeadDim / 8;
  using Mma = MmaTraits<T>;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kDqConvertRows<kHeadDim> + threadIdx.x / kPerRow;
  const int c = threadIdx.x % kPerRow;
  if (i >= p.seqlen_q) return;
  const int64_t batch = p.cu_seqlens != nullptr ? 1 : p.batch;  // (a packed batch is one row of sequences)
  const float scale = static_cast<float>(p.scale);
  // (batch * num_heads < 2^31: check_grid)
  for (int64_t bh = blockIdx.y; bh < batch * p.num_heads; bh += gridDim.y) {
    const int64_t b = quotient32(bh, p.num_heads), h = bh - b * p.num_heads;
    const int64_t r = bh * p.seqlen_q + i;  // the row of (batch, num_heads, seqlen_q)
    bool no_keys = false;
    if (p.seq_start != nullptr && p.cu_seqlens == nullptr) {  // (a packed batch has no seq_start)
      const SequenceView s = p.sequence(b);  // (with its cache_seqlens)
      no_keys = s.query_position(i) < s.first_key;
    }
    const float* acc = ws.dq_accum + r * kDqRow;
    float4 x0 = make_float4(0.f, 0.f, 0.f, 0.f), x1 = x0;
    if (!no_keys) {
      x0 = __ldcs(reinterpret_cast<const float4*>(acc + 8 * c));
      x1 = __ldcs(reinterpret_cast<const float4*>(acc + 8 * c + 4));
    }
    T* out = static_cast<T*>(p.dq) + b * p.dq_batch_stride + i * p.dq_row_stride + h * p.dq_head_stride;
    *reinterpret_cast<uint4*>(out + 8 * c) =
        make_uint4(Mma::pack(x0.x * scale, x0.y * scale), Mma::pack(x0.z * scale, x0.w * scale),
                   Mma::pack(x1.x * scale, x1.y * scale), Mma::pack(x1.z * scale, x1.w * scale));
    if (c == 0) ws.dq_rowsum[r] = no_keys ? 0.f : acc[kHeadDim];
  }
}

}  // namespace fox::cuda::hopper

namespace fox::cuda {

// The fused backward in turns: the first block of the last section of block_key_tile's order, whose
// walks go down (the grid then ends on short walks: backward -1.4% to -4.9%, bench/NOTES.md
// version 96), where at least two waves of blocks come before it; else no block's (walks down that
// start at once reach each query tile together and wait for one another's turns).
// FOX_FUSED_WALK_DOWN=1 / 0: every block's / none's (tests: the walks down at any size).
inline int64_t fused_down_from(const BackwardParams& p, int64_t key_tiles) {
  const int64_t rows = p.batch * p.num_kv_heads, blocks = rows * key_tiles;
  if (const char* forced = std::getenv("FOX_FUSED_WALK_DOWN"))  // read per call: tests set it
    return forced[0] == '1' ? 0 : blocks;
  const int64_t per_section = rows_per_section(rows, key_block_row_bytes(p), key_block_section_bytes(p));
  const int64_t first = (rows - 1) / per_section * per_section * key_tiles;
  static int sms[64] = {};
  int device = 0;
  cudaGetDevice(&device);
  int& count = sms[device & 63];
  if (count == 0 && cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    count = 0;
  return count > 0 && first >= 2 * static_cast<int64_t>(count) ? first : blocks;  // (unknown: walks up)
}

template <typename T, int kHeadDim>
void run_hopper_backward(const BackwardParams& p, const BackwardWorkspace& ws, float* gate_suffix,
                         int64_t max_len_q, int64_t max_len_k, cudaStream_t stream) {
  using namespace hopper;
  // The fused form needs the decoupled stage handoff (tiles by TMA): its math warpgroups have no
  // block barrier to share with the writer's.
  const TileMaps maps = make_query_grad_maps(p, std::is_same_v<T, __nv_bfloat16>, kDkdvQueries<kHeadDim>);
  const bool fused = ws.dq_accum != nullptr && maps.enabled != 0 && FOX_HOPPER_DKDV_DECOUPLED;
  auto dkdv = fused ? dkdv_kernel<T, kHeadDim, true> : dkdv_kernel<T, kHeadDim, false>;
  auto dq = dq_kernel<T, kHeadDim>;
  generic::launch_delta<T>(p, ws.delta, stream);
  const int64_t key_tiles = (max_len_k + kBlockN - 1) / kBlockN;
  if (key_tiles * p.num_heads * p.batch > 0)
    gate_suffix_kernel<kBlockN><<<static_cast<unsigned>(key_tiles * p.num_heads * p.batch), kBlockN, 0, stream>>>(
        p, gate_suffix, key_tiles, ws.query_bias);
  const int64_t kv_blocks = key_tiles * p.num_kv_heads * p.batch;
  if (kv_blocks > 0) {
    const size_t smem = fused ? DkdvSmem<kHeadDim, true>::kAllocBytes : DkdvSmem<kHeadDim, false>::kAllocBytes;
    cudaFuncSetAttribute(dkdv, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    const int threads = fused ? kDkdvThreads<true> : kDkdvThreads<false>;
    const int64_t down_from = fused && ws.dq_turns != nullptr ? fused_down_from(p, key_tiles) : kv_blocks;
    dkdv<<<static_cast<unsigned>(kv_blocks), threads, smem, stream>>>(p, ws, gate_suffix, key_tiles, maps,
                                                                      down_from);
  }
  if (fused) {
    const int64_t heads = (p.cu_seqlens != nullptr ? 1 : p.batch) * p.num_heads;
    const int64_t row_blocks = (p.seqlen_q + kDqConvertRows<kHeadDim> - 1) / kDqConvertRows<kHeadDim>;
    if (heads > 0 && row_blocks > 0)
      dq_from_accumulator<T, kHeadDim>
          <<<dim3(static_cast<unsigned>(row_blocks), static_cast<unsigned>(std::min<int64_t>(heads, 65535))),
             kDqConvertThreads, 0, stream>>>(p, ws);
    generic::launch_gate_grad(p, ws, max_len_k, stream);
    return;
  }
  const int64_t q_tiles = (max_len_q + kBlockM - 1) / kBlockM;
  const int64_t q_blocks = q_tiles * p.num_heads * p.batch;
  if (q_blocks > 0) {
    constexpr size_t smem = DqSmem<kHeadDim>::kAllocBytes;
    cudaFuncSetAttribute(dq, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    const TileMaps maps = make_key_value_maps(p, std::is_same_v<T, __nv_bfloat16>, kDqKeys<kHeadDim>);
    dq<<<static_cast<unsigned>(q_blocks), kThreads, smem, stream>>>(p, ws, gate_suffix, q_tiles, maps);
  }
  generic::launch_gate_grad(p, ws, max_len_k, stream);
}

}  // namespace fox::cuda
