// Generic (any head dim) kernels for __nv_bfloat16. One file per dtype keeps the build parallel.
#include "../generic_kernels.cuh"

namespace fox::cuda {
template void run_generic_forward<__nv_bfloat16>(const ForwardParams&, int64_t, cudaStream_t);
template void run_split_kv_forward<__nv_bfloat16>(const ForwardParams&, const SplitKVParams&, cudaStream_t);
template void run_generic_backward<__nv_bfloat16>(const BackwardParams&, const BackwardWorkspace&, int64_t,
                                       int64_t, cudaStream_t);
}  // namespace fox::cuda
