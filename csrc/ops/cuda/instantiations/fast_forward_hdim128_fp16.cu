// Tensor-core forward, head dim 128, __half.
#include "../fast_forward.cuh"

namespace fox::cuda {
template void run_fast_forward<__half, 128>(const ForwardParams&, int64_t, cudaStream_t);
template void run_fast_split_kv_forward<__half, 128>(const ForwardParams&, const SplitKVParams&,
                                                  cudaStream_t);
}  // namespace fox::cuda
