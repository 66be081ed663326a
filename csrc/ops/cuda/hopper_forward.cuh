// Hopper (sm_90a) forward of Forgetting Attention for head dim 64 / 128 in fp16 / bf16: warpgroup
// MMA (wgmma) with operands in shared memory, so the tensor cores no longer wait on ldmatrix.
//
// A block of two warpgroups owns 128 queries of one (sequence, head); each warpgroup owns 64 rows
// and keeps S and O in registers (wgmma accumulators). Key tiles of 128 keys are walked from the
// diagonal downwards, staged in shared memory in the 128-byte-swizzled layout that wgmma reads
// directly (by TMA where the layout allows it, else by cp.async): S = Q K^T with both operands in
// shared memory (K-major), O += P V with P from registers and V read transposed (MN-major). Two
// kernels:
// - forward_kernel (head dim 64, layouts TMA cannot take, split-KV decoding): every thread
//   computes; the stages pass between the threads through TileHandoff, a block barrier per tile
//   or mbarriers that let the two warpgroups drift apart.
// - forward_kernel_ws (head dim 128 with TMA): FlashAttention-3's warp specialisation, a producer
//   warpgroup and two math warpgroups that take turns at the tensor cores; persistent (one block
//   an SM walks one query tile after another, the next one's tiles and queries loaded under the
//   current one).
//
// Gate bias without a serial walk: a pre-pass writes, per 128-key tile t, the tile-local suffix
// sums T_t[j] = sum of g over (j, (t+1)*128] (fp32, at most 128 terms; stored times log2(e), the
// units of the kernels' exponents). Relative to the first query
// a of the block, R_j = C_t - T_t[j] for every key and query position j of tile t, with
// C_{t_a} = T_{t_a}[a] and C_{t-1} = C_t - T_t[t*128] (C_{t+1} = C_t + T_{t+1}[(t+1)*128]): one
// load and one subtraction per key, errors growing with the distance from a, never with the
// absolute position (design.md section 1).
#pragma once

#include <type_traits>
#include <utility>

#include <cute/arch/mma_sm90_gmma.hpp>

#include "common.cuh"
#include "generic_kernels.cuh"
#include "launch.h"
#include "mma.cuh"
#include "tma.h"

namespace fox::cuda::hopper {

namespace gmma = cute::SM90::GMMA;

constexpr int kWarpGroups = 2;
constexpr int kThreads = 128 * kWarpGroups;
constexpr int kWarps = kThreads / 32;
constexpr int kBlockM = 64 * kWarpGroups;  // queries per block
constexpr int kBlockN = 128;               // keys per tile

// The wgmma instructions used: S (64 x 128 keys, both operands in shared memory) and O += P V
// (64 x head dim, P in registers, V transposed).
template <typename T, int N>
struct Gmma;
template <>
struct Gmma<__nv_bfloat16, 64> {
  using SS = gmma::MMA_64x64x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>;
  using RS = gmma::MMA_64x64x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>;
};
template <>
struct Gmma<__nv_bfloat16, 128> {
  using SS = gmma::MMA_64x128x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>;
  using RS = gmma::MMA_64x128x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>;
};
template <>
struct Gmma<__half, 64> {
  using SS = gmma::MMA_64x64x16_F32F16F16_SS<gmma::Major::K, gmma::Major::K>;
  using RS = gmma::MMA_64x64x16_F32F16F16_RS<gmma::Major::K, gmma::Major::MN>;
};
template <>
struct Gmma<__half, 128> {
  using SS = gmma::MMA_64x128x16_F32F16F16_SS<gmma::Major::K, gmma::Major::K>;
  using RS = gmma::MMA_64x128x16_F32F16F16_RS<gmma::Major::K, gmma::Major::MN>;
};

// Accumulator arrays are passed element by element (the instruction names every register).
template <class Op, int N, size_t... I>
__device__ __forceinline__ void gmma_ss(uint64_t a, uint64_t b, float (&d)[N],
                                        gmma::ScaleOut scale, std::index_sequence<I...>) {
  Op::fma(a, b, d[I]..., scale);
}
template <class Op, int N>
__device__ __forceinline__ void gmma_ss(uint64_t a, uint64_t b, float (&d)[N], bool accumulate) {
  gmma_ss<Op>(a, b, d, accumulate ? gmma::ScaleOut::One : gmma::ScaleOut::Zero,
              std::make_index_sequence<N>{});
}
template <class Op, int N, size_t... I>
__device__ __forceinline__ void gmma_rs(const uint32_t (&a)[4], uint64_t b, float (&d)[N],
                                        std::index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], b, d[I]..., gmma::ScaleOut::One);
}
template <class Op, int N>
__device__ __forceinline__ void gmma_rs(const uint32_t (&a)[4], uint64_t b, float (&d)[N]) {
  gmma_rs<Op>(a, b, d, std::make_index_sequence<N>{});
}
template <int N>
__device__ __forceinline__ void fence_registers(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) cute::warpgroup_fence_operand(d[i]);
}

// x as the compiler sees it when read from lane 0: the same in the whole warp, so that what derives
// from it (the wgmma descriptors of the warpgroup's rows and of the stage) stays in uniform
// registers instead of being rebuilt in every thread before every wgmma.
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

// Shared-memory tiles: rows of 64 elements (128 bytes) per 64-column block, blocks one after the
// other ([column block][row][64]); the 16-byte chunk c of row r sits at chunk c ^ (r % 8), the
// hardware's 128-byte swizzle (tiles start 1024-byte aligned).
__device__ __forceinline__ int sw128_offset(int row, int chunk, int rows) {
  return (chunk >> 3) * rows * 64 + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

// wgmma shared-memory descriptor for a 128-byte-swizzled operand: start address, leading and
// stride byte offsets (all in 16-byte units), layout type 1 = 128-byte swizzle. The address field
// is built once per tile (tile_address) and each k-step adds its constant offset to the low word
// (the field has room: shared addresses stay below 2^18): with warp-uniform tile addresses
// (warp_uniform) about 4 uniform-register instructions per wgmma instead of the ~10 of
// rebuilding the descriptor from a pointer in every thread.
__device__ __forceinline__ uint32_t tile_address(const void* p) { return (smem_address(p) & 0x3FFFF) >> 4; }
template <uint32_t kOffsetBytes, uint32_t kLeadingBytes, uint32_t kStrideBytes>
__device__ __forceinline__ uint64_t sw128_descriptor(uint32_t address) {
  constexpr uint32_t kLow = (kOffsetBytes >> 4) + ((kLeadingBytes >> 4) << 16);
  constexpr uint32_t kHigh = (kStrideBytes >> 4) | (1u << 30);
  return static_cast<uint64_t>(kHigh) << 32 | (address + kLow);
}

// acc (64 x N) = rows [a_row0, a_row0 + 64) of tile A (kARows x kHeadDim) times the transpose of
// tile B (N x kHeadDim): both K-major, k-steps of 16 columns (32 bytes inside a 128-byte row,
// then the next 64-column block).
template <class Op, int kHeadDim, int kARows, int kBRows, typename T, int N, int... KS>
__device__ __forceinline__ void gemm_rows_by_tile(uint32_t a, uint32_t b, float (&acc)[N],
                                                  std::integer_sequence<int, KS...>) {
  (gmma_ss<Op>(sw128_descriptor<((KS / 4) * kARows * 64 + (KS % 4) * 16) * sizeof(T), 16, 1024>(a),
               sw128_descriptor<((KS / 4) * kBRows * 64 + (KS % 4) * 16) * sizeof(T), 16, 1024>(b), acc,
               KS > 0),
   ...);
}
template <class Op, int kHeadDim, int kARows, int kBRows, typename T, int N>
__device__ __forceinline__ void gemm_rows_by_tile(const T* a, int a_row0, const T* b,
                                                  float (&acc)[N]) {
  gemm_rows_by_tile<Op, kHeadDim, kARows, kBRows, T>(tile_address(a + a_row0 * 64), tile_address(b),
                                                     acc, std::make_integer_sequence<int, kHeadDim / 16>{});
}

// acc (64 x head dim) += P (64 x 16 kSteps, A fragments of kSteps k-steps) times the first 16
// kSteps rows of tile B (kRows x head dim) read transposed: its rows are the k dimension (leading
// byte offset: the next 64-column block of the tile).
template <class Op, int kRows, typename T, int N, int kSteps, int... KS>
__device__ __forceinline__ void gemm_frags_by_tile(const uint32_t (&frags)[kSteps][4], uint32_t b,
                                                   float (&acc)[N], std::integer_sequence<int, KS...>) {
  (gmma_rs<Op>(frags[KS], sw128_descriptor<KS * 16 * 64 * sizeof(T), kRows * 128, 1024>(b), acc), ...);
}
template <class Op, int kRows, typename T, int N, int kSteps>
__device__ __forceinline__ void gemm_frags_by_tile(const uint32_t (&frags)[kSteps][4], const T* b,
                                                   float (&acc)[N]) {
  static_assert(16 * kSteps <= kRows, "the k-steps must lie inside the tile");
  gemm_frags_by_tile<Op, kRows, T>(frags, tile_address(b), acc, std::make_integer_sequence<int, kSteps>{});
}

// T of this thread's key columns of a tile (the pairs 8n + 2 quad, +1), from shared memory: where
// it is read (suffix_pair), or all of it into registers beforehand (SuffixInRegisters: loaded
// while the products run, the scores' FFMAs no longer wait on the loads; the warp-specialised
// forward, version 76).
__device__ __forceinline__ float2 suffix_pair(const float* Tk, int n, int quad) {
  return *reinterpret_cast<const float2*>(Tk + n * 8 + quad * 2);
}
template <int kCols>
struct SuffixInRegisters {
  float2 pair[kCols / 8];
  __device__ __forceinline__ void load(const float* Tk) {
#pragma unroll
    for (int n = 0; n < kCols / 8; ++n) pair[n] = suffix_pair(Tk, n, threadIdx.x & 3);
  }
};
template <int kCols>
__device__ __forceinline__ float2 suffix_pair(const SuffixInRegisters<kCols>& t, int n, int) {
  return t.pair[n];
}

// The scores of this thread's two rows (hi = 0, 1) against a tile of kCols keys, log2 domain:
// x = S * scale_log2 + T_j (+ shift[hi] with kRowTerm), -inf past column last_col[hi] (causal) or
// before first_col (first_key) when kMasked. Hands every (accumulator index, hi, x) to `use`.
// T_j is in log2 units (gate_suffix_kernel), so the bias -R_j = T_j - C costs no arithmetic per
// key: the tile's C and the row terms ride in one shift per row (the forward leaves it out of x
// and moves its row maximum instead: a softmax does not change under a constant per row).
template <bool kMasked, int kCols, bool kRowTerm, class Use, class Suffix = const float*, class Index = int64_t>
__device__ __forceinline__ void for_each_score(const float (&sc)[kCols / 2], const Suffix& Tk,
                                               const float (&shift)[2], float scale_log2,
                                               const Index (&last_col)[2], Index first_col, Use&& use) {
  const int quad = threadIdx.x & 3;
  int hi_col[2] = {0, 0}, lo_col = 0;
  if constexpr (kMasked) {  // int32 column limits relative to the tile
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) hi_col[hi] = static_cast<int>(max(Index{-1}, min(Index{kCols}, last_col[hi])));
    lo_col = static_cast<int>(max(Index{0}, min(Index{kCols}, first_col)));
  }
#pragma unroll
  for (int n = 0; n < kCols / 8; ++n) {
    const float2 t2 = suffix_pair(Tk, n, quad);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int hi = e >> 1;
      float x = fmaf(sc[4 * n + e], scale_log2, (e & 1) ? t2.y : t2.x);
      if constexpr (kRowTerm) x += shift[hi];
      if constexpr (kMasked) {
        const int col = n * 8 + quad * 2 + (e & 1);
        if (col > hi_col[hi] || col < lo_col) x = -INFINITY;
      }
      use(4 * n + e, hi, x);
    }
  }
}

