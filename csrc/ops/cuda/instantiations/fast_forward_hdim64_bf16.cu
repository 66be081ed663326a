// Tensor-core forward, head dim 64, __nv_bfloat16.
#include "../fast_forward.cuh"

namespace fox::cuda {
template void run_fast_forward<__nv_bfloat16, 64>(const ForwardParams&, int64_t, cudaStream_t);
template void run_fast_split_kv_forward<__nv_bfloat16, 64>(const ForwardParams&, const SplitKVParams&,
                                                  cudaStream_t);
}  // namespace fox::cuda
