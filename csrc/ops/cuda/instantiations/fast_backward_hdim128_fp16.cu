// Tensor-core backward, head dim 128, __half.
#include "../fast_backward.cuh"

namespace fox::cuda {
template void run_fast_backward<__half, 128>(const BackwardParams&, const BackwardWorkspace&, int64_t,
                                        int64_t, cudaStream_t);
}  // namespace fox::cuda
