// CUDA backend of the fox ops: the only CUDA file that touches ATen. It checks arguments (through
// the shared checks of forgetting_attention.cpp), allocates outputs and workspaces, fills the POD
// params and picks a kernel: the decoding kernel (seqlen_q <= 16), split-KV decoding on the
// prefill kernels, the tensor-core kernels (head dim 64/128,
// fp16/bf16: the Hopper ones on sm_90a, the portable mma.sync ones elsewhere) or the generic
// kernels (any head dim, fp16/bf16/fp32).
#include <algorithm>
#include <cstdlib>
#include <limits>
#include <string>
#include <type_traits>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../forgetting_attention.h"
#include "../per_device.h"
#include "launch.h"
#include "static_switch.h"

namespace fox::cuda {
namespace {

ElementType element_type(const at::Tensor& q) {
  switch (q.scalar_type()) {
    case at::kHalf:
      return ElementType::kHalf;
    case at::kBFloat16:
      return ElementType::kBFloat16;
    case at::kFloat:
      return ElementType::kFloat;
    default:
      TORCH_CHECK(false, "the CUDA backend of forgetting_attention supports float16, bfloat16 and "
                  "float32; q is ", q.scalar_type(), " (float64 runs on the CPU backend)");
  }
}

// While the current stream is captured into a CUDA graph nothing may synchronize: the checks that
// read index tensors' values are skipped then (the kernels clamp them).
bool capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

// Longest sequence of the batch (sizes the grids): Tq, or the largest cu_seqlens difference.
int64_t max_sequence_length(const detail::IndexTensors& idx, int64_t seqlen) {
  if (!idx.cu_seqlens.has_value()) return seqlen;
  const auto& cu = *idx.cu_seqlens;
  return (cu.slice(0, 1) - cu.slice(0, 0, -1)).max().item<int64_t>();
}

// Grids are 1-D with one block per (sequence, head, tile).
void check_grid(int64_t blocks) {
  TORCH_CHECK(blocks < (int64_t{1} << 31), "forgetting_attention: problem too large for one launch (",
              blocks, " blocks)");
}

// The Hopper kernels count positions inside a sequence in 32 bits.
bool positions_fit_32_bits(int64_t longest_sequence) { return longest_sequence < (int64_t{1} << 31); }

// The tensor-core path loads rows with 16-byte vectors.
bool rows_are_16_byte_aligned(const at::Tensor& x) {
  const int64_t elems = 16 / x.element_size();
  return reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && x.stride(0) % elems == 0 &&
         x.stride(1) % elems == 0 && x.stride(2) % elems == 0;
}

// An on/off switch in the environment: set, not empty and not "0".
bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}

// FOX_DISABLE_HOPPER_KERNELS=1 runs the portable (sm_80) kernels on a Hopper GPU too: for
// side-by-side benchmarks and for bisecting.
bool hopper_kernels_enabled() {
  static const bool enabled = !env_flag("FOX_DISABLE_HOPPER_KERNELS");
  return enabled;
}

// The Hopper backward's form. Two kernels (seven matrix products per tile pair), or one kernel of
// five products whose dQ a writer warpgroup adds up in float32 (bench/NOTES.md, versions 43 and
// 50): in turns, the default (FOX_FUSED_BACKWARD=0 turns it off), or in whatever order the tiles
// finish (FOX_NONDETERMINISTIC_BACKWARD=1; off under torch.use_deterministic_algorithms). The two
// kernels and the turns are bitwise reproducible, each with its own bits. Fused only where it is
// faster: sequences of at least FOX_FUSED_BACKWARD_MIN_LEN queries (default 1024 at head dim 64,
// where below that the tail of the turns and converting the float32 accumulator cost what the two
// products save; any length at 128: bench/NOTES.md, versions 53 and 68), and not with pruning (its walks end early,
// which the producer warp would have to foresee and which would leave turns untaken). Read per
// call (tests set them).
enum class BackwardForm { kTwoKernels, kFusedInTurns, kFusedAnyOrder };
BackwardForm backward_form(int64_t max_len_q, int64_t head_dim, bool pruned) {
  const char* min_len = std::getenv("FOX_FUSED_BACKWARD_MIN_LEN");
  const int64_t bound = min_len != nullptr && *min_len != '\0' ? std::atoll(min_len) : (head_dim > 64 ? 0 : 1024);
  if (pruned || max_len_q < bound) return BackwardForm::kTwoKernels;
  if (env_flag("FOX_NONDETERMINISTIC_BACKWARD") && !at::globalContext().deterministicAlgorithms())
    return BackwardForm::kFusedAnyOrder;
  const char* fused = std::getenv("FOX_FUSED_BACKWARD");
  if (fused != nullptr && std::string(fused) == "0") return BackwardForm::kTwoKernels;
  return BackwardForm::kFusedInTurns;
}

// FOX_DISABLE_DECODE_KERNEL=1 sends decoding to the prefill kernels' split-KV path (comparisons).
bool decode_kernel_enabled() {
  static const bool enabled = !env_flag("FOX_DISABLE_DECODE_KERNEL");
  return enabled;
}

// FOX_DECODE_PAIRED=0 keeps the decoding kernel on single blocks, =1 pairs them wherever the grid
// has at most one block an SM (A/B runs, tests); read per call, as FOX_DECODE_SPLITS.
int decode_paired_override() {
  const char* v = std::getenv("FOX_DECODE_PAIRED");
  return v == nullptr || *v == '\0' ? -1 : std::atoi(v);
}

// Blocks the memory system needs in flight to stream a cache at this GPU's bandwidth (Little's
// law): bandwidth x a loaded latency of ~2 us over a block's ~32 KB in flight (one K and one V
// tile). ~200 on an H100 (3.35 TB/s) and more than a wave of two blocks an SM on an H200 (4.8
// TB/s): measured, an H100 streamed a GQA cache fastest with 192-224 blocks (256: 3-6% slower),
// an H200 with 256 (192: 10-20% slower).
int64_t decode_blocks_in_flight() {
  static PerDevice<int64_t> cached;
  const int device = c10::cuda::current_device();
  return cached.get(device, [device] {
    int khz = 0, bus_bits = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device));
    const double bytes_per_s = 2.0 * 1e3 * khz * (bus_bits / 8.0);  // double data rate
    return std::max<int64_t>(1, static_cast<int64_t>(bytes_per_s * 2e-6 / 32768.0));
  });
}

