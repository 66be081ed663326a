// Decoding kernel: a few queries (seqlen_q <= 16) against a long KV cache, fp16/bf16, head dim
// 64/128, on mma.sync m16n8k16 (sm_80+; memory-bound, so Hopper runs it too).
//
// Decoding is bound by the bytes of the cache. A block owns one KV head of one sequence and packs
// the query heads of that KV head's group times the queries into the 16 rows of one MMA tile
// (row r -> head r / seqlen_q, query r % seqlen_q), so K and V are read once per group, not once
// per query head. The cache is split over blocks (split-KV) to fill the GPU; each row's own key
// range [seq_start, cache_seqlens) is cut into the same number of chunks, so rows of different
// lengths do work in proportion to their length.
//
// Key tiles of 64 are streamed through a cp.async ring of kStages stages (K, V and the gates of the
// group's heads); each of the 4 warps takes 16 keys of a tile and keeps its own online softmax,
// and the warps are merged at the end.
//
// Paired blocks (kGroups = 2): two such groups of 4 warps in one block, each with its own ring and
// shared memory, the upper and the lower half of the chunk's tiles, merged in the block. A block
// walks its tiles one after another, ~1 us a tile whatever the bytes in flight (the gate scan, two
// barriers, the softmax), so a grid of at most one block an SM leaves each SM one tile at a time;
// two groups double that without a second block per SM and without the split's partial results.
// The lower half's gate bias misses the upper half's gate sum, a constant per head: the merge adds
// it to the lower group's row maxima (the carry of the split-KV combine, inside the block).
//
// The gate bias. Every chunk walks its keys downwards from its own top position `top`, summing log
// f inside each tile and carrying whole-tile sums: R_j = sum_{l=j+1..top} log f_l (error grows with
// the distance from top, never with the absolute position). The bias of query i (position P_i)
// and key j is d_ij = R_j + carry + rq_i with carry = sum_{l=top+1..P_last} log f_l (the gates of
// the chunks above, added exactly by the combine kernel as a shift of the chunk's log-sum-exp) and
// rq_i = -sum_{l=P_i+1..P_last} log f_l (at most 15 terms; every block computes it).
#pragma once

#include <algorithm>
#include <array>
#include <cstdlib>
#include <type_traits>

#include "common.cuh"
#include "dependent_launch.cuh"
#include "launch.h"
#include "mma.cuh"
#include "../per_device.h"

namespace fox::cuda::decode {

constexpr int kRows = 16;   // rows of the packed query tile (one MMA m-tile)
// Keys per tile (decode_keys_per_tile): 16 or 32 for each of the 4 warps (kWarpKeySteps 16-key
// MMA steps).
template <int kHeadDim>
constexpr int kKeysOf = decode_keys_per_tile(kHeadDim);
template <int kHeadDim>
constexpr int kWarpKeySteps = kKeysOf<kHeadDim> / 64;
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxSplits = kDecodeMaxSplits;  // the combine keeps a weight per chunk in shared memory

// Stages of the cp.async ring: bytes in flight per SM against shared memory per block (the
// shared memory sets how many blocks fit on an SM). FOX_DECODE_STAGES_64/128 override them.
#ifndef FOX_DECODE_STAGES_64
#define FOX_DECODE_STAGES_64 2
#endif
#ifndef FOX_DECODE_STAGES_128
#define FOX_DECODE_STAGES_128 2
#endif
template <int kHeadDim>
constexpr int kStages = kHeadDim <= 64 ? FOX_DECODE_STAGES_64 : FOX_DECODE_STAGES_128;

template <int kHeadDim>
struct Smem {
  static constexpr int kKeys = kKeysOf<kHeadDim>;
  static constexpr int kTileElems = kKeys * kHeadDim;  // one K or V tile, 2-byte elements
  static constexpr int kQ = 0;                          // Q tile (16 rows)
  static constexpr int kKV = kRows * kHeadDim;          // stage s: K at kKV + 2s tiles, V after it
  static constexpr int kElems = kKV + 2 * kStages<kHeadDim> * kTileElems;
  // float gates[stage][head slot][key], slot rows padded by 4 floats: loaded head-fastest, the
  // (up to 8) slots of one key fall on different banks.
  static constexpr int kGStride = kKeys + 4;
  static constexpr int kGStage = kRows * kGStride;
  static constexpr size_t kGateOffset = sizeof(uint16_t) * kElems;
  static constexpr size_t kROffset = kGateOffset + sizeof(float) * kStages<kHeadDim> * kGStage;
  // R rows padded by 8 floats: the 8 rows a warp reads at once fall on different banks.
  static constexpr int kRStride = kKeys + 8;
  static constexpr size_t kRqOffset = kROffset + sizeof(float) * kRows * kRStride;
  static constexpr size_t kBytes = kRqOffset + sizeof(float) * kRows;
  // The merge of the 4 warps reuses the K/V stages: O (4 x 16 x D) and 2 x 4 x 16 statistics.
  static_assert(sizeof(float) * (kWarps * kRows * kHeadDim + 2 * kWarps * kRows) <=
                    sizeof(uint16_t) * 2 * kStages<kHeadDim> * kTileElems,
                "merge buffers must fit in the K/V stages");
};

template <int kHeadDim>
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * kHeadDim + ((chunk ^ (row & 7)) << 3);
}

// The block's sequence, KV head, row tile and chunk of the cache.
struct DecodeTile {
  SequenceView s;
  int64_t kv_head = 0;
  int row0 = 0;        // first packed row (head-in-group * seqlen_q + query) of the tile
  int rows = 0;        // live rows of the tile
  int first_head = 0;  // head-in-group of row 0 of the tile; the tile spans heads first_head..+nh
  int nh = 0;
  int64_t tile_lo = 0, tile_hi = -1;  // key tiles [tile_lo, tile_hi] of this chunk
  int64_t top = -1;                   // last key of the chunk
};