// Rows [0, rows) of a kRows x kHeadDim tile into shared memory (zeros in the other rows), by the
// block's first kLoaders threads (or one warp of a producer: kLoaders = 32).
template <typename T, int kRows, int kHeadDim, int kLoaders = kThreads>
__device__ __forceinline__ void load_tile(T* smem, const T* src, int64_t ld, int rows) {
  constexpr int kChunks = kHeadDim / 8;
  static_assert(kRows * kChunks % kLoaders == 0, "tile must split evenly over the threads");
  // (unrolled for the block's threads; a producer warp, short of registers, keeps the loop)
#pragma unroll(kLoaders >= kThreads ? kRows * kChunks / kLoaders : 1)
  for (int i = 0; i < kRows * kChunks / kLoaders; ++i) {
    const int idx = threadIdx.x % kLoaders + i * kLoaders;
    const int row = idx / kChunks, chunk = idx % kChunks;
    const bool valid = row < rows;
    cp_async_16(smem + sw128_offset(row, chunk, kRows), src + (valid ? row : 0) * ld + chunk * 8,
                valid);
  }
}

// Named barrier kId of kCount threads: wait there, or arrive without waiting. The id is an
// immediate (a register id reserves all 16 barriers).
template <int kId, int kCount>
__device__ __forceinline__ void named_barrier_sync() {
  asm volatile("bar.sync %0, %1;" ::"n"(kId), "n"(kCount) : "memory");
}
template <int kId, int kCount>
__device__ __forceinline__ void named_barrier_arrive() {
  asm volatile("bar.arrive %0, %1;" ::"n"(kId), "n"(kCount) : "memory");
}
// Named barrier kFirst + wg, for math warpgroup `wg` (0 or 1).
template <int kFirst, int kCount>
__device__ __forceinline__ void warpgroup_pair_sync(int wg) {
  if (wg == 0)
    named_barrier_sync<kFirst, kCount>();
  else
    named_barrier_sync<kFirst + 1, kCount>();
}
template <int kFirst, int kCount>
__device__ __forceinline__ void warpgroup_pair_arrive(int wg) {
  if (wg == 0)
    named_barrier_arrive<kFirst, kCount>();
  else
    named_barrier_arrive<kFirst + 1, kCount>();
}

// The threads of math warpgroup `wg` meet: named barrier 1 + wg.
__device__ __forceinline__ void warpgroup_barrier(int wg) { warpgroup_pair_sync<1, 128>(wg); }

// This warpgroup's 64 rows of a kRows x kHeadDim accumulator tile (rows warp_row0 + group + 8 hi
// of this thread, as wgmma leaves them, times row_scale[hi]) to rows [0, nrows) of `out`, through
// `stage`: a shared-memory tile of load_tile's layout whose rows of this warpgroup nothing reads
// any more. Stored straight from the accumulators, a lane writes 4 bytes and an instruction 16
// bytes of each of 8 rows (half an L2 sector): the forward's epilogue took ~1.8 us a block (N=2k,
// D=128, 7% of a block's life). Through shared memory (the swizzle puts a warp's 32 lanes on 32
// banks) a warp writes whole rows in 16-byte pieces.
// The caller passes a block barrier first: every thread loaded rows of the tile, and the barrier
// (after each thread's cp_async_wait) orders those copies before these writes in a form that
// compute-sanitizer's racecheck follows. It costs the block nothing: the warpgroup that arrives
// last does not wait.
template <typename T, int kRows, int kHeadDim>
__device__ __forceinline__ void store_rows_staged(T* stage, const float (&acc)[kHeadDim / 2],
                                                  const float (&row_scale)[2], T* out, int64_t row_stride,
                                                  int nrows) {
  using Mma = MmaTraits<T>;
  const int lane = threadIdx.x & 31, wg = threadIdx.x >> 7, group = lane >> 2, quad = lane & 3;
  const int warp_row0 = 64 * wg + 16 * ((threadIdx.x >> 5) & 3);
  if (64 * wg >= nrows) return;  // (the same choice in the whole warpgroup)
#pragma unroll
  for (int hi = 0; hi < 2; ++hi)
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n)
      *reinterpret_cast<uint32_t*>(stage + sw128_offset(warp_row0 + group + 8 * hi, n, kRows) + quad * 2) =
          Mma::pack(acc[4 * n + 2 * hi] * row_scale[hi], acc[4 * n + 2 * hi + 1] * row_scale[hi]);
  warpgroup_barrier(wg);
  constexpr int kChunks = kHeadDim / 8;  // 16-byte pieces of a row
#pragma unroll
  for (int i = threadIdx.x & 127; i < 64 * kChunks; i += 128) {
    const int r = 64 * wg + i / kChunks, c = i % kChunks;
    if (r < nrows)
      *reinterpret_cast<uint4*>(out + r * row_stride + c * 8) =
          *reinterpret_cast<const uint4*>(stage + sw128_offset(r, c, kRows));
  }
}

// mbarriers in shared memory (TileHandoff below).
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_address(bar)) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar, int count) {  // count arrivals at once
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(bar)), "r"(count) : "memory");
}
// Arrives on bar once every cp.async this thread has issued so far has landed (counts as one of
// the barrier's expected arrivals).
// (The copies are also committed as a group, so that cp_async_wait<0> still covers them.)
__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_address(bar)) : "memory");
  cp_async_commit();
}
// Waits until the phase of the given parity has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(smem_address(bar)),
      "r"(parity)
      : "memory");
}

// One arrival on bar that also expects `bytes` more to land by bulk copies before the phase ends.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(bar)),
               "r"(bytes)
               : "memory");
}

// Bulk tensor copy of the box at (column, row, head, batch) of `map` into shared memory; its bytes
// count towards the transaction of bar's current phase.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, int column, int64_t row,
                                         int64_t head, int64_t batch, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, "
      "%4, %5}], [%6];\n" ::"r"(smem_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(column), "r"(static_cast<int>(row)),
      "r"(static_cast<int>(head)), "r"(static_cast<int>(batch)), "r"(smem_address(bar))
      : "memory");
}

