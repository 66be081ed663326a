// Hopper forward (prefill and split-KV decoding), head dim 64, __nv_bfloat16.
#include "../hopper_forward.cuh"

namespace fox::cuda {
template void run_hopper_forward<__nv_bfloat16, 64>(const ForwardParams&, float*, int64_t, int64_t,
                                              cudaStream_t);
template void run_hopper_split_kv_forward<__nv_bfloat16, 64>(const ForwardParams&, const SplitKVParams&,
                                                       float*, cudaStream_t);
}  // namespace fox::cuda