template <int kKeys>
__device__ __forceinline__ DecodeTile decode_tile(const ForwardParams& p, int num_splits) {
  DecodeTile t;
  // 32-bit divisions (head counts, queries and key tiles fit): a 64-bit one is a ~70-instruction
  // routine, and these stand between the block's start and its first loads.
  const int num_kv_heads = static_cast<int>(p.num_kv_heads);
  const int group = static_cast<int>(p.num_heads) / num_kv_heads;
  const int tq = static_cast<int>(p.seqlen_q);
  const int seq = static_cast<int>(blockIdx.z) / num_kv_heads;
  t.kv_head = static_cast<int>(blockIdx.z) - seq * num_kv_heads;
  t.s = p.sequence(seq);
  t.row0 = static_cast<int>(blockIdx.x) * kRows;
  t.rows = min(kRows, group * tq - t.row0);
  t.first_head = t.row0 / tq;
  t.nh = (t.row0 + t.rows - 1) / tq - t.first_head + 1;
  // This row's key tiles, cut into num_splits chunks.
  const int64_t first_key = max64(0, t.s.first_key), len = t.s.len_k;
  if (first_key >= len) return t;
  const int64_t lo = first_key / kKeys, hi = (len - 1) / kKeys;
  const int64_t per_split = static_cast<int>(hi - lo + num_splits) / num_splits;
  const int64_t split = blockIdx.y;
  t.tile_lo = lo + split * per_split;
  t.tile_hi = min64(hi, t.tile_lo + per_split - 1);
  t.top = min64(len - 1, (t.tile_hi + 1) * kKeys - 1);
  return t;
}

// A thread's copies of a K or V tile: the rows row0, row0 + kRowStep, ... of one 16-byte column
// (kThreads is a multiple of the columns), so a copy's source and destination are the first
// one's plus a fixed step: a few additions a copy instead of the index arithmetic.
template <int kHeadDim, int kKeys>
struct KVTileCopies {
  static constexpr int kColumns = kHeadDim / 8;
  static constexpr int kRowStep = kThreads / kColumns;
  static constexpr int kCopies = kKeys / kRowStep;
  static_assert(kThreads % kColumns == 0 && kRowStep % 8 == 0,
                "a thread's rows must share their swizzle (row % 8)");
  int row0, column;
  int smem0;  // element offset of the first copy in a tile of shared memory
  __device__ __forceinline__ explicit KVTileCopies(int tid)
      : row0(tid / kColumns), column(tid % kColumns), smem0(swizzled<kHeadDim>(row0, column)) {}
};

template <typename T, int kHeadDim, int kKeys = kKeysOf<kHeadDim>>
__device__ __forceinline__ void load_kv_tile(T* Ks, T* Vs, const T* k, const T* v, int64_t k_row,
                                             int64_t v_row, int64_t j0, int64_t len,
                                             const KVTileCopies<kHeadDim, kKeys>& c) {
  using C = KVTileCopies<kHeadDim, kKeys>;
  const int64_t first = j0 + c.row0;
  const T* ks = k + first * k_row + c.column * 8;
  const T* vs = v + first * v_row + c.column * 8;
  const int64_t k_step = C::kRowStep * k_row, v_step = C::kRowStep * v_row;
  // Rows past the end of the cache are zero-filled from a valid address.
  const int live = static_cast<int>(
      min64(C::kCopies, max64(0, (len - first + C::kRowStep - 1) / C::kRowStep)));
#pragma unroll
  for (int i = 0; i < C::kCopies; ++i) {
    const bool valid = i < live;
    const int dst = c.smem0 + i * C::kRowStep * kHeadDim;
    cp_async_16(Ks + dst, valid ? ks + i * k_step : k, valid);
    cp_async_16(Vs + dst, valid ? vs + i * v_step : v, valid);
  }
}

// Where one thread's gate copies of a tile go: its first (slot, key) and the step between its
// copies. Threads walk the gates in memory order: heads fastest when they are adjacent (the
// (B, T, H) layout: a warp reads whole 32-byte sectors of a KV group's heads), keys fastest
// otherwise (head-first). Set up once per block, so the tile loop divides nothing (a division by
// the runtime head count per copy was a third of the loader's instructions).
struct GateWalk {
  int slot = 0, key = 0;  // first copy
  int slot_step = 0, key_step = 0;
  int wrap_slots = 0;     // heads fastest: a slot past nh wraps to the next key
  int copies = 0;

  __device__ __forceinline__ void next(int& s, int& k) const {
    s += slot_step;
    k += key_step;
    if (wrap_slots && s >= wrap_slots) {
      s -= wrap_slots;
      ++k;
    }
  }
};

template <int kKeys>
__device__ __forceinline__ GateWalk gate_walk(int64_t g_head, int nh, bool heads_order, int t) {
  GateWalk w;
  const int total = nh * kKeys;
  w.copies = t < total ? (total - 1 - t) / kThreads + 1 : 0;
  if (heads_order && g_head == 1 && nh > 1) {
    w.slot = t % nh;
    w.key = t / nh;
    w.slot_step = kThreads % nh;
    w.key_step = kThreads / nh;
    w.wrap_slots = nh;
  } else {  // keys fastest: a copy kThreads later is the same key, kThreads / kKeys slots on
    static_assert(kThreads % kKeys == 0, "a tile's keys must divide the block's threads");
    w.slot = t / kKeys;
    w.key = t % kKeys;
    w.slot_step = kThreads / kKeys;
  }
  return w;
}

