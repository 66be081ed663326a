// Hopper backward, head dim 64, __nv_bfloat16.
#include "../hopper_backward.cuh"

namespace fox::cuda {
template void run_hopper_backward<__nv_bfloat16, 64>(const BackwardParams&, const BackwardWorkspace&, float*,
                                               int64_t, int64_t, cudaStream_t);
}  // namespace fox::cuda
