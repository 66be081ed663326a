"""`fox demo`: a short demonstration of the Forgetting Attention op.

Runs the op on random CPU inputs (and on the GPU when there is one), checks it against the plain
formula in float64, and times forward and backward against the naive formula.
"""
import argparse
import math
import time

import torch
import torch.nn.functional as F

from .. import built_with_cuda, forgetting_attention


def naive_forgetting_attention(q, k, v, log_fgate):
    """softmax(q k^T / sqrt(D) + c_i - c_j) v with c = cumsum(log f): materializes T x T."""
    T, D = q.shape[1], q.shape[-1]
    c = log_fgate.cumsum(1).transpose(1, 2)  # (B, H, T)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(D) + c[..., :, None] - c[..., None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("bhij,bjhd->bihd", probs, v)


def _time(fn, repeats=3):
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main(argv=None):
    parser = argparse.ArgumentParser(prog="fox demo", description=__doc__)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    B, T, H, D = args.batch, args.seqlen, args.heads, args.head_dim
    print(f"fox_torch demo: B={B} T={T} H={H} D={D}, CUDA kernels built: {built_with_cuda()}")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        q, k, v = (torch.randn(B, T, H, D, device=device, requires_grad=True) for _ in range(3))
        log_fgate = F.logsigmoid(torch.randn(B, T, H, device=device) + 3).requires_grad_()
        out = forgetting_attention(q, k, v, log_fgate)
        ref = naive_forgetting_attention(*(x.double() for x in (q, k, v, log_fgate)))
        err = (out.double() - ref).abs().max().item()
        print(f"[{device}] output {tuple(out.shape)}, max |error| vs float64 formula: {err:.2e}")

        def fox_step():
            forgetting_attention(q, k, v, log_fgate).sum().backward()

        def naive_step():
            naive_forgetting_attention(q, k, v, log_fgate).sum().backward()

        t_fox, t_naive = _time(fox_step), _time(naive_step)
        print(f"[{device}] forward+backward: fox {t_fox * 1e3:.1f} ms, naive formula "
              f"{t_naive * 1e3:.1f} ms ({t_naive / t_fox:.1f}x)")


if __name__ == "__main__":
    main()