// Gates of the tile's nh heads for keys j0..j0+kKeys-1 (zero past the end of the row), into
// Gs[slot][key].
template <int kKeys, int kGStride>
__device__ __forceinline__ void load_gate_tile(float* Gs, const float* g, int64_t g_row,
                                               int64_t g_head, const GateWalk& w, int64_t j0,
                                               int64_t len) {
  const float* tile = g + j0 * g_row;
  const int keys_here = static_cast<int>(min64(kKeys, len - j0));
  int slot = w.slot, key = w.key;
  for (int c = 0; c < w.copies; ++c) {
    const bool valid = key < keys_here;
    cp_async_4(Gs + slot * kGStride + key, tile + (valid ? key * g_row + slot * g_head : 0), valid);
    w.next(slot, key);
  }
}

// float16 gates (a compact cache: half the gate bytes, which GQA decoding at head dim 64 needs to
// come near SDPA). cp.async moves at least 4 bytes, so a copy takes the gates of two adjacent heads
// of one key: the (B, T, H) layout, an even head offset and an even head count (the host sends
// every other case through float32 gates). They land in Gh[key][slot] (float16, slot rows of
// kGhStride) and the scan converts them.
constexpr int kGhStride = kRows + 2;

template <int kKeys>
__device__ __forceinline__ void load_half_gate_tile(__half* Gh, const __half* g, int64_t g_row,
                                                    const GateWalk& pairs, int64_t j0,
                                                    int64_t len) {
  const __half* tile = g + j0 * g_row;
  const int keys_here = static_cast<int>(min64(kKeys, len - j0));
  int pair = pairs.slot, key = pairs.key;
  for (int c = 0; c < pairs.copies; ++c) {
    const bool valid = key < keys_here;
    cp_async_4(Gh + key * kGhStride + 2 * pair, tile + (valid ? key * g_row + 2 * pair : 0), valid);
    pairs.next(pair, key);
  }
}

// out_partial/lse_partial (split, num_heads, batch * seqlen_q [, D]) and gate_total (split, batch,
// num_heads) are only written when num_splits > 1; otherwise the block writes out and lse.
struct DecodeSplit {
  int num_splits = 1;
  float* out_partial = nullptr;
  float* lse_partial = nullptr;  // log2 domain, without the carry of the chunks above
  float* gate_total = nullptr;   // sum of log f over the chunk's tiles, per head
  bool gates_heads_order = true;  // FOX_DECODE_GATES_KEYS_FASTEST=1: the other order (A/B)
};

// A barrier of one group's 4 warps (named barrier 1 + group; 0 is __syncthreads'), or of the
// block when it is the only group.
template <int kGroups>
__device__ __forceinline__ void group_barrier(int group) {
  if constexpr (kGroups == 1)
    __syncthreads();
  else
    asm volatile("bar.sync %0, %1;" ::"r"(1 + group), "r"(kThreads) : "memory");
}

// Shared memory of a paired block: each group's Smem, then the upper group's gate sums per head slot.
template <int kHeadDim, int kGroups>
struct BlockSmem {
  static constexpr size_t kGroupBytes = (Smem<kHeadDim>::kBytes + 127) / 128 * 128;
  static constexpr size_t kGateSumOffset = kGroups * kGroupBytes;
  static constexpr size_t kBytes = kGateSumOffset + sizeof(float) * kRows;
};