// The decoding kernel's plan: chunks per row and block form. A function of the shapes and the
// device only (never of the lengths in device memory), so a captured CUDA graph replays the same
// plan.
//
// Paired blocks (where they fit an SM) where the unsplit grid gives between half of the SMs and all of them one block and
// the cache is short: single blocks would need a split to put two groups of warps on an SM, and the
// split's partial results, combine and second wave cost more than they bring (B=8, 12/12 heads,
// D=128, 2k keys: 55.6 us single and split, 50.7 us paired and unsplit; H100). A long cache is
// bound by bandwidth, and a split reaches every SM while an unsplit grid leaves up to half of them
// idle: paired there only if the grid covers nearly all SMs (B=8, 16/16 heads, D=64, 128k keys:
// 975 against 996 us, but 12/12 heads 788 against 765; H200). Where fewer blocks face the cache,
// a split gives two single blocks an SM anyway, and pairing measured the same (within 3%).
//
// Otherwise single blocks: where the unsplit grid fits one wave (resident blocks per SM x SMs),
// the most chunks whose blocks stay within one wave and within the blocks the memory system needs
// in flight (decode_blocks_in_flight), if that comes within 90% of it. Else waves: a last wave
// that is mostly empty costs as much as a full one, so, as FlashAttention's split heuristic does,
// the fewest chunks whose wave efficiency (blocks / (waves x wave size)) is within 95% of the
// best. Candidates are whole numbers of key tiles per chunk, so the chunks of the longest row are
// equal (no empty blocks), and a chunk has at least 128 keys (two 64-key tiles at D=128: one-tile
// chunks measured 3-5% slower on 2k caches, their partial results and combine being the larger
// part there). FOX_DECODE_SPLITS overrides the chunks (tuning, tests).
DecodePlan plan_decode(const ForwardParams& p, int blocks_per_sm, bool paired_fits) {
  const char* override_env = std::getenv("FOX_DECODE_SPLITS");  // read per call: tests set it
  const int override_splits = override_env ? std::atoi(override_env) : 0;
  const int paired_override = decode_paired_override();
  const int64_t row_tiles = (p.heads_per_kv_head() * p.seqlen_q + 15) / 16;
  const int64_t base = p.batch * p.num_kv_heads * row_tiles;
  const int64_t keys_per_tile = decode_keys_per_tile(static_cast<int>(p.head_dim));
  const int64_t key_tiles = std::max<int64_t>(1, (p.seqlen_k + keys_per_tile - 1) / keys_per_tile);
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t max_splits = std::min<int64_t>(kDecodeMaxSplits, key_tiles);
  // s chunks of ceil(key_tiles / s) tiles: ceil(key_tiles / that) of them are non-empty. Over
  // s = 1..max_splits this gives every equal-chunk split (at most max_splits candidates, not one
  // per key tile: the plan runs on every eager decoding step).
  auto equal_chunks = [&](int64_t s) {
    const int64_t tiles_per_chunk = (key_tiles + s - 1) / s;
    return (key_tiles + tiles_per_chunk - 1) / tiles_per_chunk;
  };
  // The most equal chunks (of at most `splits` candidates) whose grid has at most `blocks` blocks;
  // 0 where none has.
  auto most_chunks_within = [&](int64_t blocks, int64_t splits) {
    int64_t chunks = 0;
    for (int64_t s = 1; s <= splits; ++s)
      if (base * equal_chunks(s) <= blocks) chunks = equal_chunks(s);
    return chunks;
  };
  DecodePlan plan;
  const bool short_cache = p.seqlen_k <= 8192;
  plan.paired = paired_fits && base <= sms &&
                (paired_override == 1 ||
                 (paired_override != 0 && (8 * base >= 7 * sms || (short_cache && 2 * base >= sms))));
  if (override_splits > 0) {
    plan.num_splits = static_cast<int>(std::min<int64_t>(override_splits, max_splits));
    return plan;
  }
  if (plan.paired) {  // one wave of at most SMs paired blocks (base <= sms: one chunk at least)
    plan.num_splits = static_cast<int>(most_chunks_within(sms, max_splits));
    return plan;
  }
  // A short cache whose unsplit blocks already give most SMs one: splitting doubles the blocks per
  // SM but adds the partial results and the combine, which cost more than they bring there (B=8,
  // 16 heads, D=64, 2k keys: 37 us unsplit against 41 us in 2 chunks). Longer caches keep the
  // plan below: their time is bandwidth, which a second block per SM raises.
  if (p.seqlen_k <= 2048 && 5 * base >= 4 * sms) return plan;
  const int64_t wave = static_cast<int64_t>(blocks_per_sm) * sms;
  const int64_t splits_limit =
      std::min(max_splits, std::max<int64_t>(1, (p.seqlen_k + 127) / 128));  // >= 128 keys a chunk
  const int64_t in_flight = std::min(wave, decode_blocks_in_flight());
  if (base <= wave) {  // one wave: as many blocks as the memory system needs in flight
    const int64_t one_wave = most_chunks_within(in_flight, splits_limit);
    if (one_wave > 0 && 10 * base * one_wave >= 9 * in_flight) {
      plan.num_splits = static_cast<int>(one_wave);
      return plan;
    }
  }
  auto efficiency = [&](int64_t splits) {
    const int64_t blocks = base * splits, waves = (blocks + wave - 1) / wave;
    return static_cast<double>(blocks) / static_cast<double>(waves * wave);
  };
  double best = 0.0;
  for (int64_t s = 1; s <= splits_limit; ++s) best = std::max(best, efficiency(equal_chunks(s)));
  for (int64_t s = 1; s <= splits_limit; ++s)
    if (efficiency(equal_chunks(s)) >= 0.95 * best) {
      plan.num_splits = static_cast<int>(equal_chunks(s));
      return plan;
    }
  return plan;
}

