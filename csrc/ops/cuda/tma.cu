#include "tma.h"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

namespace fox::cuda {
namespace {

// cuTensorMapEncodeTiled from the driver, through the runtime (no link against libcuda).
PFN_cuTensorMapEncodeTiled_v12000 encode_function() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &entry, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      entry = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(entry);
  }();
  return fn;
}

bool encode(CUtensorMap* map, const void* base, bool bf16, const ForwardParams& p,
            int64_t row_stride, int64_t head_stride, int64_t batch_stride, int box_rows) {
  const auto encode_tiled = encode_function();
  if (encode_tiled == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  const int64_t batch_dim = p.cu_seqlens != nullptr ? 1 : p.batch;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(p.head_dim), static_cast<cuuint64_t>(p.seqlen_k),
                              static_cast<cuuint64_t>(p.num_kv_heads), static_cast<cuuint64_t>(batch_dim)};
  int64_t strides[3] = {row_stride * 2, head_stride * 2, batch_stride * 2};  // bytes
  // A dimension of extent 1 is never stepped: any valid stride serves (broadcast strides of 0).
  for (int i = 0; i < 3; ++i)
    if (dims[i + 1] == 1) strides[i] = 16;
  cuuint64_t strides_bytes[3];
  for (int i = 0; i < 3; ++i) {
    if (strides[i] <= 0 || strides[i] % 16 != 0 || strides[i] >= (int64_t{1} << 40)) return false;
    strides_bytes[i] = static_cast<cuuint64_t>(strides[i]);
  }
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  return encode_tiled(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                      const_cast<void*>(base), dims, strides_bytes, box, element_strides,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

KeyValueMaps make_key_value_maps(const ForwardParams& p, bool bf16, int box_rows) {
  KeyValueMaps maps;
  std::memset(&maps.k, 0, sizeof(maps.k));
  std::memset(&maps.v, 0, sizeof(maps.v));
  // FOX_DISABLE_TMA=1: the cp.async path, to compare the two in one process (read at each call).
  const char* off = std::getenv("FOX_DISABLE_TMA");
  if (off != nullptr && off[0] == '1') return maps;
  maps.enabled = encode(&maps.k, p.k, bf16, p, p.k_row_stride, p.k_head_stride, p.k_batch_stride, box_rows) &&
                 encode(&maps.v, p.v, bf16, p, p.v_row_stride, p.v_head_stride, p.v_batch_stride, box_rows);
  return maps;
}

}  // namespace fox::cuda
