// Hopper forward, head dim 128, __half.
#include "../hopper_forward.cuh"

namespace fox::cuda {
template bool run_hopper_forward<__half, 128>(const ForwardParams&, float*, int64_t, int64_t,
                                                      cudaStream_t);
}  // namespace fox::cuda