// The decoding kernel copies float16 gates two adjacent heads at a time (cp.async moves 4 bytes at
// least): the (B, T, H) layout with even strides, an even group, and row tiles (16 packed rows of
// head-in-group x query) that start at even heads.
bool half_gates_in_pairs(const at::Tensor& g, int64_t seqlen_q, int64_t group) {
  const bool even_layout = g.stride(2) == 1 && g.stride(1) % 2 == 0 && g.stride(0) % 2 == 0 &&
                           reinterpret_cast<uintptr_t>(g.data_ptr()) % 4 == 0 && group % 2 == 0;
  const bool even_tiles =
      group * seqlen_q <= 16 || (16 % seqlen_q == 0 && (16 / seqlen_q) % 2 == 0);
  return even_layout && even_tiles;
}

// Split-KV decoding pays off when few (batch, head, query tile) blocks would face a long cache.
// blocks_per_sm: how many split blocks per SM the plan aims at (the kernel's occupancy and the
// latency it needs hidden); FOX_SPLIT_BLOCKS_PER_SM overrides it (for tuning).
SplitKVParams plan_split_kv(const ForwardParams& p, const detail::IndexTensors& idx, int key_tile,
                            int blocks_per_sm) {
  SplitKVParams split;
  split.key_tile = key_tile;
  const int64_t kKeyTile = key_tile;
  if (idx.cu_seqlens.has_value() || p.seqlen_q > 16 || p.seqlen_k < 1024) return split;
  const int64_t base_blocks = p.batch * p.num_heads;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  if (base_blocks >= 2 * sms) return split;
  const int64_t key_tiles = (p.seqlen_k + kKeyTile - 1) / kKeyTile;
  static const int override_blocks = [] {
    const char* v = std::getenv("FOX_SPLIT_BLOCKS_PER_SM");
    return v ? std::atoi(v) : 0;
  }();
  if (override_blocks > 0) blocks_per_sm = override_blocks;
  // Whole waves: rounding down keeps the last wave full (a few leftover blocks would cost a wave).
  const int64_t wanted_splits = std::max<int64_t>(1, blocks_per_sm * sms / base_blocks);
  int64_t tiles_per_split = std::max<int64_t>(4, (key_tiles + wanted_splits - 1) / wanted_splits);
  while ((key_tiles + tiles_per_split - 1) / tiles_per_split > 1024) tiles_per_split *= 2;
  const int64_t splits = (key_tiles + tiles_per_split - 1) / tiles_per_split;
  if (splits <= 1) return split;
  split.num_splits = static_cast<int>(splits);
  split.tiles_per_split = tiles_per_split;
  split.total_rows = p.batch * p.seqlen_q;
  return split;
}

