"""How exact the gate gradient is with and without the row sums of dS (bench/NOTES.md, version 100).

The fused backward computes dc = rowsum(dS) - colsum(dS) and dlog f as its reverse cumulative sum,
with dS = P (dP - delta) in float32 and delta = rowsum(dO * O) from the 16-bit output O. In exact
arithmetic each row of dS sums to zero, so the column sums alone would do; with delta from the
rounded O they do not, and the row sums cancel that rounding. This emulates the kernels' float32
arithmetic on the CPU (bf16 inputs) for the ways of getting delta and dc, and prints each one's
largest error in dlog f against the float64 reference next to the tests' bound (2x the error of
the plain formula evaluated in bf16, plus the floor):

    rows        rowsum - colsum, delta from the bf16 O (the kernels' way)
    no-rows     -colsum, delta from the bf16 O
    resid16     -colsum, delta from the bf16 O plus its rounding residual stored in bf16
    resid8      the same with the residual in float8 (e4m3, scaled by 2^9)
    exact       -colsum, delta from the float32 O
    rounded     rowsum - colsum of dS rounded to bf16 (as the products see it)

    python3 bench/gate_grad_precision.py                 # T = 300-2100, D = 64/128, three gate regimes
    python3 bench/gate_grad_precision.py --t 1024 --d 128 --regime mixed
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
from conftest import make_inputs  # noqa: E402
from reference import FLOORS, forward_backward, max_abs_err, naive_attention  # noqa: E402

VARIANTS = ("rows", "no-rows", "resid16", "resid8", "exact", "rounded")


def to_bf16(x):
    return x.to(torch.bfloat16).float()


def emulated_dlog_f(q, k, v, log_f, dout, variant):
    """dlog f (B, T, H) of causal attention (B, T, H, D inputs, no GQA) the way `variant` gets it."""
    D = q.shape[-1]
    qf, kf, vf, dof = (x.float().transpose(1, 2) for x in (q, k, v, dout))  # (B, H, T, D)
    c = log_f.double().cumsum(1).transpose(1, 2)  # (B, H, T)
    T = c.shape[-1]
    s = (qf @ kf.transpose(-1, -2)) / math.sqrt(D) + (c[..., :, None] - c[..., None, :]).float()
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    P = torch.exp(s - torch.logsumexp(s, -1, keepdim=True))
    out32 = P @ vf
    out16 = to_bf16(out32)
    seen = {
        "resid16": out16 + to_bf16(out32 - out16),
        "resid8": out16 + ((out32 - out16) * 512).to(torch.float8_e4m3fn).float() / 512,
        "exact": out32,
    }.get(variant, out16)
    delta = (dof * seen).sum(-1, keepdim=True)
    dS = P * (dof @ vf.transpose(-1, -2) - delta)
    if variant == "rounded":
        dS = to_bf16(dS)
    dc = dS.sum(-1) - dS.sum(-2) if variant in ("rows", "rounded") else -dS.sum(-2)
    return dc.double().flip(-1).cumsum(-1).flip(-1).transpose(1, 2)


def errors(T, D, regime, H=2, seed=0):
    """{variant: max |error|} of dlog f against float64, with 'bound' (the tests' rule) and 'ref'."""
    torch.manual_seed(seed)
    q, k, v, log_f = make_inputs(B=1, Tq=T, H=H, D=D, dtype=torch.bfloat16, regime=regime)
    dout = torch.randn(q.shape).to(torch.bfloat16)
    _, ref = forward_backward(naive_attention, [x.double() for x in (q, k, v, log_f)], dout.double())
    _, naive = forward_backward(lambda *x: naive_attention(*x, dtype=torch.bfloat16), (q, k, v, log_f), dout)
    ref, naive = ref[3], naive[3]
    result = {"ref": ref.abs().max().item(),
              "bound": 2 * max_abs_err(naive, ref) + FLOORS[torch.bfloat16] * max(1.0, ref.abs().max().item())}
    for variant in VARIANTS:
        result[variant] = max_abs_err(emulated_dlog_f(q, k, v, log_f, dout, variant), ref)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--t", type=int, nargs="*", default=[300, 1024, 2100])
    ap.add_argument("--d", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--regime", nargs="*", default=["normal", "mixed", "tiny"])
    args = ap.parse_args()
    print("| regime | T | D | max abs ref | bound | " + " | ".join(VARIANTS) + " |")
    print("|---" * (5 + len(VARIANTS)) + "|")
    for regime in args.regime:
        for T in args.t:
            for D in args.d:
                e = errors(T, D, regime)
                cells = [f"{e[v]:.1e}" + (" (over)" if e[v] > e["bound"] else "") for v in VARIANTS]
                print(f"| {regime} | {T} | {D} | {e['ref']:.3g} | {e['bound']:.1e} | " + " | ".join(cells) + " |",
                      flush=True)


if __name__ == "__main__":
    main()
