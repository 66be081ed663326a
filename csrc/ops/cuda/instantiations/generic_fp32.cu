// Generic (any head dim) kernels for float. One file per dtype keeps the build parallel.
#include "../generic_kernels.cuh"

namespace fox::cuda {
template void run_generic_forward<float>(const ForwardParams&, int64_t, cudaStream_t);
template void run_split_kv_forward<float>(const ForwardParams&, const SplitKVParams&, cudaStream_t);
template void run_generic_backward<float>(const BackwardParams&, const BackwardWorkspace&, int64_t,
                                       int64_t, cudaStream_t);
}  // namespace fox::cuda