// TG: the gates' element type, float or __half. kGroups: 1, or 2 for paired blocks.
template <typename T, typename TG, int kHeadDim, int kGroups>
__global__ void __launch_bounds__(kThreads * kGroups)
    decode_kernel(const ForwardParams p, const DecodeSplit split) {
  constexpr bool kHalfGates = std::is_same_v<TG, __half>;
  using L = Smem<kHeadDim>;
  using B = BlockSmem<kHeadDim, kGroups>;
  using Mma = MmaTraits<T>;
  constexpr int kS = kStages<kHeadDim>;
  static_assert(kS >= 2, "the ring has two stages at least");
  constexpr int kDimTiles = kHeadDim / 8;
  constexpr int kDimSteps = kHeadDim / 16;
  constexpr int kKeys = kKeysOf<kHeadDim>, kSteps = kWarpKeySteps<kHeadDim>;
  constexpr int kPerLane = kKeys / 32;  // keys per lane in the gate scan
  static_assert(sizeof(__half) * kKeys * kGhStride <= sizeof(float) * L::kGStage,
                "a stage of float16 gates must fit in the float32 one");
  extern __shared__ __align__(128) unsigned char block_smem[];
  // This thread's group (0: the upper tiles of the chunk) and its index in the group.
  const int cgroup = static_cast<int>(threadIdx.x) / kThreads;
  const int tid = static_cast<int>(threadIdx.x) % kThreads;
  unsigned char* smem_raw = block_smem + cgroup * B::kGroupBytes;
  float* upper_gate_sum = reinterpret_cast<float*>(block_smem + B::kGateSumOffset);  // [head slot]
  T* Qs = reinterpret_cast<T*>(smem_raw) + L::kQ;
  T* KV = reinterpret_cast<T*>(smem_raw) + L::kKV;
  float* Gs = reinterpret_cast<float*>(smem_raw + L::kGateOffset);
  float* Rs = reinterpret_cast<float*>(smem_raw + L::kROffset);   // [head slot][key], log2 units
  float* Rq = reinterpret_cast<float*>(smem_raw + L::kRqOffset);  // [row], log2 units

  // Launched as a dependent of the kernel that wrote the cache (dependent_launch.cuh): wait for
  // it, then let the combine kernel launch, so its launch latency overlaps this kernel.
  wait_for_previous_kernel();
  allow_next_kernel();
  const int lane = tid & 31, warp = tid >> 5;
  const int group_id = lane >> 2, quad = lane & 3;
  const DecodeTile t = decode_tile<kKeys>(p, split.num_splits);
  const SequenceView& s = t.s;
  const int tq = static_cast<int>(p.seqlen_q);  // (32-bit divisions: see decode_tile)
  const int group = static_cast<int>(p.num_heads) / static_cast<int>(p.num_kv_heads);
  const int64_t head0 = t.kv_head * group + t.first_head;  // query head of head slot 0
  const int64_t p_last = s.len_k - 1;                       // position of the last query

  const T* kbase = static_cast<const T*>(p.k) + s.batch_index * p.k_batch_stride +
                   t.kv_head * p.k_head_stride;
  const T* vbase = static_cast<const T*>(p.v) + s.batch_index * p.v_batch_stride +
                   t.kv_head * p.v_head_stride;
  const TG* gbase = static_cast<const TG*>(p.log_fgate) + s.batch_index * p.g_batch_stride +
                       head0 * p.g_head_stride;

  // The group's tiles, walked downwards from `top_tile`: all of the chunk's, or its upper half
  // (group 0) or lower half (group 1).
  const int64_t chunk_tiles = max64(0, t.tile_hi - t.tile_lo + 1);  // a row shorter than its chunk: 0
  const int64_t upper_tiles = kGroups == 1 ? chunk_tiles : (chunk_tiles + 1) / 2;
  const int64_t num_tiles = cgroup == 0 ? upper_tiles : chunk_tiles - upper_tiles;
  const int64_t top_tile = t.tile_hi - (cgroup == 0 ? 0 : upper_tiles);
  const KVTileCopies<kHeadDim, kKeys> kv_copies(tid);
  auto load_kv = [&](int64_t it) {
    const int stage = static_cast<int>(it % kS);
    load_kv_tile<T, kHeadDim>(KV + 2 * stage * L::kTileElems, KV + (2 * stage + 1) * L::kTileElems,
                              kbase, vbase, p.k_row_stride, p.v_row_stride,
                              (top_tile - it) * kKeys, s.len_k, kv_copies);
  };
  // The prologue of the ring (the chunk's top kS - 1 tiles) starts with the top tile's K and V: a
  // short chunk's block is a chain of latencies, and their round trip to memory overlaps the rest of
  // the prologue (Q, the gates, rq), which lands in the same commit group.
  if (num_tiles > 0) load_kv(0);

  // Q rows (zero past the live rows) and rq of each row.
  {
    constexpr int kChunks = kHeadDim / 8;
    for (int idx = tid; idx < kRows * kChunks; idx += kThreads) {
      const int r = idx / kChunks, chunk = idx % kChunks;
      const bool valid = r < t.rows;
      const int packed = t.row0 + (valid ? r : 0);
      const int64_t h = t.kv_head * group + packed / tq, i = packed % tq;
      const T* src = static_cast<const T*>(p.q) + s.batch_index * p.q_batch_stride +
                     i * p.q_row_stride + h * p.q_head_stride + chunk * 8;
      cp_async_16(Qs + swizzled<kHeadDim>(r, chunk), src, valid);
    }
    if (tid < kRows) {
      const int r = tid;
      float rq = 0.f;
      if (r < t.rows) {
        const int packed = t.row0 + r;
        const int slot = packed / tq - t.first_head, i = packed % tq;
        for (int64_t l = p_last; l > s.query_position(i); --l)
          rq -= to_float(gbase[l * p.g_row_stride + slot * p.g_head_stride]);
      }
      Rq[r] = rq * kLog2e;
    }
  }
  // float32: one copy a gate; float16: a copy a pair of heads (nh is even there)
  const GateWalk walk = kHalfGates
                            ? gate_walk<kKeys>(1, t.nh / 2, true, tid)
                            : gate_walk<kKeys>(p.g_head_stride, t.nh, split.gates_heads_order, tid);
  auto load_gates = [&](int64_t it) {
    const int stage = static_cast<int>(it % kS);
    const int64_t j0 = (top_tile - it) * kKeys;
    if constexpr (kHalfGates)
      load_half_gate_tile<kKeys>(reinterpret_cast<__half*>(Gs + stage * L::kGStage), gbase,
                                 p.g_row_stride, walk, j0, s.len_k);
    else
      load_gate_tile<kKeys, L::kGStride>(Gs + stage * L::kGStage, gbase, p.g_row_stride,
                                         p.g_head_stride, walk, j0, s.len_k);
  };
  auto issue = [&](int64_t it) {
    if (it < num_tiles) {
      load_kv(it);
      load_gates(it);
    }
    cp_async_commit();  // (empty groups keep the wait counts uniform)
  };
  if (num_tiles > 0) load_gates(0);
  cp_async_commit();
#pragma unroll
  for (int it = 1; it < kS - 1; ++it) issue(it);

  const float scale_log2 = static_cast<float>(p.scale) * kLog2e;
  float o[kDimTiles][4];
#pragma unroll
  for (int n = 0; n < kDimTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  // Per head slot (slots warp, warp + 4, ...): sum of the gates of the tiles walked so far, i.e.
  // R at the top of the current tile.
  float carry_slots[kRows / kWarps];
#pragma unroll
  for (int c = 0; c < kRows / kWarps; ++c) carry_slots[c] = 0.f;
  uint32_t q_frag[kDimSteps][4];
  float rq[2];
  int slot_of[2];
  int64_t pos_of[2];
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    const int r = group_id + 8 * hi;
    const int packed = t.row0 + min(r, max(t.rows - 1, 0));
    slot_of[hi] = packed / tq - t.first_head;
    pos_of[hi] = r < t.rows ? s.query_position(packed % tq) : -1;  // dead rows see no key
  }

  for (int64_t it = 0; it < num_tiles; ++it) {
    cp_async_wait<kS - 2>();
    group_barrier<kGroups>(cgroup);  // stage `it` landed for the group; its warps are done with it - 1
    if (it == 0) {
#pragma unroll
      for (int ks = 0; ks < kDimSteps; ++ks)
        ldmatrix_x4(q_frag[ks], Qs + swizzled<kHeadDim>(lane & 15, ks * 2 + (lane >> 4)));
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) rq[hi] = Rq[group_id + 8 * hi];
    }
    issue(it + kS - 1);
    const int stage = static_cast<int>(it % kS);
    const int64_t j0 = (top_tile - it) * kKeys;
    // R of the tile's keys for each head slot: one warp per slot, kPerLane keys per lane.
    const float* G = Gs + stage * L::kGStage;
#pragma unroll
    for (int c = 0; c < kRows / kWarps; ++c) {
      const int slot = warp + kWarps * c;
      if (slot >= t.nh) break;
      float x[kPerLane], lane_sum = 0.f;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        if constexpr (kHalfGates)
          x[e] = __half2float(
              reinterpret_cast<const __half*>(G)[(kPerLane * lane + e) * kGhStride + slot]);
        else
          x[e] = G[slot * L::kGStride + kPerLane * lane + e];
        lane_sum += x[e];
      }
      const float incl = warp_inclusive_suffix_scan(lane_sum, lane);
      const float above = __shfl_down_sync(0xffffffffu, incl, 1);
      float after = lane < 31 ? above : 0.f;  // gates of the keys after this lane's
#pragma unroll
      for (int e = kPerLane - 1; e >= 0; --e) {
        Rs[slot * L::kRStride + kPerLane * lane + e] = (carry_slots[c] + after) * kLog2e;
        after += x[e];
      }
      carry_slots[c] += __shfl_sync(0xffffffffu, incl, 0);
    }
    group_barrier<kGroups>(cgroup);

    const T* Ks = KV + 2 * stage * L::kTileElems;
    const T* Vs = Ks + L::kTileElems;
    const int key_base = 16 * kSteps * warp;  // this warp's keys of the tile
    // S = Q K^T: 16 rows x 16 kSteps keys (2 kSteps n-tiles).
    float sc[2 * kSteps][4];
