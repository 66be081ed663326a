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

struct Layout {
  const void* base;
  int64_t rows, heads, batch;                   // extents after the head dim
  int64_t row_stride, head_stride, batch_stride;  // in elements
};

bool encode(CUtensorMap* map, const Layout& t, int64_t head_dim, bool bf16, int box_rows) {
  std::memset(map, 0, sizeof(*map));
  const auto encode_tiled = encode_function();
  if (encode_tiled == nullptr || reinterpret_cast<uintptr_t>(t.base) % 16 != 0) return false;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(t.rows),
                              static_cast<cuuint64_t>(t.heads), static_cast<cuuint64_t>(t.batch)};
  int64_t strides[3] = {t.row_stride * 2, t.head_stride * 2, t.batch_stride * 2};  // bytes
  cuuint64_t strides_bytes[3];
  for (int i = 0; i < 3; ++i) {
    if (dims[i + 1] == 1) strides[i] = 16;  // never stepped: any valid stride (e.g. for a stride 0)
    if (strides[i] <= 0 || strides[i] % 16 != 0 || strides[i] >= (int64_t{1} << 40)) return false;
    strides_bytes[i] = static_cast<cuuint64_t>(strides[i]);
  }
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  return encode_tiled(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                      const_cast<void*>(t.base), dims, strides_bytes, box, element_strides,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// FOX_DISABLE_TMA=1: the cp.async path, to compare the two in one process (read at each call).
bool tma_disabled() {
  const char* off = std::getenv("FOX_DISABLE_TMA");
  return off != nullptr && off[0] == '1';
}

TileMaps make_maps(const Layout& a, const Layout& b, int64_t head_dim, bool bf16, int box_rows) {
  TileMaps maps;
  maps.enabled = !tma_disabled() && encode(&maps.first, a, head_dim, bf16, box_rows) &&
                 encode(&maps.second, b, head_dim, bf16, box_rows);
  return maps;
}

}  // namespace

TileMaps make_key_value_maps(const ForwardParams& p, bool bf16, int box_rows) {
  const int64_t batch = p.cu_seqlens != nullptr ? 1 : p.batch;
  return make_maps({p.k, p.seqlen_k, p.num_kv_heads, batch, p.k_row_stride, p.k_head_stride, p.k_batch_stride},
                   {p.v, p.seqlen_k, p.num_kv_heads, batch, p.v_row_stride, p.v_head_stride, p.v_batch_stride},
                   p.head_dim, bf16, box_rows);
}

TileMap make_query_map(const ForwardParams& p, bool bf16, int box_rows) {
  const int64_t batch = p.cu_seqlens != nullptr ? 1 : p.batch;
  TileMap q;
  q.enabled = !tma_disabled() &&
              encode(&q.map, {p.q, p.seqlen_q, p.num_heads, batch, p.q_row_stride, p.q_head_stride, p.q_batch_stride},
                     p.head_dim, bf16, box_rows);
  return q;
}

TileMaps make_query_grad_maps(const BackwardParams& p, bool bf16, int box_rows) {
  const int64_t batch = p.cu_seqlens != nullptr ? 1 : p.batch;
  return make_maps({p.q, p.seqlen_q, p.num_heads, batch, p.q_row_stride, p.q_head_stride, p.q_batch_stride},
                   {p.dout, p.seqlen_q, p.num_heads, batch, p.do_row_stride, p.do_head_stride, p.do_batch_stride},
                   p.head_dim, bf16, box_rows);
}

}  // namespace fox::cuda
