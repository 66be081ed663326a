// Decoding kernel, head dim 64, __nv_bfloat16.
#include "../decode.cuh"

namespace fox::cuda {
template int decode_blocks_per_sm<__nv_bfloat16, 64>(bool, bool);
template void run_decode_forward<__nv_bfloat16, 64>(const ForwardParams&, bool, const DecodePlan&,
                                           float*, float*, float*, cudaStream_t);
}  // namespace fox::cuda