std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, const at::Tensor& log_fgate,
                                           const std::optional<at::Tensor>& seq_start,
                                           const std::optional<at::Tensor>& cu_seqlens,
                                           std::optional<double> sm_scale,
                                           std::optional<double> adaptive_threshold,
                                           const std::optional<at::Tensor>& cache_seqlens) {
  const auto idx = detail::check_forward_args(q, k, v, log_fgate, seq_start, cu_seqlens, sm_scale,
                                              adaptive_threshold, cache_seqlens,
                                              !capturing());
  const ElementType type = element_type(q);
  const c10::cuda::CUDAGuard guard(q.device());
  const auto qc = detail::with_unit_last_stride(q), kc = detail::with_unit_last_stride(k),
             vc = detail::with_unit_last_stride(v);
  auto out = at::empty(q.sizes(), q.options());
  auto lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) {
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {out, lse};
  }
  const bool tensor_cores = type != ElementType::kFloat && fast_head_dim(q.size(3)) &&
                            rows_are_16_byte_aligned(qc) && rows_are_16_byte_aligned(kc) &&
                            rows_are_16_byte_aligned(vc) && rows_are_16_byte_aligned(out);
  const bool decode = tensor_cores && q.size(1) <= 16 && !idx.cu_seqlens.has_value() &&
                      decode_kernel_enabled();
  // float16 gates are read as they are by the decoding kernel where it can copy them a pair of
  // heads at a time; every other kernel and layout takes them as float32.
  const bool half_gates = log_fgate.scalar_type() == at::kHalf && decode &&
                          half_gates_in_pairs(log_fgate, q.size(1), q.size(2) / k.size(2));
  const at::Tensor gate = log_fgate.scalar_type() == at::kHalf && !half_gates
                              ? log_fgate.to(at::kFloat)
                              : log_fgate;
  ForwardParams p;
  detail::fill_forward_params(p, qc, kc, vc, gate, out, lse, idx,
                              detail::resolve_scale(sm_scale, q.size(3)), adaptive_threshold);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t max_len_q = max_sequence_length(idx, q.size(1));
  check_grid(((max_len_q + 31) / 32) * p.num_heads * p.batch);

  // (A sequence is at most as long as its tensor.)
  const bool hopper = tensor_cores && hopper_kernels_enabled() && hopper_kernels_available() &&
                      positions_fit_32_bits(std::max(q.size(1), k.size(1)));
  auto f32 = q.options().dtype(at::kFloat);
  if (decode) {
    FOX_ELEMENT_SWITCH(type, T, [&] {
      if constexpr (!std::is_same_v<T, float>) {
        FOX_FAST_HEAD_DIM_SWITCH(p.head_dim, kHeadDim, [&] {
          const DecodePlan plan =
              plan_decode(p, decode_blocks_per_sm<T, kHeadDim>(half_gates, false),
                          decode_blocks_per_sm<T, kHeadDim>(half_gates, true) > 0);
          const int64_t splits = plan.num_splits;
          at::Tensor out_partial, lse_partial, gate_total;
          if (splits > 1) {
            const int64_t rows = p.batch * p.seqlen_q;
            out_partial = at::empty({splits, p.num_heads, rows, p.head_dim}, f32);
            lse_partial = at::empty({splits, p.num_heads, rows}, f32);
            gate_total = at::empty({splits, p.batch, p.num_heads}, f32);
          }
          auto ptr = [](at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; };
          run_decode_forward<T, kHeadDim>(p, half_gates, plan, ptr(out_partial), ptr(lse_partial),
                                          ptr(gate_total), stream);
        });
      }
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {out, lse};
  }
  // T of the Hopper kernels: per key-tile suffix sums of the gates (hopper_forward.cuh)
  auto gate_suffix = [&] { return at::empty({k.size(0), p.num_heads, k.size(1)}, f32); };
  // One Hopper block per SM (its shared memory): one wave of split blocks measured fastest.
  SplitKVParams split = hopper ? plan_split_kv(p, idx, 128, 1)
                               : plan_split_kv(p, idx, tensor_cores ? 64 : 32, 4);
  if (split.num_splits > 1) {
    auto out_partial = at::empty({split.num_splits, p.num_heads, split.total_rows, p.head_dim}, f32);
    auto lse_partial = at::empty({split.num_splits, p.num_heads, split.total_rows}, f32);
    auto carry = at::empty({p.batch, p.num_heads, split.num_splits}, f32);
    split.out_partial = out_partial.data_ptr<float>();
    split.lse_partial = lse_partial.data_ptr<float>();
    split.carry = carry.data_ptr<float>();
    FOX_ELEMENT_SWITCH(type, T, [&] {
      if constexpr (!std::is_same_v<T, float>) {
        if (tensor_cores) {
          FOX_FAST_HEAD_DIM_SWITCH(p.head_dim, kHeadDim, [&] {
            if (hopper)
              run_hopper_split_kv_forward<T, kHeadDim>(p, split, gate_suffix().data_ptr<float>(), stream);
            else
              run_fast_split_kv_forward<T, kHeadDim>(p, split, stream);
          });
          return;
        }
      }
      run_split_kv_forward<T>(p, split, stream);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {out, lse};
  }

  if (tensor_cores) {
    FOX_ELEMENT_SWITCH(type, T, [&] {
      if constexpr (!std::is_same_v<T, float>) {
        FOX_FAST_HEAD_DIM_SWITCH(p.head_dim, kHeadDim, [&] {
          if (hopper) {
            const int64_t max_len_k = idx.cu_seqlens.has_value() ? max_len_q : p.seqlen_k;
            auto workspace = at::empty({forward_workspace_words(p)}, f32);
            run_hopper_forward<T, kHeadDim>(p, workspace.data_ptr<float>(), max_len_q, max_len_k, stream);
          } else {
            run_fast_forward<T, kHeadDim>(p, max_len_q, stream);
          }
        });
      }
    });
  } else {
    FOX_ELEMENT_SWITCH(type, T, [&] { run_generic_forward<T>(p, max_len_q, stream); });
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& log_fgate, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& seq_start, const std::optional<at::Tensor>& cu_seqlens,
    std::optional<double> sm_scale, std::optional<double> adaptive_threshold,
    const std::optional<at::Tensor>& cache_seqlens) {
  const auto idx = detail::check_forward_args(q, k, v, log_fgate, seq_start, cu_seqlens, sm_scale,
                                              adaptive_threshold, cache_seqlens,
                                              !capturing());
  detail::check_backward_args(grad_out, q, out, lse);
  const ElementType type = element_type(q);
  const c10::cuda::CUDAGuard guard(q.device());
  const auto qc = detail::with_unit_last_stride(q), kc = detail::with_unit_last_stride(k),
             vc = detail::with_unit_last_stride(v);
  // The kernels read out and grad_out in the dtype of q.
  const auto oc = detail::with_unit_last_stride(out.to(q.scalar_type()));
  const auto doc = detail::with_unit_last_stride(grad_out.to(q.scalar_type()));
  auto dq = at::empty(q.sizes(), q.options());
  // Keys past a row's cache_seqlens get no gradient: the kernels skip them, so start from zeros.
  const auto alloc = [&](const at::Tensor& x) {
    return cache_seqlens.has_value() ? at::zeros(x.sizes(), x.options())
                                     : at::empty(x.sizes(), x.options());
  };
  auto dk = alloc(k);
  auto dv = alloc(v);
  // The backward kernels read and write float32 gates (float16 ones are converted here and back).
  const at::Tensor gate =
      log_fgate.scalar_type() == at::kHalf ? log_fgate.to(at::kFloat) : log_fgate;
  auto dg = alloc(gate);
  const auto in_gate_dtype = [&](at::Tensor x) { return x.to(log_fgate.scalar_type()); };
  if (q.numel() == 0 || k.numel() == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    dg.zero_();
    return {dq, dk, dv, in_gate_dtype(dg)};
  }
  BackwardParams p;
  detail::fill_forward_params(p, qc, kc, vc, gate, oc, lse, idx,
                              detail::resolve_scale(sm_scale, q.size(3)), adaptive_threshold);
  detail::fill_backward_params(p, doc, dq, dk, dv, dg);
  auto f32 = q.options().dtype(at::kFloat);
  auto delta = at::empty({q.size(0), q.size(2), q.size(1)}, f32);
  auto dc = at::empty({q.size(0), q.size(2), k.size(1)}, f32);
  auto dq_rowsum = at::empty({q.size(0), q.size(2), q.size(1)}, f32);
  BackwardWorkspace ws;
  ws.delta = delta.data_ptr<float>();
  ws.dc = dc.data_ptr<float>();
  ws.dq_rowsum = dq_rowsum.data_ptr<float>();
  const int64_t max_len_q = max_sequence_length(idx, q.size(1));
  const int64_t max_len_k = max_sequence_length(idx, k.size(1));
  check_grid(((max_len_q + 31) / 32) * p.num_heads * p.batch);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool tensor_cores = type != ElementType::kFloat && fast_head_dim(p.head_dim) &&
                            rows_are_16_byte_aligned(qc) && rows_are_16_byte_aligned(kc) &&
                            rows_are_16_byte_aligned(vc) && rows_are_16_byte_aligned(doc) &&
                            rows_are_16_byte_aligned(dq) && rows_are_16_byte_aligned(dk) &&
                            rows_are_16_byte_aligned(dv);
  FOX_ELEMENT_SWITCH(type, T, [&] {
    if constexpr (!std::is_same_v<T, float>) {
      if (tensor_cores) {
        FOX_FAST_HEAD_DIM_SWITCH(p.head_dim, kHeadDim, [&] {
          if (hopper_kernels_enabled() && hopper_kernels_available() &&
              positions_fit_32_bits(std::max(max_len_q, max_len_k))) {
            auto suffix = at::empty({k.size(0), p.num_heads, k.size(1)}, f32);
            auto query_bias = at::empty({q.size(0), q.size(2), q.size(1)}, f32);
            ws.query_bias = query_bias.data_ptr<float>();
            at::Tensor dq_accum;  // (and the turn counters after it)
            const BackwardForm form = backward_form(max_len_q, kHeadDim, adaptive_threshold.has_value());
            if (form != BackwardForm::kTwoKernels) {
              const int64_t rows = q.size(0) * q.size(2) * q.size(1);
              const bool in_turns = form == BackwardForm::kFusedInTurns;
              const int64_t zeroed = fused_dq_zeroed_from(rows, kHeadDim, in_turns);
              dq_accum = at::empty({fused_dq_workspace_words(rows, kHeadDim)}, f32);
              if (env_flag("FOX_POISON_FUSED_WORKSPACE"))  // (tests: a row left unwritten shows)
                dq_accum.fill_(std::numeric_limits<float>::quiet_NaN());
              dq_accum.narrow(0, zeroed, dq_accum.size(0) - zeroed).zero_();
              ws.dq_accum = dq_accum.data_ptr<float>();
              if (in_turns)
                ws.dq_turns = reinterpret_cast<int*>(ws.dq_accum + fused_dq_accumulator_floats(rows, kHeadDim));
            }
            run_hopper_backward<T, kHeadDim>(p, ws, suffix.data_ptr<float>(), max_len_q, max_len_k,
                                             stream);
          } else {
            run_fast_backward<T, kHeadDim>(p, ws, max_len_q, max_len_k, stream);
          }
        });
        return;
      }
    }
    run_generic_backward<T>(p, ws, max_len_q, max_len_k, stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dq, dk, dv, in_gate_dtype(dg)};
}

at::Tensor forgetting_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& log_fgate,
                                const std::optional<at::Tensor>& seq_start,
                                const std::optional<at::Tensor>& cu_seqlens,
                                std::optional<double> sm_scale,
                                std::optional<double> adaptive_threshold,
                                const std::optional<at::Tensor>& cache_seqlens) {
  return std::get<0>(forward(q, k, v, log_fgate, seq_start, cu_seqlens, sm_scale,
                             adaptive_threshold, cache_seqlens));
}

}  // namespace
}  // namespace fox::cuda

TORCH_LIBRARY_IMPL(fox, CUDA, m) {
  m.impl("forgetting_attention", &fox::cuda::forgetting_attention);
  m.impl("forgetting_attention_fwd", &fox::cuda::forward);
  m.impl("forgetting_attention_bwd", &fox::cuda::backward);
}