// Writes by the threads (cp.async lands through the generic proxy) become visible to wgmma.
__device__ __forceinline__ void fence_async_proxy() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Handoff of the two stages of a walked tile sequence (tile `it` in stage it % 2) between the
// threads of a block. With a barrier: a tile is readable once every thread has waited for its
// copies and passed __syncthreads, which also tells that the other stage is free. Decoupled:
// full[st] completes when the copies of every thread into stage st have landed, empty[st] when
// every thread is done reading it; no thread waits for the others except on a stage it is about
// to read or overwrite, so the warpgroups can drift apart and one warpgroup's softmax runs under
// the other's wgmma.
// With `tma`, thread 0 may copy a tile pair by TMA (copy()), which completes on full[st] with its
// byte count; full[st] then counts one arrival of thread 0 per tile (a plain one for tiles loaded
// by cp.async), so that every tile completes one phase and `it` gives the parity in both modes.
struct TileHandoff {
  static constexpr size_t kBytes = 4 * sizeof(uint64_t);
  uint64_t* full;
  uint64_t* empty;
  bool decoupled;
  bool tma;

  // Thread 0 initialises the barriers: a __syncthreads must follow before any use. With
  // `producer_arrivals` >= 0 a producer warp of a warp-specialised kernel fills the stages (full
  // expects that many arrivals), and the math threads only wait and release (decoupled).
  __device__ __forceinline__ TileHandoff(void* storage, bool decoupled_, bool tma_ = false,
                                         int producer_arrivals = -1)
      : full(static_cast<uint64_t*>(storage)), empty(full + 2), decoupled(decoupled_), tma(tma_) {
    if (threadIdx.x != 0 || !(decoupled || tma)) return;
    for (int st = 0; st < 2; ++st) {
      mbarrier_init(full + st, producer_arrivals >= 0 ? producer_arrivals
                                                      : (decoupled ? kThreads : 0) + (tma ? 1 : 0));
      if (decoupled) mbarrier_init(empty + st, kThreads);
    }
    fence_async_proxy();  // the initialised barriers, for the copy engine
  }
  // Rows [row, row + kRows) of (head, batch) of both maps into a and b (tiles of kRows x kHeadDim
  // in the layout of load_tile), stage of tile `it`, by TMA. Called by every thread (`issuer`,
  // thread 0 unless a producer warp names its lane, issues) once the stage is free, before
  // loaded(it, true).
  template <int kRows, int kHeadDim, typename T>
  __device__ __forceinline__ void copy(T* a, T* b, const TileMaps& maps, int it, int64_t row, int64_t head,
                                       int64_t batch, bool issuer = threadIdx.x == 0) const {
    if (!issuer) return;
    uint64_t* bar = full + (it & 1);
    mbarrier_arrive_expect_tx(bar, 2 * kRows * kHeadDim * sizeof(T));
#pragma unroll
    for (int cb = 0; cb < kHeadDim / 64; ++cb) {
      tma_load(a + cb * kRows * 64, &maps.first, 64 * cb, row, head, batch, bar);
      tma_load(b + cb * kRows * 64, &maps.second, 64 * cb, row, head, batch, bar);
    }
  }
  // This thread has issued its copies of tile `it` (`by_tma`: the tile came by copy()).
  __device__ __forceinline__ void loaded(int it, bool by_tma = false) const {
    if (tma && !by_tma && threadIdx.x == 0) mbarrier_arrive(full + (it & 1));
    if (decoupled)
      cp_async_arrive(full + (it & 1));
    else
      cp_async_commit();
  }
  // Waits until tile `it` is readable (with a barrier: and every thread is done with tile it - 1).
  __device__ __forceinline__ void wait_loaded(int it) const {
    if (decoupled || tma) mbarrier_wait(full + (it & 1), static_cast<uint32_t>((it >> 1) & 1));
    if (!decoupled) {
      cp_async_wait<0>();
      fence_async_proxy();
      __syncthreads();
    } else {
      fence_async_proxy();
    }
  }
  // Before loading tile `it`: every thread is done with tile it - 2 in the same stage.
  __device__ __forceinline__ void wait_free(int it) const {
    if (decoupled && it >= 2) mbarrier_wait(empty + (it & 1), static_cast<uint32_t>(((it - 2) >> 1) & 1));
  }
  // This thread is done reading tile `it`.
  __device__ __forceinline__ void release(int it) const {
    if (decoupled) mbarrier_arrive(empty + (it & 1));
  }
};

// T_t[j] (log2 units) for every key j of every (sequence, head): one block of kKeys threads per
// key tile. `suffix` is laid out (batch, num_heads, seqlen_k) like the keys. With `query_bias`
// (the backward), also -(T + lse) in log2 units for every query, laid out like lse: the dK/dV
// kernel's per-query term (query i sits at key position i + len_k - len_q). With `tile_counter`
// (the persistent forward's), block 0 zeroes it. (A template: one copy per instantiation file is
// fine.)
template <int kKeys>
__global__ void __launch_bounds__(kKeys) gate_suffix_kernel(const ForwardParams p, float* suffix,
                                                            int64_t num_tiles, float* query_bias,
                                                            int* tile_counter = nullptr) {
  __shared__ float warp_totals[kKeys / 32];
  const int64_t b = blockIdx.x;
  if (tile_counter != nullptr && b == 0 && threadIdx.x == 0) *tile_counter = 0;
  // (32-bit quotients: block indices stay below 2^31)
  const int64_t tile_row = quotient32(b, num_tiles), t = b - tile_row * num_tiles;
  const int64_t seq = quotient32(tile_row, p.num_heads), h = tile_row - seq * p.num_heads;
  const SequenceView s = p.sequence(seq);
  const int64_t j0 = t * kKeys;
  if (j0 >= s.len_k) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t j = j0 + threadIdx.x;
  const float* g = static_cast<const float*>(p.log_fgate) + s.batch_index * p.g_batch_stride +
                   s.row_k * p.g_row_stride + h * p.g_head_stride;
  const float term = j + 1 < s.len_k ? g[(j + 1) * p.g_row_stride] : 0.f;
  float x = warp_inclusive_suffix_scan(term, lane);
  if (lane == 0) warp_totals[warp] = x;
  __syncthreads();
#pragma unroll
  for (int w = 1; w < kKeys / 32; ++w)
    if (w > warp) x += warp_totals[w];
  if (j >= s.len_k) return;
  const float t2 = x * kLog2e;
  suffix[(s.batch_index * p.num_heads + h) * p.seqlen_k + s.row_k + j] = t2;
  const int64_t i = j - (s.len_k - s.len_q);
  if (query_bias != nullptr && i >= 0) {
    const int64_t stat = row_stat_offset(p, s, h) + i;
    query_bias[stat] = -(t2 + static_cast<const float*>(p.lse)[stat] * kLog2e);
  }
}

// C of the tile of the block's first query a and of the tile above it (the block's queries span
// at most these two), and the C the walk starts from (at the tile of the diagonal).
struct GateAnchor {
  int64_t ta;
  float c_a, c_above;
  __device__ __forceinline__ GateAnchor(const float* T_, int64_t a, int64_t len_k)
      : ta(a / kBlockN), c_a(T_[a]),
        c_above(ta + 1 < (len_k + kBlockN - 1) / kBlockN ? c_a + T_[(ta + 1) * kBlockN] : 0.f) {}
  __device__ __forceinline__ GateAnchor(int64_t a, float c_a_, float c_above_)  // (values loaded elsewhere)
      : ta(a / kBlockN), c_a(c_a_), c_above(c_above_) {}
  __device__ __forceinline__ float carry_at(int64_t kt) const { return kt == ta ? c_a : c_above; }
  // R of the query at position pos (log2 domain; added to its lse at the end).
  __device__ __forceinline__ float query_term(const float* T_, int64_t pos) const {
    return (pos / kBlockN == ta ? c_a : c_above) - T_[pos];
  }
};

// Pruning: whether a walk down the key tiles stops at the tile whose keys start at j0 (T of its
// keys at Tk, C of its 128-tile `carry`, L the walk's last key): its largest bias, at its top key,
// under the threshold. One function for every place that decides, so that the producer of a
// warp-specialised walk and its math threads decide alike, bit for bit.
template <int kKeys, class Index>
__device__ __forceinline__ bool walk_stops_at(float carry, const float* Tk, Index j0, Index L, float prune_log2) {
  // (Without pruning, -inf: no read of T, which the walk would otherwise wait on every tile.)
  return prune_log2 > -INFINITY && -(carry - Tk[min(Index{kKeys - 1}, L - j0)]) < prune_log2;
}