#pragma unroll
    for (int n = 0; n < 2 * kSteps; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < kDimSteps; ++ks) {
#pragma unroll
      for (int n2 = 0; n2 < kSteps; ++n2) {
        uint32_t kf[4];
        const int key = key_base + 16 * n2 + (lane & 7) + ((lane >> 4) << 3);
        ldmatrix_x4(kf, Ks + swizzled<kHeadDim>(key, ks * 2 + ((lane >> 3) & 1)));
        Mma::mma(sc[2 * n2], q_frag[ks], kf[0], kf[1]);
        Mma::mma(sc[2 * n2 + 1], q_frag[ks], kf[2], kf[3]);
      }
    }
    // Bias, mask and online softmax (log2 domain).
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 2 * kSteps; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hi = e >> 1;
        const int col = key_base + n * 8 + quad * 2 + (e & 1);
        const int64_t j = j0 + col;
        float x = fmaf(sc[n][e], scale_log2, rq[hi] + Rs[slot_of[hi] * L::kRStride + col]);
        if (j > pos_of[hi] || j < s.first_key) x = -INFINITY;
        sc[n][e] = x;
        tile_max[hi] = fmaxf(tile_max[hi], x);
      }
    }
    float correction[2];
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      float m = tile_max[hi];
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      const float new_max = fmaxf(row_max[hi], m);
      const float base = new_max == -INFINITY ? 0.f : new_max;
      correction[hi] = exp2f(row_max[hi] - base);
      row_max[hi] = new_max;
      tile_max[hi] = base;
    }
    uint32_t p_frag[kSteps][4];  // C fragments of n-tiles 2k, 2k+1 form the A fragment of step k
    float tile_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < 2 * kSteps; ++n) {
      const float p0 = exp2f(sc[n][0] - tile_max[0]), p1 = exp2f(sc[n][1] - tile_max[0]);
      const float p2 = exp2f(sc[n][2] - tile_max[1]), p3 = exp2f(sc[n][3] - tile_max[1]);
      tile_sum[0] += p0 + p1;
      tile_sum[1] += p2 + p3;
      p_frag[n / 2][(n & 1) * 2 + 0] = Mma::pack(p0, p1);
      p_frag[n / 2][(n & 1) * 2 + 1] = Mma::pack(p2, p3);
    }
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) row_sum[hi] = row_sum[hi] * correction[hi] + tile_sum[hi];
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) {
      o[n][0] *= correction[0];
      o[n][1] *= correction[0];
      o[n][2] *= correction[1];
      o[n][3] *= correction[1];
    }
    // O += P V over this warp's keys.
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
#pragma unroll
      for (int n2 = 0; n2 < kDimTiles / 2; ++n2) {
        uint32_t vf[4];
        const int key = key_base + 16 * ks + (lane & 7) + (((lane >> 3) & 1) << 3);
        ldmatrix_x4_trans(vf, Vs + swizzled<kHeadDim>(key, n2 * 2 + (lane >> 4)));
        Mma::mma(o[2 * n2], p_frag[ks], vf[0], vf[1]);
        Mma::mma(o[2 * n2 + 1], p_frag[ks], vf[2], vf[3]);
      }
    }
  }
  cp_async_wait<0>();
  // The lower group walks at most one tile fewer: it passes as many of its barriers as the upper
  // group does of its own, so that both reach the block's barriers below with equal counts.
  // (compute-sanitizer's racecheck reported the merge's reads across groups as races while the
  // counts differed, and none once they were equal.)
  if constexpr (kGroups == 2)
    for (int64_t it = num_tiles; it < upper_tiles; ++it) {
      group_barrier<kGroups>(cgroup);
      group_barrier<kGroups>(cgroup);
    }
  __syncthreads();  // every group's stages are free (they hold the merge buffers from here on)

  // Merge buffers of group g: O [warp][row][D], then the maxima and the sums [warp][row].
  auto merge_o = [&](int g) {
    return reinterpret_cast<float*>(reinterpret_cast<T*>(block_smem + g * B::kGroupBytes) + L::kKV);
  };
  auto merge_m = [&](int g) { return merge_o(g) + kWarps * kRows * kHeadDim; };
  auto merge_s = [&](int g) { return merge_m(g) + kWarps * kRows; };
  {
    float* Om = merge_o(cgroup);
    float* Mm = merge_m(cgroup);
    float* Sm = merge_s(cgroup);
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      row_sum[hi] += __shfl_xor_sync(0xffffffffu, row_sum[hi], 1);
      row_sum[hi] += __shfl_xor_sync(0xffffffffu, row_sum[hi], 2);
      const int r = group_id + 8 * hi;
      if (r >= t.rows) continue;  // dead rows are never read (a GQA group of 4 fills 4 of 16)
      if (quad == 0) {
        Mm[warp * kRows + r] = row_max[hi];
        Sm[warp * kRows + r] = row_sum[hi];
      }
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n)
        *reinterpret_cast<float2*>(Om + (warp * kRows + r) * kHeadDim + n * 8 + quad * 2) =
            make_float2(o[n][2 * hi], o[n][2 * hi + 1]);
    }
  }
  // The upper group's gate sums per head slot: what the lower group's scores all miss.
  if (kGroups == 2 && cgroup == 0 && lane == 0) {
#pragma unroll
    for (int c = 0; c < kRows / kWarps; ++c)
      if (warp + kWarps * c < t.nh) upper_gate_sum[warp + kWarps * c] = carry_slots[c];
  }
  __syncthreads();
  if (split.num_splits > 1 && lane == 0 && cgroup == kGroups - 1) {
    // The chunk's gate total per head (what the combine kernel carries to the chunks below). Two
    // row tiles may share a head: they write the same value.
#pragma unroll
    for (int c = 0; c < kRows / kWarps; ++c) {
      const int slot = warp + kWarps * c;
      if (slot < t.nh)
        split.gate_total[(blockIdx.y * p.batch + s.batch_index) * p.num_heads + head0 + slot] =
            kGroups == 2 ? upper_gate_sum[slot] + carry_slots[c] : carry_slots[c];
    }
  }
  if (cgroup != 0) return;
  // The epilogue (group 0): 8 threads per row, thread q of a row the columns 4q..4q+3 of every
  // 32 (so that the 8 threads' 16-byte loads and stores are one contiguous 128 bytes). Per row the
  // max of every warp's maximum (the lower group's shifted by the upper group's gate sum of the
  // row's head; -inf stays -inf), then the rescaled sums.
  constexpr int kPerThread = kHeadDim / 8;
  constexpr int kMerged = kGroups * kWarps;
  const int r = tid / 8, q = tid % 8;
  auto column = [&](int d) { return (d / 4) * 32 + 4 * q + d % 4; };  // of the thread's d-th value
  if (r >= t.rows) return;
  const float lower_shift =
      kGroups == 2 ? upper_gate_sum[(t.row0 + r) / tq - t.first_head] * kLog2e : 0.f;
  float row_max_w[kMerged];
