"""Forgetting Transformer (FoX): Forgetting Attention as PyTorch C++/CUDA ops.

    from forgetting_transformer import forgetting_attention
    out = forgetting_attention(q, k, v, log_fgate)        # or torch.ops.fox.forgetting_attention

C++ apps: find_package(fox_torch) with `forgetting_transformer.cmake_prefix_path` (and torch's)
on CMAKE_PREFIX_PATH, then link fox::fox_torch.
"""
import os as _os

import torch as _torch  # noqa: F401  (loads LibTorch before our libraries)

from . import _C  # noqa: F401  (loads libfox_torch: registers torch.ops.fox.*)
from .ops import forgetting_attention, pruning_threshold

__version__ = "0.1.0"

#: Directory to put on CMAKE_PREFIX_PATH for find_package(fox_torch).
cmake_prefix_path = _os.path.join(_os.path.dirname(__file__), "share", "cmake")


def built_with_cuda() -> bool:
    """True when the installed library contains the CUDA kernels."""
    return _C.built_with_cuda()


__all__ = ["forgetting_attention", "pruning_threshold", "built_with_cuda", "cmake_prefix_path", "__version__"]