// The online softmax of one key tile for this thread's two query rows, log2 domain: the scores
// sc of S = Q K^T become x = S * scale_log2 + T_j (masked to -inf where `masked` and outside
// (first_col, last_col[hi]]), the row maxima move, and sc ends holding p = exp2(x - max). The
// scores are x' = x + C (C = carry): row_max stays in the frame of x, the exponent subtracts
// row_max + C. correction[hi] rescales what the row had (O, its sum), tile_sum[hi] is the sum of
// its new p.
template <int kCols, class Suffix, class Index>
__device__ __forceinline__ void softmax_tile(float (&sc)[kCols / 2], const Suffix& Tk, float carry,
                                             float scale_log2, bool masked, const Index (&last_col)[2],
                                             Index first_col, float (&row_max)[2], float (&correction)[2],
                                             float (&tile_sum)[2]) {
  float tile_max[2] = {-INFINITY, -INFINITY};
  const float no_shift[2] = {0.f, 0.f};
  auto bias_and_max = [&](int i, int hi, float x) {
    sc[i] = x;
    tile_max[hi] = fmaxf(tile_max[hi], x);
  };
  if (masked)  // the tiles that cross the diagonal or first_key
    for_each_score<true, kCols, false>(sc, Tk, no_shift, scale_log2, last_col, first_col, bias_and_max);
  else
    for_each_score<false, kCols, false>(sc, Tk, no_shift, scale_log2, last_col, first_col, bias_and_max);
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    float m = tile_max[hi];
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    const float new_max = fmaxf(row_max[hi], m - carry);
    // A row that has seen no key yet keeps max -inf: subtract 0 instead (all its p are 0).
    const float base_max = new_max == -INFINITY ? 0.f : new_max;
    correction[hi] = exp2f(row_max[hi] - base_max);
    row_max[hi] = new_max;
    tile_max[hi] = base_max + carry;  // the exponent's shift in the frame of x'
    tile_sum[hi] = 0.f;
  }
#pragma unroll
  for (int n = 0; n < kCols / 8; ++n) {
    sc[4 * n + 0] = exp2f(sc[4 * n + 0] - tile_max[0]);
    sc[4 * n + 1] = exp2f(sc[4 * n + 1] - tile_max[0]);
    sc[4 * n + 2] = exp2f(sc[4 * n + 2] - tile_max[1]);
    sc[4 * n + 3] = exp2f(sc[4 * n + 3] - tile_max[1]);
    tile_sum[0] += sc[4 * n + 0] + sc[4 * n + 1];
    tile_sum[1] += sc[4 * n + 2] + sc[4 * n + 3];
  }
}

// After softmax_tile (and once no product writes O any more): O and the row sums rescaled to the
// new maxima, P packed into the A-operand layout (the accumulators of 8-column chunks 2k, 2k+1
// form k-step k).
template <typename T, int kHeadDim, int kCols>
__device__ __forceinline__ void rescale_and_pack(const float (&sc)[kCols / 2], const float (&correction)[2],
                                                 const float (&tile_sum)[2], float (&o)[kHeadDim / 2],
                                                 float (&row_sum)[2], uint32_t (&p_frag)[kCols / 16][4]) {
  using Mma = MmaTraits<T>;
#pragma unroll
  for (int n = 0; n < kCols / 8; ++n) {  // first: the scores' registers free up
    p_frag[n / 2][(n & 1) * 2 + 0] = Mma::pack(sc[4 * n + 0], sc[4 * n + 1]);
    p_frag[n / 2][(n & 1) * 2 + 1] = Mma::pack(sc[4 * n + 2], sc[4 * n + 3]);
  }
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) row_sum[hi] = row_sum[hi] * correction[hi] + tile_sum[hi];
#pragma unroll
  for (int n = 0; n < kHeadDim / 8; ++n) {
    o[4 * n + 0] *= correction[0];
    o[4 * n + 1] *= correction[0];
    o[4 * n + 2] *= correction[1];
    o[4 * n + 3] *= correction[1];
  }
}

// At the end of the walk: the rows' sums over the quad and 1 / sum (0 for a row without keys).
__device__ __forceinline__ void finish_row_sums(float (&row_sum)[2], float (&inv)[2]) {
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    row_sum[hi] += __shfl_xor_sync(0xffffffffu, row_sum[hi], 1);
    row_sum[hi] += __shfl_xor_sync(0xffffffffu, row_sum[hi], 2);
    inv[hi] = row_sum[hi] == 0.f ? 0.f : 1.f / row_sum[hi];
  }
}
// A row's lse in log2 units from its finished sum and maximum, rq its gate term (-inf: no keys).
__device__ __forceinline__ float row_lse2(float row_sum, float row_max, float rq) {
  return row_sum == 0.f ? -INFINITY : row_max + log2f(row_sum) + rq;
}

template <int kHeadDim>
struct ForwardSmem {
  static constexpr int kQ = kBlockM * kHeadDim;     // elements
  static constexpr int kTile = kBlockN * kHeadDim;  // one K or V tile
  static constexpr size_t kBytesTiles = 2 * (kQ + 4 * kTile);  // Q, 2 stages of (K, V)
  static constexpr size_t kBytesT = sizeof(float) * 2 * kBlockN;  // 2 stages of T
  static constexpr size_t kBytes = kBytesTiles + kBytesT + TileHandoff::kBytes;
  static constexpr size_t kAllocBytes = kBytes + 1024;  // slack to align the base to 1024 bytes
};

// The warp-specialised forward (forward_kernel_ws) where the tiles come by TMA: 1 at head dim
// 128 (-10% forward time at N=2k, -15% at 16k); at head dim 64 (FOX_HOPPER_FWD_WS_64=1) its one
// block per SM measured +13% at N=2k and +4% at 16k against forward_kernel's two.
#ifndef FOX_HOPPER_FWD_WS
#define FOX_HOPPER_FWD_WS 1
#endif
#ifndef FOX_HOPPER_FWD_WS_64
#define FOX_HOPPER_FWD_WS_64 0
#endif

// Blocks per SM: for head dim 64 two blocks fit in shared memory; their softmax and matrix work
// overlap, at the price of a 128-register cap.
#ifndef FOX_HOPPER_FWD_MIN_BLOCKS_64
#define FOX_HOPPER_FWD_MIN_BLOCKS_64 2
#endif
template <int kHeadDim>
constexpr int kMinBlocks = kHeadDim <= 64 ? FOX_HOPPER_FWD_MIN_BLOCKS_64 : 1;

// The decoupled stage handoff also where the tiles come by TMA (forward and dQ kernels at head
// dim 128; 0 for one barrier per tile there, to compare).
#ifndef FOX_HOPPER_TMA_DECOUPLED
#define FOX_HOPPER_TMA_DECOUPLED 1
#endif

// The decoupled handoff in the head-dim-64 forward too: -1.2% forward time at N=2k and -2.4% at
// 16k (version 60; version 30's code measured -1.5% and kept the barrier). 0: one barrier per tile.
#ifndef FOX_HOPPER_FWD_DECOUPLED_64
#define FOX_HOPPER_FWD_DECOUPLED_64 1
#endif