#pragma unroll
  for (int w = 0; w < kMerged; ++w)
    row_max_w[w] = merge_m(w / kWarps)[(w % kWarps) * kRows + r] + (w < kWarps ? 0.f : lower_shift);
  float m = -INFINITY;
#pragma unroll
  for (int w = 0; w < kMerged; ++w) m = fmaxf(m, row_max_w[w]);
  const float base = m == -INFINITY ? 0.f : m;
  float scale_w[kMerged], total = 0.f;
#pragma unroll
  for (int w = 0; w < kMerged; ++w) {
    scale_w[w] = exp2f(row_max_w[w] - base);
    total += merge_s(w / kWarps)[(w % kWarps) * kRows + r] * scale_w[w];
  }
  const bool empty = total == 0.f;
  const float inv = empty ? 0.f : 1.f / total;
  const float lse2 = empty ? -INFINITY : base + log2f(total);
  const int packed = t.row0 + r;
  const int64_t h = t.kv_head * group + packed / tq, i = packed % tq;
  float acc[kPerThread] = {};
#pragma unroll
  for (int w = 0; w < kMerged; ++w) {
    const float* o_w = merge_o(w / kWarps) + ((w % kWarps) * kRows + r) * kHeadDim;
#pragma unroll
    for (int d = 0; d < kPerThread; d += 4) {
      const float4 x = *reinterpret_cast<const float4*>(o_w + column(d));
      acc[d] += x.x * scale_w[w];
      acc[d + 1] += x.y * scale_w[w];
      acc[d + 2] += x.z * scale_w[w];
      acc[d + 3] += x.w * scale_w[w];
    }
  }
