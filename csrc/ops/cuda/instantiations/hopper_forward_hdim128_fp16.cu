// Hopper forward (prefill and split-KV decoding), head dim 128, __half.
#include "../hopper_forward.cuh"

namespace fox::cuda {
template void run_hopper_forward<__half, 128>(const ForwardParams&, float*, int64_t, int64_t,
                                              cudaStream_t);
template void run_hopper_split_kv_forward<__half, 128>(const ForwardParams&, const SplitKVParams&,
                                                       float*, cudaStream_t);
}  // namespace fox::cuda