// kSplit: split-KV decoding (one query tile; one block per (sequence, head, chunk of key tiles)
// writes a partial result in fp32 with its log2-domain lse, merged by
// generic::split_combine_kernel); num_tiles is then the number of chunks.
// kTmaWalk (prefill without pruning where the maps allow TMA and a query tile holds more than 64
// rows): what the general kernel decides per block is known when it compiles: the tiles come by
// TMA, the handoff is decoupled, both warpgroups walk, also in a block of 64 queries or fewer (the
// last of a sequence), whose second warpgroup then computes rows it does not store, and no walk
// stops early. Its tile loop loses the branches on those values and the registers they held: the
// D=64 forward -4% to -5% (H200, bench/NOTES.md version 98), the same bits.
template <typename T, int kHeadDim, bool kSplit, bool kTmaWalk = false>
__global__ void __launch_bounds__(kThreads, kMinBlocks<kHeadDim>)
    forward_kernel(const ForwardParams p, const SplitKVParams split,
                   const float* __restrict__ suffix, int64_t num_tiles,
                   const __grid_constant__ TileMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(!(kSplit && kTmaWalk), "split-KV decoding loads by cp.async");
  using Smem = ForwardSmem<kHeadDim>;
  using GmmaPV = typename Gmma<T, kHeadDim>::RS;
  constexpr int kDimChunks = kHeadDim / 8;  // 8-column chunks of O
  extern __shared__ unsigned char smem_raw[];
  unsigned char* base = smem_raw + ((1024 - smem_address(smem_raw) % 1024) % 1024);
  T* Qs = reinterpret_cast<T*>(base);
  T* KV = Qs + Smem::kQ;  // stage s: K at KV + 2s * tile, V at KV + (2s + 1) * tile
  float* Ts = reinterpret_cast<float*>(base + Smem::kBytesTiles);  // stage s: T of its keys
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp_uniform(warp >> 2);
  const int group = lane >> 2, quad = lane & 3;
  const int warp_row0 = 64 * wg + 16 * (warp & 3);  // this warp's first query row in the block

  const int64_t b = blockIdx.x;  // (kSplit: b % num_tiles is the block's key chunk)
  const QueryTile qt = block_query_tile(p, num_tiles, kBlockM, kSplit);
  if (qt.nq == 0) return;
  const SequenceView s = qt.s;
  const int64_t h = qt.h, i0 = qt.i0;
  // Positions inside the sequence in 32 bits (the op takes this kernel for sequences below 2^31).
  const int a = static_cast<int>(qt.a), L = static_cast<int>(qt.L), first_key = static_cast<int>(s.first_key);
  const int nq = qt.nq;
  const HeadPointers<T> hp = head_pointers<T>(p, s, h);
  const float* T_ = suffix + (s.batch_index * p.num_heads + h) * p.seqlen_k + s.row_k;
  const float scale_log2 = static_cast<float>(p.scale) * kLog2e;
  const int kt_top = L / kBlockN;  // the tile of the diagonal
  int kt_hi = kt_top, kt_lo = first_key / kBlockN;
  if constexpr (kSplit) {  // this block's chunk of key tiles
    const int64_t chunk = b % num_tiles;
    kt_hi = static_cast<int>(min64(kt_hi, (chunk + 1) * split.tiles_per_split - 1));
    kt_lo = static_cast<int>(max64(kt_lo, chunk * split.tiles_per_split));
  }
  // A warpgroup whose rows all lie past the last query skips the math (decoding: one row).
  const bool wg_live = kTmaWalk || 64 * wg < nq;
  // Stage handoff. The tiles after the first come by bulk tensor copies that thread 0 issues
  // (TileHandoff::copy; T stays on cp.async) where the layout allows it: -17% forward time at D=64 against
  // cp.async by every thread. Decoupled (TileHandoff) at head dim 128 when both warpgroups hold
  // queries, the next tile requested while this warpgroup's S is computed (-13% with TMA; at head
  // dim 64, two blocks per SM, -1.2% to -2.4%: FOX_HOPPER_FWD_DECOUPLED_64); in decoding (one
  // live warpgroup) one barrier per tile: decoupling measured +13-16% there.
  const bool use_tma = kTmaWalk || maps.enabled != 0;
  constexpr bool kDecoupled = (kHeadDim > 64 || FOX_HOPPER_FWD_DECOUPLED_64) && !kSplit;
  // (at head dim 64 only with TMA: with cp.async decoupling measured +24%, version 20)
  static_assert(!kTmaWalk || (kDecoupled && (kHeadDim == 64 || FOX_HOPPER_TMA_DECOUPLED)),
                "kTmaWalk: a decoupled handoff with TMA");
  const TileHandoff handoff(
      base + Smem::kBytesTiles + Smem::kBytesT,
      kTmaWalk || (kDecoupled && nq > 64 && (kHeadDim > 64 ? !use_tma || FOX_HOPPER_TMA_DECOUPLED : use_tma)),
      use_tma);
  const int64_t kv_head = kv_head_of(p, h);
  __syncthreads();  // the initialized barriers, for every thread
  // T of the keys of the tile at j0 into shared memory (zeros past the end of the sequence).
  const int len_k = static_cast<int>(s.len_k);
  auto load_suffix = [&](float* dst, int j0) {
    if (threadIdx.x < kBlockN) {
      const int j = j0 + static_cast<int>(threadIdx.x);
      cp_async_4(dst + threadIdx.x, T_ + (j < len_k ? j : 0), j < len_k);
    }
  };

  load_tile<T, kBlockM, kHeadDim>(Qs, hp.q + i0 * hp.q_row, hp.q_row, nq);
  if (kt_hi >= kt_lo) {
    const int64_t j0 = kt_hi * kBlockN;
    const int nk = static_cast<int>(min64(kBlockN, s.len_k - j0));
    load_tile<T, kBlockN, kHeadDim>(KV, hp.k + j0 * hp.k_row, hp.k_row, nk);
    load_tile<T, kBlockN, kHeadDim>(KV + Smem::kTile, hp.v + j0 * hp.v_row, hp.v_row, nk);
    load_suffix(Ts, j0);
  }
  handoff.loaded(0);

  const GateAnchor anchor(T_, a, s.len_k);
  auto row_of = [&](int hi) { return warp_row0 + group + 8 * hi; };
  float rq[2];  // R of this thread's two query rows, log2 domain (added to the lse at the end)
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) rq[hi] = anchor.query_term(T_, min64(a + row_of(hi), L));
  float carry = anchor.carry_at(kt_top);  // C of tile kt
  const float prune_log2 = kTmaWalk ? -INFINITY : p.prune_threshold * kLog2e;
  if (kt_hi < kt_top) {  // a chunk below the diagonal: C_{t-1} = C_t - T_t[t * 128] down to kt_hi
    float sum = 0.f;
    for (int u = kt_hi + 1 + lane; u <= kt_top; u += 32) sum += T_[static_cast<int64_t>(u) * kBlockN];
    carry -= warp_sum(sum);  // the same bits in every warp
  }

  float o[kHeadDim / 2];
#pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) o[i] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};

  for (int kt = kt_hi, it = 0; kt >= kt_lo; --kt, ++it) {
    const int j0 = kt * kBlockN;
    const int stage = warp_uniform(static_cast<int>(it & 1));
    const T* Ks = KV + (2 * stage) * Smem::kTile;
    const T* Vs = Ks + Smem::kTile;
    const float* Tk = Ts + stage * kBlockN;  // T of this tile's keys
    handoff.wait_loaded(it);
    if (walk_stops_at<kBlockN>(carry, Tk, j0, L, prune_log2)) break;  // (the same in every thread)
    auto prefetch_next = [&] {  // the next tile into the other stage
      if (kt - 1 < kt_lo) return;
      handoff.wait_free(it + 1);
      const int jn = j0 - kBlockN;
      T* Kn = KV + (2 * (stage ^ 1)) * Smem::kTile;
      if (use_tma) {  // a full tile inside the sequence
        handoff.copy<kBlockN, kHeadDim>(Kn, Kn + Smem::kTile, maps, it + 1, s.row_k + jn, kv_head, s.batch_index);
      } else {
        load_tile<T, kBlockN, kHeadDim>(Kn, hp.k + jn * hp.k_row, hp.k_row, kBlockN);
        load_tile<T, kBlockN, kHeadDim>(Kn + Smem::kTile, hp.v + jn * hp.v_row, hp.v_row, kBlockN);
      }
      load_suffix(Ts + (stage ^ 1) * kBlockN, jn);
      handoff.loaded(it + 1, use_tma);
    };
    if (!handoff.decoupled) prefetch_next();

    if (!wg_live) {
      if (handoff.decoupled) prefetch_next();
      carry -= Tk[0];
      handoff.release(it);
      continue;
    }
    // The tile's products and softmax over its first kCols keys (all of them, or half on the
    // diagonal, below).
    auto compute_tile = [&](auto cols) {
      constexpr int kCols = decltype(cols)::value;
      // S = Q K^T for this warpgroup's 64 rows x kCols keys.
      float sc[kCols / 2];
      cute::warpgroup_arrive();
      gemm_rows_by_tile<typename Gmma<T, kCols>::SS, kHeadDim, kBlockM, kBlockN>(Qs, 64 * wg, Ks, sc);
      cute::warpgroup_commit_batch();
      if (handoff.decoupled) prefetch_next();
      cute::warpgroup_wait<0>();
      fence_registers(sc);

      // Bias, masks and the online softmax (int32 column limits, relative to the tile). (T stays in
      // shared memory: its registers ahead of the wait spill at head dim 64, version 76.)
      const int last_col[2] = {a + row_of(0) - j0, a + row_of(1) - j0};
      float correction[2], tile_sum[2];
      softmax_tile<kCols>(sc, Tk, carry, scale_log2, j0 + kCols - 1 > a || j0 < first_key, last_col,
                          first_key - j0, row_max, correction, tile_sum);
      uint32_t p_frag[kCols / 16][4];
      rescale_and_pack<T, kHeadDim, kCols>(sc, correction, tile_sum, o, row_sum, p_frag);

      // O += P V
      fence_registers(o);
      cute::warpgroup_arrive();
      gemm_frags_by_tile<GmmaPV, kBlockN>(p_frag, Vs, o);
      cute::warpgroup_commit_batch();
      carry -= Tk[0];  // C_{kt-1} = C_kt - T_kt[kt * 128]
      cute::warpgroup_wait<0>();
      fence_registers(o);
    };
    // On the diagonal tile every row of this warpgroup may end before the tile's second half
    // (aligned tiles: warpgroup 0's rows see keys j0 .. j0 + 63 at most): S, the softmax and P V
    // over the first 64 keys only, the same scores and sums (the masked half adds exact zeros).
    if (a + 64 * wg + 63 - j0 < kBlockN / 2)
      compute_tile(std::integral_constant<int, kBlockN / 2>{});
    else
      compute_tile(std::integral_constant<int, kBlockN>{});
    handoff.release(it);
  }
  cp_async_wait<0>();  // nothing may land in shared memory after the block is gone

  float inv[2];
  finish_row_sums(row_sum, inv);
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    const int r = row_of(hi);
    if (r >= nq) continue;
    const float lse2 = row_lse2(row_sum[hi], row_max[hi], rq[hi]);
    if constexpr (kSplit) {
      const int64_t row = s.batch_index * p.seqlen_q + s.row_q + i0 + r;
      const int64_t slot = ((b % num_tiles) * p.num_heads + h) * split.total_rows + row;
      float* out = split.out_partial + slot * kHeadDim;
#pragma unroll
      for (int n = 0; n < kDimChunks; ++n)
        *reinterpret_cast<float2*>(out + n * 8 + quad * 2) =
            make_float2(o[4 * n + 2 * hi] * inv[hi], o[4 * n + 2 * hi + 1] * inv[hi]);
      if (quad == 0) split.lse_partial[slot] = lse2;
      continue;
    }
    if (quad == 0) static_cast<float*>(p.lse)[row_stat_offset(p, s, h) + i0 + r] = lse2 * kLn2;
  }
  if constexpr (!kSplit) {  // O through this warpgroup's rows of the Q tile (its products are done)
    __syncthreads();
    T* out = static_cast<T*>(p.out) + s.batch_index * p.o_batch_stride + (s.row_q + i0) * p.o_row_stride +
             h * p.o_head_stride;
    store_rows_staged<T, kBlockM, kHeadDim>(Qs, o, inv, out, p.o_row_stride, nq);
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

// The stages of a warp-specialised kernel's walks over key tiles (K, V and the keys' T), between
// its producer warp and its math warpgroups: the ring runs on from one walk to the next, the tile
// at ring position g in stage g % kStages. The producer's warp requests every tile: full[st]
// expects lane 0's arrival (with the transaction of a tile by TMA) and its 32 lanes' cp.async
// arrivals (T, and K and V of a partial tile, zero-filled past the end of the sequence), empty[st]
// every math thread's release. Only the producer waits for a free stage.
// Pruning: the producer takes the math threads' decision itself, on the same T values from global
// memory (the same bits): it requests tile n only if tile n - 1 is not cut off, so a walk ends with
// no copy in flight and the math threads release the tile they stop at. C (carry) moves down at
// each 128-key boundary, as in the math threads.
template <typename T, int kKeys, int kHeadDim, int kStages>
struct KeyTilePipeline {
  static constexpr int kTile = kKeys * kHeadDim;  // elements of one K or V tile
  static constexpr int kProducerArrivals = 1 + 32;
  static constexpr size_t kBytesTiles = 2 * 2 * kStages * size_t{kTile};  // the stages of (K, V)
  static constexpr size_t kBytesT = sizeof(float) * kStages * kKeys;
  static constexpr size_t kBytesBarriers = 2 * kStages * sizeof(uint64_t);
  T* KV;       // stage s: K at KV + 2s * kTile, V at KV + (2s + 1) * kTile
  float* Ts;   // stage s: T of its keys at Ts + s * kKeys
  uint64_t* full;
  uint64_t* empty;

  // Thread 0 initialises the barriers (walkers: the math threads); a block barrier must follow.
  __device__ __forceinline__ KeyTilePipeline(T* kv, float* ts, uint64_t* barriers, int walkers)
      : KV(kv), Ts(ts), full(barriers), empty(barriers + kStages) {
    if (threadIdx.x != 0) return;
    for (int st = 0; st < kStages; ++st) {
      mbarrier_init(full + st, kProducerArrivals);
      mbarrier_init(empty + st, walkers);
    }
    fence_async_proxy();
  }
  // (Ring positions in 32 bits: a block walks far fewer than 2^31 tiles.)
  __device__ __forceinline__ int stage(int g) const { return warp_uniform(g % kStages); }
  __device__ __forceinline__ T* keys(int g) const { return KV + 2 * stage(g) * kTile; }
  __device__ __forceinline__ const T* values(int g) const { return KV + (2 * stage(g) + 1) * kTile; }
  __device__ __forceinline__ const float* suffix(int g) const { return Ts + stage(g) * kKeys; }
  // Math threads.
  __device__ __forceinline__ void wait_loaded(int g) const {
    mbarrier_wait(full + g % kStages, static_cast<uint32_t>((g / kStages) & 1));
  }
  __device__ __forceinline__ void release(int g) const { mbarrier_arrive(empty + g % kStages); }
  // The producer's warp: tiles [it, end) of one walk, key tile kt_top - it at ring position g0 + it,
  // K and V (kv_head's rows of hk, hv: the sequence's) by TMA where the tile is full, else by
  // cp.async; T (T_: the sequence's) by cp.async. C of tile `it` is `carry`; the walk stops after a
  // tile whose top key's bias is under prune_log2. Returns where it stopped (end, or the tile after
  // the one cut off).
  __device__ __forceinline__ int produce(const TileMaps& maps, const float* T_, const T* hk, const T* hv,
                                         int64_t k_row, int64_t v_row, int g0, int it, int end, int64_t kt_top,
                                         int64_t len_k, float carry, int64_t L, float prune_log2, int64_t row_k,
                                         int64_t kv_head, int64_t batch) const {
    const int lane = threadIdx.x & 31;
    for (; it < end; ++it) {
      const int64_t j0 = (kt_top - it) * kKeys;
      if (it > 0 && prune_log2 > -INFINITY) {  // do the math threads stop at tile it - 1?
        const float* Tp = T_ + j0 + kKeys;  // T of tile it - 1 (inside the sequence)
        if (walk_stops_at<kKeys>(carry, Tp, j0 + kKeys, L, prune_log2)) break;
        if ((j0 + kKeys) % kBlockN == 0) carry -= Tp[0];
      }
      const int g = g0 + it;
      const int st = g % kStages;
      // Tile g - kStages released; then its phase of full[st] is done too: that wait returns at
      // once, it lets compute-sanitizer's synccheck see that no arrival overtakes a phase.
      if (g >= kStages) {
        const uint32_t parity = static_cast<uint32_t>(g / kStages - 1) & 1;
        mbarrier_wait(empty + st, parity);
        mbarrier_wait(full + st, parity);
      }
      T* Kn = KV + 2 * st * kTile;
      const int nk = static_cast<int>(min64(kKeys, len_k - j0));
      if (nk == kKeys) {
        if (lane == 0) {
          mbarrier_arrive_expect_tx(full + st, 2 * kTile * sizeof(T));
#pragma unroll
          for (int cb = 0; cb < kHeadDim / 64; ++cb) {
            tma_load(Kn + cb * kKeys * 64, &maps.first, 64 * cb, row_k + j0, kv_head, batch, full + st);
            tma_load(Kn + kTile + cb * kKeys * 64, &maps.second, 64 * cb, row_k + j0, kv_head, batch, full + st);
          }
        }
      } else {  // the diagonal tile at the end of a sequence
        load_tile<T, kKeys, kHeadDim, 32>(Kn, hk + j0 * k_row, k_row, nk);
        load_tile<T, kKeys, kHeadDim, 32>(Kn + kTile, hv + j0 * v_row, v_row, nk);
        if (lane == 0) mbarrier_arrive(full + st);
      }
#pragma unroll
      for (int c = 0; c < kKeys / 32; ++c) {
        const int j = 32 * c + lane;
        cp_async_4(Ts + st * kKeys + j, T_ + j0 + (j < nk ? j : 0), j < nk);
      }
      cp_async_arrive(full + st);
    }
    return it;
  }
};

// Turns of a warp-specialised kernel's two math warpgroups at the tensor cores: they alternate,
// warpgroup 0 first; warpgroup k waits on named barrier 4 + k (its 128 threads and the other's
// 128, which arrive there when they pass). Each takes the same number of turns.
struct MathTurns {
  int wg;
  __device__ __forceinline__ void wait(bool first) const {
    if (wg == 0) {
      named_barrier_sync<4, 256>();
    } else {
      if (first) named_barrier_arrive<4, 256>();  // warpgroup 0 goes first
      named_barrier_sync<5, 256>();
    }
  }
  __device__ __forceinline__ void pass(bool last) const {
    if (wg == 0)
      named_barrier_arrive<5, 256>();
    else if (!last)  // (nobody waits for warpgroup 1's last pass)
      named_barrier_arrive<4, 256>();
  }
};
// The math threads (both math warpgroups) meet: named barrier 3.
__device__ __forceinline__ void math_barrier() { named_barrier_sync<3, 256>(); }

// Warp-specialised forward (head dim 128, tiles by TMA), FlashAttention-3's schedule: a producer
// warpgroup requests the tiles (KeyTilePipeline, three stages), two math warpgroups compute, and
// these take turns at the tensor cores (MathTurns) so that one's softmax runs while the other's
// products do. Each math warpgroup issues S of tile it together with O += P V of tile it - 1,
// passes the turn, computes the softmax of tile it while both products run, then waits for P V,
// rescales O and packs the new P: K of tile it and V of tile it - 1 are read at once, hence three
// stages. The producer's registers go to the math warpgroups (setmaxnreg: 240 each).
// Persistent: one block an SM walks query tiles one after another, in block_query_tile's order;
// the first gridDim.x by block index, the others from a tile counter (zeroed by the gate-suffix
// pre-pass), which the producer reads when it has requested the last tile of a walk. The producer
// requests the next walk's first tiles as stages free up and its queries once both math
// warpgroups have issued their last S (WalkHandoff), so that a walk starts on loaded tiles; the
// output leaves through shared memory in the last tile's K, released after the store.
constexpr int kWsThreads = kThreads + 128;
constexpr int kWsStages = 3;
template <typename T, int kHeadDim>
using ForwardPipeline = KeyTilePipeline<T, kBlockN, kHeadDim, kWsStages>;

// The walks between the producer and the math threads: q_full completes when the producer has
// written the walk's item (its index in block_query_tile's order; -1: no more), the item decoded
// and its gate anchor (GateAnchor's two C values) and its queries have landed (its lane 0's
// arrival and its 32 lanes' cp.async arrivals), q_empty when every math thread is done with the
// queries.
struct WalkHandoff {
  static constexpr int kArrivals = 1 + 32;
  static constexpr size_t kBytes = 4 * sizeof(uint64_t) + sizeof(QueryTile);
  uint64_t* q_full;
  uint64_t* q_empty;
  int64_t* item;
  float* anchor;
  QueryTile* tile;  // the item decoded (by the math threads, its chain of divisions took ~1400 cycles)
  __device__ __forceinline__ explicit WalkHandoff(uint64_t* base)
      : q_full(base), q_empty(base + 1), item(reinterpret_cast<int64_t*>(base + 2)),
        anchor(reinterpret_cast<float*>(base + 3)), tile(reinterpret_cast<QueryTile*>(base + 4)) {}
  __device__ __forceinline__ void init(int walkers) const {  // thread 0; a block barrier follows
    mbarrier_init(q_full, kArrivals);
    mbarrier_init(q_empty, walkers);
  }
};

template <typename T, int kHeadDim>
struct ForwardWsSmem {
  using Pipeline = ForwardPipeline<T, kHeadDim>;
  static constexpr int kQ = kBlockM * kHeadDim;  // elements
  static constexpr size_t kBytesQ = sizeof(T) * kQ;
  static constexpr size_t kBytes =
      kBytesQ + Pipeline::kBytesTiles + Pipeline::kBytesT + Pipeline::kBytesBarriers + WalkHandoff::kBytes;
  static constexpr size_t kAllocBytes = kBytes + 1024;  // slack to align the base to 1024 bytes
};

// kPrune: whether walks may stop early (a pruning threshold); without, the test leaves its tile
// loops when it compiles (-2% to -2.6% forward time at D=128, bench/NOTES.md version 98).
template <typename T, int kHeadDim, bool kPrune>
__global__ void __launch_bounds__(kWsThreads, 1)
    forward_kernel_ws(const ForwardParams p, const float* __restrict__ suffix, int64_t num_tiles,
                      int* __restrict__ tile_counter, const __grid_constant__ TileMaps maps,
                      const __grid_constant__ TileMap query_map) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Smem = ForwardWsSmem<T, kHeadDim>;
  using GmmaS = typename Gmma<T, kBlockN>::SS;
  using GmmaPV = typename Gmma<T, kHeadDim>::RS;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* base = smem_raw + ((1024 - smem_address(smem_raw) % 1024) % 1024);
  T* Qs = reinterpret_cast<T*>(base);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp_uniform(warp >> 2);
  const int64_t items = num_tiles * p.batch * p.num_heads;
  const float prune_log2 = kPrune ? p.prune_threshold * kLog2e : -INFINITY;
  unsigned char* tiles = base + Smem::kBytesQ;
  uint64_t* barriers = reinterpret_cast<uint64_t*>(tiles + Smem::Pipeline::kBytesTiles + Smem::Pipeline::kBytesT);
  const ForwardPipeline<T, kHeadDim> pipe(reinterpret_cast<T*>(tiles),
                                          reinterpret_cast<float*>(tiles + Smem::Pipeline::kBytesTiles), barriers,
                                          kThreads);
  const WalkHandoff walk(barriers + 2 * kWsStages);
  if (threadIdx.x == 0) walk.init(kThreads);
  __syncthreads();

  if (wg == kWarpGroups) {  // the producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (warp != 4 * kWarpGroups) return;
    int g = 0;  // ring position of the walk's first tile
    for (int64_t w = 0;; ++w) {
      int64_t item = blockIdx.x;
      if (w > 0) {
        int taken = 0;
        if (lane == 0) taken = atomicAdd(tile_counter, 1);
        item = gridDim.x + __shfl_sync(0xffffffffu, taken, 0);
      }
      const QueryTile qt = item < items ? query_tile_at(p, num_tiles, kBlockM, item) : QueryTile{};
      // The walk: its first tile (whose stage frees up before the queries do), then, once the math
      // threads are done with the last walk's queries, its item and queries, then its other tiles.
      const SequenceView s = qt.s;
      const HeadPointers<T> hp = head_pointers<T>(p, s, qt.h);
      const float* T_ = suffix + (s.batch_index * p.num_heads + qt.h) * p.seqlen_k + s.row_k;
      const int64_t kt_top = qt.L / kBlockN, n_tiles = kt_top - s.first_key / kBlockN + 1;
      const GateAnchor anchor = qt.nq > 0 ? GateAnchor(T_, qt.a, s.len_k) : GateAnchor(0, 0.f, 0.f);
      const float carry = anchor.carry_at(kt_top);
      const int64_t kv_head = kv_head_of(p, qt.h);
      if (qt.nq > 0)
        pipe.produce(maps, T_, hp.k, hp.v, hp.k_row, hp.v_row, g, 0, 1, kt_top, s.len_k, carry, qt.L, prune_log2,
                     s.row_k, kv_head, s.batch_index);
      if (w > 0) mbarrier_wait(walk.q_empty, static_cast<uint32_t>((w - 1) & 1));
      // A full query tile by TMA from lane 0 (one warp's copies of 32 KB took ~3 us to issue),
      // else by the warp's cp.async.
      const bool queries_by_tma = query_map.enabled && qt.nq == kBlockM;
      if (lane == 0) {
        *walk.item = item < items ? item : -1;
        *walk.tile = qt;
        walk.anchor[0] = anchor.c_a;
        walk.anchor[1] = anchor.c_above;
        if (queries_by_tma) {
          mbarrier_arrive_expect_tx(walk.q_full, kBlockM * kHeadDim * sizeof(T));
#pragma unroll
          for (int cb = 0; cb < kHeadDim / 64; ++cb)
            tma_load(Qs + cb * kBlockM * 64, &query_map.map, 64 * cb, s.row_q + qt.i0, qt.h, s.batch_index,
                     walk.q_full);
        } else {
          mbarrier_arrive(walk.q_full, qt.nq > 0 ? 1 : WalkHandoff::kArrivals);
        }
      }
      if (item >= items) break;
      if (qt.nq == 0) continue;  // past the end of its sequence
      if (!queries_by_tma) load_tile<T, kBlockM, kHeadDim, 32>(Qs, hp.q + qt.i0 * hp.q_row, hp.q_row, qt.nq);
      cp_async_arrive(walk.q_full);
      g += pipe.produce(maps, T_, hp.k, hp.v, hp.k_row, hp.v_row, g, 1, static_cast<int>(n_tiles), kt_top, s.len_k,
                        carry, qt.L, prune_log2, s.row_k, kv_head, s.batch_index);
    }
    cp_async_wait<0>();
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");

  const int group = lane >> 2, quad = lane & 3;
  const int warp_row0 = 64 * wg + 16 * (warp & 3);
  const float scale_log2 = static_cast<float>(p.scale) * kLog2e;
  const MathTurns turns{wg};
  auto row_of = [&](int hi) { return warp_row0 + group + 8 * hi; };
  float o[kHeadDim / 2];
  float sc[kBlockN / 2];
  uint32_t p_frag[kBlockN / 16][4];

  int g = 0;  // ring position of the walk's first tile
  for (int64_t w = 0;; ++w) {
    mbarrier_wait(walk.q_full, static_cast<uint32_t>(w & 1));
    if (warp_uniform(static_cast<int>(*walk.item < 0))) break;
    const QueryTile qt = *walk.tile;
    const int nq = warp_uniform(qt.nq);
    if (nq == 0) {
      mbarrier_arrive(walk.q_empty);
      continue;
    }
    const SequenceView s = qt.s;
    const int64_t h = qt.h, i0 = qt.i0, a = qt.a, L = qt.L;
    const float* T_ = suffix + (s.batch_index * p.num_heads + h) * p.seqlen_k + s.row_k;
    // (warp_uniform: the loop's ring positions and the tiles' descriptors stay in uniform registers)
    const int64_t kt_top = L / kBlockN, kt_lo = s.first_key / kBlockN;
    const int n_tiles = warp_uniform(static_cast<int>(kt_top - kt_lo + 1));
    g = warp_uniform(g);
    const GateAnchor anchor(a, walk.anchor[0], walk.anchor[1]);
    float carry = anchor.carry_at(kt_top);  // C of the tile walked
    float rq[2];  // R of this thread's two query rows, log2 domain (added to the lse at the end)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) rq[hi] = anchor.query_term(T_, min64(a + row_of(hi), L));
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) o[i] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};

    // Whether the largest bias of tile it (at its top key) is under the pruning threshold: the walk
    // stops there (the producer decides alike).
    auto pruned = [&](int it) {
      return walk_stops_at<kBlockN>(carry, pipe.suffix(g + it), (kt_top - it) * kBlockN, L, prune_log2);
    };
    // The softmax of tile it on this thread's scores (in place: sc holds p afterwards); O is
    // rescaled later, once the P V in flight has landed.
    SuffixInRegisters<kBlockN> t;  // T of tile it, loaded while its S is computed
    auto softmax_of = [&](int it, auto& scores, float (&correction)[2], float (&tile_sum)[2]) {
      constexpr int kCols = 2 * static_cast<int>(std::extent_v<std::remove_reference_t<decltype(scores)>>);
      const int64_t j0 = (kt_top - it) * kBlockN;
      const float* Tk = pipe.suffix(g + it);
      const int64_t last_col[2] = {a + row_of(0) - j0, a + row_of(1) - j0};
      softmax_tile<kCols>(scores, t, carry, scale_log2, j0 + kCols - 1 > a || j0 < s.first_key, last_col,
                          s.first_key - j0, row_max, correction, tile_sum);
      carry -= Tk[0];  // C_{kt-1} = C_kt - T_kt[kt * 128]
    };
    auto softmax = [&](int it, float (&correction)[2], float (&tile_sum)[2]) {
      softmax_of(it, sc, correction, tile_sum);
    };

    // The queries may be overwritten once both warpgroups have read their last S.
    auto release_queries = [&] {
      fence_async_proxy();  // the products' reads before the producer's copies of the next queries
      mbarrier_arrive(walk.q_empty);
    };

    pipe.wait_loaded(g);
    fence_async_proxy();  // (Q, and a partial tile 0, came by cp.async)
    int it = 1;
    const bool walked = !pruned(0);
    // Tile 0 is the diagonal's: where this warpgroup's rows end before its second half (aligned
    // tiles: warpgroup 0), S and the softmax cover its first 64 keys only, and P is 0 on the rest.
    // (P V stays whole, over P's zeros: a P V of 4 k-steps after tile 0, in a peeled first
    // iteration or behind a branch, made ptxas serialise every wgmma of the kernel.)
    const bool half_first = a + 64 * wg + 63 - kt_top * kBlockN < kBlockN / 2;
    if (walked) {
      // Tile 0: S alone (over its first kCols keys).
      auto first_tile = [&](auto cols) {
        constexpr int kCols = decltype(cols)::value;
        float s0[kCols / 2];
        turns.wait(true);
        cute::warpgroup_arrive();
        gemm_rows_by_tile<typename Gmma<T, kCols>::SS, kHeadDim, kBlockM, kBlockN>(Qs, 64 * wg, pipe.keys(g), s0);
        cute::warpgroup_commit_batch();
        turns.pass(false);
        t.load(pipe.suffix(g));
        cute::warpgroup_wait<0>();
        fence_registers(s0);
        float correction[2], tile_sum[2];
        softmax_of(0, s0, correction, tile_sum);
        uint32_t (&p0)[kCols / 16][4] = reinterpret_cast<uint32_t(&)[kCols / 16][4]>(p_frag);
        rescale_and_pack<T, kHeadDim, kCols>(s0, correction, tile_sum, o, row_sum, p0);
#pragma unroll
        for (int k = kCols / 16; k < kBlockN / 16; ++k)
#pragma unroll
          for (int r = 0; r < 4; ++r) p_frag[k][r] = 0u;
      };
      if (half_first)
        first_tile(std::integral_constant<int, kBlockN / 2>{});
      else
        first_tile(std::integral_constant<int, kBlockN>{});
      for (; it < n_tiles; ++it) {
        pipe.wait_loaded(g + it);
        if (pruned(it)) break;
        turns.wait(false);
        fence_registers(o);
        cute::warpgroup_arrive();
        gemm_rows_by_tile<GmmaS, kHeadDim, kBlockM, kBlockN>(Qs, 64 * wg, pipe.keys(g + it), sc);
        cute::warpgroup_commit_batch();
        gemm_frags_by_tile<GmmaPV, kBlockN>(p_frag, pipe.values(g + it - 1), o);
        cute::warpgroup_commit_batch();
        turns.pass(false);
        t.load(pipe.suffix(g + it));
        cute::warpgroup_wait<1>();
        fence_registers(sc);
        float correction[2], tile_sum[2];
        softmax(it, correction, tile_sum);
        cute::warpgroup_wait<0>();
        fence_registers(o);
        pipe.release(g + it - 1);
        rescale_and_pack<T, kHeadDim, kBlockN>(sc, correction, tile_sum, o, row_sum, p_frag);
      }
      if (it < n_tiles) pipe.release(g + it);  // requested, not walked (cut off)
      release_queries();
      // P V of the last tile walked.
      turns.wait(false);
      fence_registers(o);
      cute::warpgroup_arrive();
      gemm_frags_by_tile<GmmaPV, kBlockN>(p_frag, pipe.values(g + it - 1), o);
      cute::warpgroup_commit_batch();
      turns.pass(true);
      cute::warpgroup_wait<0>();
      fence_registers(o);
    } else {
      release_queries();
    }
    const int last = g + it - 1;  // the last tile walked (or tile 0): its K stages the output
    g += !walked ? 1 : it == n_tiles ? n_tiles : it + 1;  // the tiles the producer requested

    float inv[2];
    finish_row_sums(row_sum, inv);
#pragma unroll
    for (int hi = 0; hi < 2; ++hi)
      if (row_of(hi) < nq && quad == 0)
        static_cast<float*>(p.lse)[row_stat_offset(p, s, h) + i0 + row_of(hi)] =
            row_lse2(row_sum[hi], row_max[hi], rq[hi]) * kLn2;
    math_barrier();  // both warpgroups' products are done with the last tile's K
    T* out = static_cast<T*>(p.out) + s.batch_index * p.o_batch_stride + (s.row_q + i0) * p.o_row_stride +
             h * p.o_head_stride;
    store_rows_staged<T, kBlockM, kHeadDim>(pipe.keys(last), o, inv, out, p.o_row_stride, nq);
    fence_async_proxy();  // these accesses before the copies that refill the stage
    pipe.release(last);
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

}  // namespace fox::cuda::hopper