#pragma unroll
  for (int d = 0; d < kPerThread; ++d) acc[d] *= inv;
  const int64_t row = s.batch_index * tq + i;  // (batch, query) row of the lse layout
  if (split.num_splits > 1) {
    const int64_t total_rows = p.batch * tq;
    const int64_t slot = (blockIdx.y * p.num_heads + h) * total_rows + row;
    float* out = split.out_partial + slot * kHeadDim;
#pragma unroll
    for (int d = 0; d < kPerThread; d += 4)
      *reinterpret_cast<float4*>(out + column(d)) =
          make_float4(acc[d], acc[d + 1], acc[d + 2], acc[d + 3]);
    if (q == 0) split.lse_partial[slot] = lse2;
    return;
  }
  T* out = static_cast<T*>(p.out) + s.batch_index * p.o_batch_stride + i * p.o_row_stride +
           h * p.o_head_stride;
#pragma unroll
  for (int d = 0; d < kPerThread; d += 2)
    *reinterpret_cast<uint32_t*>(out + column(d)) = Mma::pack(acc[d], acc[d + 1]);
  if (q == 0) static_cast<float*>(p.lse)[(s.batch_index * p.num_heads + h) * tq + i] = lse2 * kLn2;
}

// Merges the chunks: one block of 4 warps per (batch * query row, head). The log-sum-exp of chunk
// c is shifted by the gates of the chunks above it (carry_c = sum of gate_total over c' > c, summed
// from the top in a fixed order), then the chunks are weighted as in any split-KV merge. The warps
// take every 4th chunk, kCombineUnroll chunks' loads in flight at once: a long cache with few KV
// heads is cut into up to 256 chunks, and one warp walking them one load at a time was latency
// bound (~10 us at B=1, 32/4 heads, 128k keys).
constexpr int kCombineUnroll = 4;

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    decode_combine_kernel(const ForwardParams p, const DecodeSplit split) {
  constexpr int kPerLane = kHeadDim / 32;  // 2 or 4 consecutive values: one 8- or 16-byte load
  using Vec = std::conditional_t<kPerLane == 4, float4, float2>;
  __shared__ float weight[kMaxSplits];
  __shared__ __align__(16) float part[kWarps][kHeadDim];
  __shared__ float weight_sum, lse_base;
  wait_for_previous_kernel();  // the chunks' partial results are written
  allow_next_kernel();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t total_rows = p.batch * p.seqlen_q;
  const int num_heads = static_cast<int>(p.num_heads), tq = static_cast<int>(p.seqlen_q);
  const int item = static_cast<int>(blockIdx.x);  // (32-bit divisions: see decode_tile)
  const int row = item / num_heads, h = item % num_heads;
  const int b = row / tq, i = row % tq;
  const int S = split.num_splits;
  // Every warp's first kCombineUnroll chunks are loaded before the weights are known (their loads
  // overlap warp 0's pass over the lse): one round of memory latency fewer on short splits. Every
  // chunk's partial output is written (zeros for an empty chunk), so the loads are safe.
  const float* src = split.out_partial + (h * total_rows + row) * kHeadDim + lane * kPerLane;
  const int64_t chunk_stride = p.num_heads * total_rows * kHeadDim;
  Vec first[kCombineUnroll];
#pragma unroll
  for (int u = 0; u < kCombineUnroll; ++u) {
    const int c = warp + u * kWarps;
    first[u] = c < S ? *reinterpret_cast<const Vec*>(src + c * chunk_stride) : Vec{};
  }
  if (warp == 0) {
    // Shifted lse of every chunk, 32 chunks at a time from the top.
    float carry = 0.f, m = -INFINITY;
    for (int c0 = ((S - 1) / 32) * 32; c0 >= 0; c0 -= 32) {
      const int c = c0 + lane;
      const float gt = c < S ? split.gate_total[(static_cast<int64_t>(c) * p.batch + b) * p.num_heads + h] : 0.f;
      const float incl = warp_inclusive_suffix_scan(gt, lane);
      const float above = __shfl_down_sync(0xffffffffu, incl, 1);
      const float shift = carry + (lane < 31 ? above : 0.f);
      if (c < S) {
        const float lse = split.lse_partial[(static_cast<int64_t>(c) * p.num_heads + h) * total_rows + row];
        weight[c] = lse + shift * kLog2e;
        m = fmaxf(m, weight[c]);
      }
      carry += __shfl_sync(0xffffffffu, incl, 0);
    }
    m = warp_max(m);
    const float base = m == -INFINITY ? 0.f : m;
    float sum = 0.f;
    for (int c = lane; c < S; c += 32) {
      weight[c] = exp2f(weight[c] - base);
      sum += weight[c];
    }
    sum = warp_sum(sum);
    if (lane == 0) {
      weight_sum = sum;
      lse_base = base;
    }
  }
  __syncthreads();
  float acc[kPerLane] = {};
  for (int c0 = warp; c0 < S; c0 += kWarps * kCombineUnroll) {
    Vec x[kCombineUnroll];
    float w[kCombineUnroll];
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      const int c = c0 + u * kWarps;
      w[u] = c < S ? weight[c] : 0.f;
      // Later chunks of weight 0 (empty, or far below the others) are not read.
      x[u] = c0 == warp ? first[u]
                        : (w[u] != 0.f ? *reinterpret_cast<const Vec*>(src + c * chunk_stride) : Vec{});
    }
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      if (w[u] == 0.f) continue;  // 0 x (a partial of a far chunk) must stay 0
      const float* xu = reinterpret_cast<const float*>(&x[u]);
#pragma unroll
      for (int d = 0; d < kPerLane; ++d) acc[d] += w[u] * xu[d];
    }
  }
