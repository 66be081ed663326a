// Programmatic dependent launch (sm_90+): a kernel launched with launch_dependent() may start while
// the kernel before it in the stream is still running, so its launch latency and prologue overlap
// that kernel's tail instead of following it. A decoding step is a chain of ~25 small kernels a
// layer, each a few microseconds, of which ~1 us is the gap between two launches.
//
// The contract: a kernel launched this way calls wait_for_previous_kernel() before it reads
// anything an earlier kernel may have written (weights included: an optimizer step may have just
// written them), and calls allow_next_kernel() to let the next dependent launch begin. The wait
// returns once the previous kernel has completed and its writes are visible; that kernel waited for
// its own predecessor, so everything earlier in the stream is complete too. On older GPUs the
// attribute is left off and both calls compile to nothing: plain stream order.
#pragma once

#include <cstdlib>
#include <string>
#include <utility>

#include <cuda_runtime.h>

#include "../per_device.h"

namespace fox::cuda {

__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Whether the current device takes the attribute (compute capability 9.0 or newer), unless
// FOX_DEPENDENT_LAUNCH=0 (plain launches, for comparisons). Looked up once per device: it is
// asked on every launch of the decoding path.
inline bool dependent_launch_supported() {
  static const bool disabled = [] {
    const char* v = std::getenv("FOX_DEPENDENT_LAUNCH");
    return v != nullptr && std::string(v) == "0";
  }();
  static PerDevice<bool> hopper_or_newer;
  int device = 0;
  if (disabled) return false;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();  // not an error of the launch that follows
    return false;
  }
  return hopper_or_newer.get(device, [device] {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return major >= 9;
  });
}

// kernel<<<grid, block, smem, stream>>>(args...) as a programmatic dependent launch where the
// device supports it. Returns the launch's error code.
template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                             cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = dependent_launch_supported() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace fox::cuda