namespace fox::cuda {

template <typename T, int kHeadDim>
void run_hopper_forward(const ForwardParams& p, float* workspace, int64_t max_len_q,
                        int64_t max_len_k, cudaStream_t stream) {
  using namespace hopper;
  float* gate_suffix = workspace;
  int* tile_counter = reinterpret_cast<int*>(workspace + forward_tile_counter_offset(p));
  const int64_t key_tiles = (max_len_k + kBlockN - 1) / kBlockN;
  if (key_tiles * p.num_heads * p.batch == 0) return;
  gate_suffix_kernel<kBlockN><<<static_cast<unsigned>(key_tiles * p.num_heads * p.batch), kBlockN, 0, stream>>>(
      p, gate_suffix, key_tiles, nullptr, tile_counter);
  const int64_t tiles = (max_len_q + kBlockM - 1) / kBlockM;
  const int64_t blocks = tiles * p.num_heads * p.batch;
  if (blocks == 0) return;
  const TileMaps maps = make_key_value_maps(p, std::is_same_v<T, __nv_bfloat16>, kBlockN);
  if constexpr (FOX_HOPPER_FWD_WS && (kHeadDim == 128 || FOX_HOPPER_FWD_WS_64)) {
    if (maps.enabled) {
      const bool prune = p.prune_threshold > -INFINITY;
      auto kernel = prune ? forward_kernel_ws<T, kHeadDim, true> : forward_kernel_ws<T, kHeadDim, false>;
      constexpr size_t smem = ForwardWsSmem<T, kHeadDim>::kAllocBytes;
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      int device = 0, sms = 0;
      cudaGetDevice(&device);
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
      const int64_t grid = min64(blocks, max64(sms, 1));  // persistent: one block an SM
      const TileMap query_map = make_query_map(p, std::is_same_v<T, __nv_bfloat16>, kBlockM);
      kernel<<<static_cast<unsigned>(grid), kWsThreads, smem, stream>>>(p, gate_suffix, tiles, tile_counter, maps,
                                                                        query_map);
      return;
    }
  }
  // The TMA walk where the maps allow TMA, the query tiles are long enough for both warpgroups
  // (shorter prefills keep one barrier a tile, version 20) and no walk may stop early, unless the
  // warp-specialised kernel took those calls above.
  constexpr bool kTmaWalkBuilt = !(FOX_HOPPER_FWD_WS && (kHeadDim == 128 || FOX_HOPPER_FWD_WS_64)) &&
                                 (kHeadDim == 64 ? FOX_HOPPER_FWD_DECOUPLED_64 : FOX_HOPPER_TMA_DECOUPLED) != 0;
  auto kernel = forward_kernel<T, kHeadDim, false>;
  if constexpr (kTmaWalkBuilt)
    if (maps.enabled && max_len_q > 64 && !(p.prune_threshold > -INFINITY))
      kernel = forward_kernel<T, kHeadDim, false, true>;
  constexpr size_t smem = ForwardSmem<kHeadDim>::kAllocBytes;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p, SplitKVParams{}, gate_suffix, tiles, maps);
}

template <typename T, int kHeadDim>
void run_hopper_split_kv_forward(const ForwardParams& p, const SplitKVParams& split,
                                 float* gate_suffix, cudaStream_t stream) {
  using namespace hopper;
  const int64_t key_tiles = (p.seqlen_k + kBlockN - 1) / kBlockN;
  gate_suffix_kernel<kBlockN><<<static_cast<unsigned>(key_tiles * p.num_heads * p.batch), kBlockN, 0, stream>>>(
      p, gate_suffix, key_tiles, nullptr);
  auto kernel = forward_kernel<T, kHeadDim, true>;
  constexpr size_t smem = ForwardSmem<kHeadDim>::kAllocBytes;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  const int64_t blocks = split.num_splits * p.num_heads * p.batch;
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p, split, gate_suffix, split.num_splits,
                                                                    TileMaps{});
  generic::split_combine_kernel<T>
      <<<static_cast<unsigned>(split.total_rows * p.num_heads), 128, 0, stream>>>(p, split);
}

}  // namespace fox::cuda
