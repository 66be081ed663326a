"""The torch profiler over a few calls of a benchmark's closure, after warm-up, the GPU (where
there is one) idle before and synchronized after: what the kernel breakdowns and the host-call
census share."""
import torch
from torch.profiler import ProfilerActivity, profile


def profiled(fn, calls, activities=(ProfilerActivity.CUDA,), warmup=2):
    """The finished profiler of `calls` calls of fn (after `warmup` unprofiled calls)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    with profile(activities=list(activities)) as prof:
        for _ in range(calls):
            fn()
        sync()
    return prof
