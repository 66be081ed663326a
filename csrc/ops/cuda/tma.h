// Tensor maps for the Hopper kernels' bulk tensor copies (TMA): one thread issues the copy of a
// whole tile, which lands in shared memory in the 128-byte-swizzled layout wgmma reads and
// completes on an mbarrier. This takes the per-thread address arithmetic and copy instructions of
// cp.async out of the warps that do the math.
#pragma once

#include <cuda.h>

#include "../params.h"

namespace fox::cuda {

// Two tensors of one kind (K and V, or Q and dO) as 4-d maps (head dim, rows, heads, batch) with
// boxes of 64 columns (128 bytes) x `box_rows` rows of one (sequence, head). Rows past a padded
// sequence's end read as zeros; in a packed (cu_seqlens) batch they belong to the next sequence,
// so the kernels copy only tiles that lie inside their sequence this way. `enabled` is false where
// the layout does not allow TMA (base address not 16-byte aligned, a stride not a multiple of 16
// bytes) or FOX_DISABLE_TMA=1: the kernels then load with cp.async.
struct TileMaps {
  CUtensorMap first;
  CUtensorMap second;
  int enabled = 0;
};

// One tensor (Q in the forward) as such a map.
struct TileMap {
  CUtensorMap map;
  int enabled = 0;
};

// K and V (2-byte elements: bf16 when `bf16`, else fp16).
TileMaps make_key_value_maps(const ForwardParams& p, bool bf16, int box_rows);
// Q.
TileMap make_query_map(const ForwardParams& p, bool bf16, int box_rows);
// Q and dO.
TileMaps make_query_grad_maps(const BackwardParams& p, bool bf16, int box_rows);

}  // namespace fox::cuda
