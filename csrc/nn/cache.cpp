#include <fox/nn/cache.h>

#ifdef FOX_WITH_CUDA
#include "cuda/fused_kernels.h"
#endif

namespace fox::nn {

#ifdef FOX_WITH_CUDA
namespace {

// A decoding step's three cache writes in one kernel (three scatters are three launches per layer
// and step), where it takes the tensors: the cache's dtypes, float32 gates, and (heads, head dim)
// dense in every row, so that the (B, T, C) views below share the buffers' memory. The gates are
// float32 log f, or with gate_logits the forget gate's logits (float32 or the cache's dtype); the
// cache keeps them in float32 or float16.
// Returns false otherwise; the caller then scatters.
bool fused_cache_write(const torch::Tensor& k_new, const torch::Tensor& v_new,
                       const torch::Tensor& lf_new, bool gate_logits,
                       const torch::Tensor& positions, torch::Tensor& k, torch::Tensor& v,
                       torch::Tensor& log_fgate) {
  auto dense_rows = [](const torch::Tensor& t) {
    return t.stride(3) == 1 && t.stride(2) == t.size(3);
  };
  const bool gate_dtype_ok = lf_new.scalar_type() == torch::kFloat32 ||
                             (gate_logits && lf_new.scalar_type() == k.scalar_type());
  if (k_new.scalar_type() != k.scalar_type() || v_new.scalar_type() != v.scalar_type() ||
      !gate_dtype_ok ||
      (log_fgate.scalar_type() != torch::kFloat32 && log_fgate.scalar_type() != torch::kHalf) ||
      !dense_rows(k) || !dense_rows(v) || !dense_rows(k_new) || !dense_rows(v_new) ||
      lf_new.stride(2) != 1 || log_fgate.stride(2) != 1 || !positions.is_contiguous()) {
    return false;
  }
  auto rows = [](const torch::Tensor& t) { return t.view({t.size(0), t.size(1), -1}); };
  cuda::cache_write(rows(k_new), rows(v_new), lf_new, gate_logits, positions, rows(k), rows(v),
                    log_fgate);
  return true;
}

}  // namespace
#endif

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> LayerCache::update(
    const torch::Tensor& k_new, const torch::Tensor& v_new, const torch::Tensor& lf_new) {
  if (is_static()) {
    // Written at each row's positions: no host sync, fixed addresses (graph-safe).
    const int64_t B = k_new.size(0), T = k_new.size(1);
    TORCH_CHECK(B == k.size(0), "KVCache: batch size ", B, " does not match the static cache's ",
                k.size(0));
#ifdef FOX_WITH_CUDA
    if (k.is_cuda() &&
        fused_cache_write(k_new, v_new, lf_new, /*gate_logits=*/false, positions, k, v, log_fgate))
      return {k, v, log_fgate};
#endif
    auto idx = positions.view({B, T, 1, 1});
    k.scatter_(1, idx.expand(k_new.sizes()), k_new.to(k.scalar_type()));
    v.scatter_(1, idx.expand(v_new.sizes()), v_new.to(v.scalar_type()));
    log_fgate.scatter_(1, positions.view({B, T, 1}).expand(lf_new.sizes()),
                       lf_new.to(log_fgate.scalar_type()));
    return {k, v, log_fgate};
  }
  if (!k.defined()) {
    k = k_new;
    v = v_new;
    log_fgate = lf_new;
  } else {
    TORCH_CHECK(k.size(0) == k_new.size(0), "KVCache: batch size changed from ", k.size(0),
                " to ", k_new.size(0));
    k = torch::cat({k, k_new}, 1);
    v = torch::cat({v, v_new}, 1);
    log_fgate = torch::cat({log_fgate, lf_new}, 1);
  }
  return {k, v, log_fgate};
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> LayerCache::update_from_gate_logits(
    const torch::Tensor& k_new, const torch::Tensor& v_new, const torch::Tensor& fgate_logits) {
#ifdef FOX_WITH_CUDA
  if (is_static() && k.is_cuda() && k_new.size(0) == k.size(0) &&
      fused_cache_write(k_new, v_new, fgate_logits, /*gate_logits=*/true, positions, k, v,
                        log_fgate))
    return {k, v, log_fgate};
#endif
  const auto fdt =
      fgate_logits.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  return update(k_new, v_new, torch::log_sigmoid(fgate_logits.to(fdt)));
}

void LayerCache::set_state(torch::Tensor& state, const torch::Tensor& last) const {
  if (is_static()) {
    state.copy_(last);
  } else {
    state = last.clone();  // not a view that would keep the whole projection alive
  }
}

KVCache KVCache::allocate(const std::vector<LayerCacheShape>& shapes, int64_t batch,
                          int64_t max_length, torch::ScalarType dtype, torch::Device device,
                          std::optional<torch::ScalarType> gate_dtype) {
  TORCH_CHECK(batch >= 1, "KVCache::allocate: batch must be >= 1, got ", batch);
  TORCH_CHECK(max_length >= 1, "KVCache::allocate: max_length must be >= 1, got ", max_length);
  const auto gates = gate_dtype.value_or(dtype == torch::kFloat64 ? torch::kFloat64
                                                                  : torch::kFloat32);
  TORCH_CHECK(gates == torch::kFloat32 || gates == torch::kFloat16 ||
                  (gates == torch::kFloat64 && dtype == torch::kFloat64),
              "KVCache::allocate: gate_dtype must be float32 or float16 (float64 with a float64 "
              "cache), got ", gates);
  KVCache cache(static_cast<int64_t>(shapes.size()));
  auto opts = torch::TensorOptions().dtype(dtype).device(device);
  auto gate_opts = opts.dtype(gates);
  for (size_t i = 0; i < shapes.size(); ++i) {
    const auto& sh = shapes[i];
    auto& l = cache.layers[i];
    // Zeros, not garbage: keys past a row's length are never attended to, but NaN bit patterns
    // would still be multiplied by zero probabilities in some kernels' tiles.
    l.k = torch::zeros({batch, max_length, sh.num_kv_heads, sh.head_dim}, opts);
    l.v = torch::zeros({batch, max_length, sh.num_kv_heads, sh.head_dim}, opts);
    l.log_fgate = torch::zeros({batch, max_length, sh.num_heads}, gate_opts);
    // A zero state is what the first token of a sequence sees (shift_mix without a state).
    if (sh.key_shift) l.key_shift = torch::zeros({batch, sh.num_kv_heads * sh.head_dim}, opts);
    if (sh.value_shift) l.value_shift = torch::zeros({batch, sh.num_kv_heads * sh.head_dim}, opts);
  }
  cache.lengths = torch::zeros({batch}, torch::TensorOptions().dtype(torch::kLong).device(device));
  cache.max_length = max_length;
  return cache;
}

void KVCache::begin_update(int64_t T) {
  if (!is_static()) return;
  TORCH_CHECK(length_bound + T <= max_length, "KVCache: ", T, " new tokens do not fit: the cache ",
              "holds up to ", max_length, " tokens per row and a row may hold ", length_bound,
              " already (allocate a larger max_length)");
  auto positions = lengths.unsqueeze(1) + torch::arange(T, lengths.options());
  auto seqlens = lengths + T;
  for (auto& l : layers) {
    l.positions = positions;
    l.seqlens = seqlens;
  }
}

void KVCache::finish_update(int64_t T) {
  if (!is_static()) return;
  lengths.add_(T);
  length_bound += T;
}

KVCache KVCache::row(int64_t b) const {
  TORCH_CHECK(is_static(), "KVCache::row: only a static cache has rows");
  TORCH_CHECK(b >= 0 && b < lengths.size(0), "KVCache::row: row ", b, " out of range [0, ",
              lengths.size(0), ")");
  KVCache r(static_cast<int64_t>(layers.size()));
  auto view = [&](const torch::Tensor& t) { return t.defined() ? t.narrow(0, b, 1) : t; };
  for (size_t i = 0; i < layers.size(); ++i) {
    r.layers[i].k = view(layers[i].k);
    r.layers[i].v = view(layers[i].v);
    r.layers[i].log_fgate = view(layers[i].log_fgate);
    r.layers[i].key_shift = view(layers[i].key_shift);
    r.layers[i].value_shift = view(layers[i].value_shift);
  }
  r.lengths = view(lengths);
  if (seq_start) r.seq_start = view(*seq_start);
  r.max_length = max_length;
  r.length_bound = length_bound;
  return r;
}

void KVCache::reset() {
  if (is_static()) {  // keep the buffers, empty every row
    lengths.zero_();
    length_bound = 0;
    for (auto& l : layers) {
      if (l.key_shift.defined()) l.key_shift.zero_();
      if (l.value_shift.defined()) l.value_shift.zero_();
      l.positions = l.seqlens = torch::Tensor();
    }
    seq_start.reset();
    return;
  }
  for (auto& l : layers) l = LayerCache();
  seq_start.reset();
}

void KVCache::select_batch(const torch::Tensor& index) {
  TORCH_CHECK(!is_static(), "KVCache::select_batch: a static cache keeps its rows");
  auto sel = [&](torch::Tensor& t) {
    if (t.defined()) t = t.index_select(0, index.to(t.device()));
  };
  for (auto& l : layers) {
    sel(l.k);
    sel(l.v);
    sel(l.log_fgate);
    sel(l.key_shift);
    sel(l.value_shift);
  }
  if (seq_start) sel(*seq_start);
}

}  // namespace fox::nn
