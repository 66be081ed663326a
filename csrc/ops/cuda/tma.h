// Tensor maps for the Hopper kernels' bulk tensor copies (TMA): one thread issues the copy of a
// whole tile, which lands in shared memory in the 128-byte-swizzled layout wgmma reads, and
// completes on an mbarrier. This takes the per-thread address arithmetic and copy instructions of
// cp.async out of the consumer warps' instruction stream.
#pragma once

#include <cuda.h>

#include "../params.h"

namespace fox::cuda {

// Maps of the key and value tensors as (head dim, seqlen_k, kv heads, batch): boxes of 64 columns
// (128 bytes) x `box_rows` rows of one (sequence, kv head). `enabled` is false where the layout
// does not allow TMA (base address not 16-byte aligned, a stride not a multiple of 16 bytes): the
// kernels then load with cp.async.
struct KeyValueMaps {
  CUtensorMap k;
  CUtensorMap v;
  int enabled = 0;
};

// Fills the maps for 2-byte elements (bf16 when `bf16`, else fp16).
KeyValueMaps make_key_value_maps(const ForwardParams& p, bool bf16, int box_rows);

}  // namespace fox::cuda
