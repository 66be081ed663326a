// Whether the Hopper kernels can run on the current device: a Hopper GPU, and sm_90a code for it in
// this build (sm_90 code without the "a" features would compile the wgmma kernels to nothing).
#include <cuda_runtime.h>

#include "../per_device.h"
#include "launch.h"

namespace fox::cuda {
namespace {

__global__ void sm90a_probe(int* flag) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *flag = 1;
#endif
}

bool probe_device(int device) {
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      major != 9)
    return false;
  int* flag = nullptr;
  int host = 0;
  if (cudaMalloc(&flag, sizeof(int)) != cudaSuccess) return false;
  // Once per device and process: a tiny launch and a synchronizing copy.
  if (cudaMemset(flag, 0, sizeof(int)) == cudaSuccess) {
    sm90a_probe<<<1, 1>>>(flag);
    if (cudaMemcpy(&host, flag, sizeof(int), cudaMemcpyDeviceToHost) != cudaSuccess) host = 0;
  }
  cudaFree(flag);
  return host == 1;
}

}  // namespace

bool hopper_kernels_available() {
  static PerDevice<bool> available;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return available.get(device, [device] {
    const bool yes = probe_device(device);
    cudaGetLastError();  // a failed probe is not an error of a later launch
    return yes;
  });
}

}  // namespace fox::cuda
