// Hopper backward, head dim 64, __half.
#include "../hopper_backward.cuh"

namespace fox::cuda {
template void run_hopper_backward<__half, 64>(const BackwardParams&, const BackwardWorkspace&, float*,
                                               int64_t, int64_t, cudaStream_t);
}  // namespace fox::cuda
