#include <fox/nn/cache.h>

namespace fox::nn {

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> LayerCache::update(
    const torch::Tensor& k_new, const torch::Tensor& v_new, const torch::Tensor& lf_new) {
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

void KVCache::reset() {
  for (auto& l : layers) l = LayerCache();
  seq_start.reset();
}

void KVCache::select_batch(const torch::Tensor& index) {
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