#pragma unroll
  for (int d = 0; d < kPerLane; ++d) part[warp][lane * kPerLane + d] = acc[d];
  __syncthreads();
  if (warp != 0) return;
  const float sum = weight_sum;
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  T* out = static_cast<T*>(p.out) + b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride;
#pragma unroll
  for (int d = 0; d < kPerLane; ++d) {
    const int col = lane * kPerLane + d;
    // A fixed order of the four warps' sums: the result does not depend on timing.
    const float x = ((part[0][col] + part[1][col]) + part[2][col]) + part[3][col];
    out[col] = from_float<T>(x * inv);
  }
  if (lane == 0)
    static_cast<float*>(p.lse)[(b * p.num_heads + h) * p.seqlen_q + i] =
        sum > 0.f ? (lse_base + log2f(sum)) * kLn2 : -INFINITY;
}

}  // namespace fox::cuda::decode

namespace fox::cuda {

// The current device (-1 where it cannot be asked: the per-device caches below then compute).
inline int decode_current_device() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return device;
}

// Allows the kernel its dynamic shared memory, once per device (cudaFuncSetAttribute costs ~2 us
// of host time: set at every call, it was a few % of an eager decoding step); an error where it
// needs more than a block of this GPU may have.
template <typename T, typename TG, int kHeadDim, int kGroups>
cudaError_t allow_decode_smem() {
  constexpr size_t smem = decode::BlockSmem<kHeadDim, kGroups>::kBytes;
  if (smem <= 48 * 1024) return cudaSuccess;
  static PerDevice<cudaError_t> result;
  return result.get(decode_current_device(), [] {
    return cudaFuncSetAttribute(decode::decode_kernel<T, TG, kHeadDim, kGroups>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  });
}

// Resident blocks per SM of the kernel with kGroups groups: 0 where it does not fit an SM (paired
// blocks need 2 x 81-93 KB of shared memory: more than an sm_80 block may have).
template <typename T, typename TG, int kHeadDim, int kGroups>
int decode_blocks_per_sm_of() {
  using namespace decode;
  int blocks = 0;
  if (allow_decode_smem<T, TG, kHeadDim, kGroups>() != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &blocks, decode_kernel<T, TG, kHeadDim, kGroups>, kThreads * kGroups,
          BlockSmem<kHeadDim, kGroups>::kBytes) != cudaSuccess) {
    (void)cudaGetLastError();  // a form that does not fit is not an error: the plan avoids it
    return 0;
  }
  return blocks;
}

// Per device (a machine may mix GPU models), looked up once.
template <typename T, int kHeadDim>
int decode_blocks_per_sm(bool half_gates, bool paired) {
  static std::array<PerDevice<int>, 4> by_form;  // [paired][half_gates]
  return by_form[2 * paired + half_gates].get(decode_current_device(), [&] {
    if (paired)
      return half_gates ? decode_blocks_per_sm_of<T, __half, kHeadDim, 2>()
                        : decode_blocks_per_sm_of<T, float, kHeadDim, 2>();
    return std::max(1, half_gates ? decode_blocks_per_sm_of<T, __half, kHeadDim, 1>()
                                  : decode_blocks_per_sm_of<T, float, kHeadDim, 1>());
  });
}

template <typename T, typename TG, int kHeadDim, int kGroups>
void run_decode_forward_with(const ForwardParams& p, int num_splits, float* out_partial,
                             float* lse_partial, float* gate_total, cudaStream_t stream) {
  using namespace decode;
  const int64_t group = p.heads_per_kv_head();
  const dim3 grid(static_cast<unsigned>((group * p.seqlen_q + kRows - 1) / kRows),
                  static_cast<unsigned>(num_splits), static_cast<unsigned>(p.batch * p.num_kv_heads));
  if (grid.x == 0 || grid.z == 0) return;
  static const bool keys_fastest = std::getenv("FOX_DECODE_GATES_KEYS_FASTEST") != nullptr;
  DecodeSplit split{num_splits, out_partial, lse_partial, gate_total, !keys_fastest};
  (void)allow_decode_smem<T, TG, kHeadDim, kGroups>();  // a failure shows in the launch
  launch_dependent(decode_kernel<T, TG, kHeadDim, kGroups>, grid,
                   dim3(kThreads * kGroups), BlockSmem<kHeadDim, kGroups>::kBytes, stream, p, split);
  if (num_splits > 1) {
    const int64_t items = p.batch * p.seqlen_q * p.num_heads;  // one block each
    launch_dependent(decode_combine_kernel<T, kHeadDim>, dim3(static_cast<unsigned>(items)),
                     dim3(kThreads), 0, stream, p, split);
  }
}

template <typename T, typename TG, int kHeadDim>
void run_decode_forward_planned(const ForwardParams& p, const DecodePlan& plan, float* out_partial,
                                float* lse_partial, float* gate_total, cudaStream_t stream) {
  if (plan.paired)
    run_decode_forward_with<T, TG, kHeadDim, 2>(p, plan.num_splits, out_partial, lse_partial,
                                                gate_total, stream);
  else
    run_decode_forward_with<T, TG, kHeadDim, 1>(p, plan.num_splits, out_partial, lse_partial,
                                                gate_total, stream);
}

template <typename T, int kHeadDim>
void run_decode_forward(const ForwardParams& p, bool half_gates, const DecodePlan& plan,
                        float* out_partial, float* lse_partial, float* gate_total,
                        cudaStream_t stream) {
  if (half_gates)
    run_decode_forward_planned<T, __half, kHeadDim>(p, plan, out_partial, lse_partial, gate_total,
                                                    stream);
  else
    run_decode_forward_planned<T, float, kHeadDim>(p, plan, out_partial, lse_partial, gate_total,
                                                   stream);
}

}  // namespace fox::cuda
