"""Plain reference of Forgetting Attention, and the tolerance rule the tests use.

The reference materializes everything (design.md section 1):

    c_t  = sum_{l <= t} log f_l               (cumulative sum over the key positions)
    d_ij = c_i - c_j                          (<= 0: the log of the forget gates' product)
    s_ij = scale * q_i . k_j + d_ij           for seq_start <= j <= i (causal), else -inf
    P    = softmax_j(s),   O = P V

with the Tq queries at the LAST Tq of the Tk key positions. It is meant to be evaluated in float64
(the "truth"); `naive_attention(..., dtype=torch.bfloat16)` evaluates the very same formula in a
low precision, which is the yardstick of the tolerance rule (see `rule_violations`).
Gradients come from torch.autograd through this code.
"""
import math
from typing import Optional, Sequence

import torch


def _dense(q, k, v, log_fgate, seq_start, scale, dtype):
    """One dense batch (B, Tq, H, D) x (B, Tk, Hkv, D); returns (out, lse) with out in `dtype`."""
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    # GQA/MQA: query head h reads key/value head h // (H // Hkv) (FlashAttention's convention).
    k = k.to(dtype).repeat_interleave(H // Hkv, dim=2)
    v = v.to(dtype).repeat_interleave(H // Hkv, dim=2)
    q = q.to(dtype)

    # The gate bias is computed from float32 (or float64) log f, as the kernel receives it: c and d
    # live in the precision of log_fgate (float64 for the reference), then enter the scores, which
    # live in `dtype`. In bf16/fp16 this rounds d to a few bits -- that IS the naive low-precision
    # formula, and exactly the error the kernel avoids by keeping d in float32.
    c = log_fgate.to(torch.promote_types(log_fgate.dtype, torch.float32)).cumsum(1)  # (B, Tk, H)
    c = c.transpose(1, 2)  # (B, H, Tk)
    d = c[:, :, Tk - Tq:, None] - c[:, :, None, :]  # (B, H, Tq, Tk)

    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale + d.to(dtype)

    pos_q = torch.arange(Tk - Tq, Tk, device=q.device)[:, None]  # (Tq, 1)
    pos_k = torch.arange(Tk, device=q.device)[None, :]  # (1, Tk)
    mask = (pos_k <= pos_q)[None, None]  # (1, 1, Tq, Tk)
    if seq_start is not None:
        mask = mask & (pos_k[None, None] >= seq_start.to(q.device).view(B, 1, 1, 1))
    # Rows with no visible key (queries inside the left padding) output exactly 0 and get no
    # gradient: give them finite dummy scores, then zero their probabilities.
    row_has_key = mask.any(-1, keepdim=True)
    scores = scores.masked_fill(~mask, float("-inf")).masked_fill(~row_has_key, 0.0)
    lse = torch.logsumexp(scores.float() if dtype != torch.float64 else scores, dim=-1)
    lse = lse.masked_fill(~row_has_key[..., 0], float("-inf"))
    probs = torch.softmax(scores, dim=-1) * row_has_key
    out = torch.einsum("bhij,bjhd->bihd", probs.to(dtype), v)
    return out, lse


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor,
    seq_start: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    sm_scale: Optional[float] = None,
    dtype: torch.dtype = torch.float64,
    return_lse: bool = False,
):
    """Forgetting Attention by the plain formula, computed in `dtype` (log f in >= float32).

    Layout (B, T, H, D) / (B, T, H) like the op. Differentiable (autograd) in all four inputs.
    With cu_seqlens (B == 1, Tq == Tk) each packed sequence is computed on its own and the results
    are concatenated (zero-length sequences contribute nothing).
    """
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if dtype == torch.float64:
        log_fgate = log_fgate.double()
    if cu_seqlens is None:
        out, lse = _dense(q, k, v, log_fgate, seq_start, scale, dtype)
    else:
        bounds = cu_seqlens.tolist()
        outs, lses = [], []
        for b, e in zip(bounds[:-1], bounds[1:]):
            if e > b:
                o, l = _dense(q[:, b:e], k[:, b:e], v[:, b:e], log_fgate[:, b:e], None, scale, dtype)
                outs.append(o)
                lses.append(l)
        out = torch.cat(outs, dim=1)
        lse = torch.cat(lses, dim=2)
    return (out, lse) if return_lse else out


# ---- tolerance rule ------------------------------------------------------------------------------

# Floors of the rule, relative to the magnitude of the reference (max |ref|, at least 1). They only
# matter where the naive low-precision formula happens to be (almost) exact -- seqlen 1 (out == v),
# log f == 0 with tiny heads -- so that a kernel which rounds differently is not failed for noise:
#   fp32: 1e-5, ~80 ulps (eps 1.2e-7) of accumulation noise in sums of hundreds of terms;
#   fp16: 2e-3, bf16: 1.6e-2: two ulps (eps 9.8e-4 / 7.8e-3): the final rounding, plus the
#         rounding of the saved output O, which the backward uses for delta = rowsum(dO * O) as
#         FlashAttention does (the naive formula's autograd keeps O unrounded);
#   fp64: the naive formula IS the reference (error 0), so the floor is the whole tolerance; 1e-10
#         covers a different summation order of c with |c| up to ~1e4 (1e4 * 1.1e-16 * 100).
FLOORS = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def max_abs_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    if x.numel() == 0:
        return 0.0
    return (x.double() - ref.double()).abs().max().item()


def rule_violations(names, got, ref, naive, dtype, factor=2.0):
    """FlashAttention's rule, per result: |got - ref| <= factor * |naive - ref| + floor (max norms).

    got: the op's results; ref: the float64 reference; naive: the same formula evaluated in the
    op's dtype (its error is what "as accurate as the dtype allows" means). Returns a message for
    every result that breaks the rule (empty list: all good).
    """
    problems = []
    for name, g, r, n in zip(names, got, ref, naive):
        if g.shape != r.shape:
            problems.append(f"{name}: shape {tuple(g.shape)} != {tuple(r.shape)}")
            continue
        if not torch.isfinite(g).all():
            problems.append(f"{name}: non-finite values")
            continue
        err, naive_err = max_abs_err(g, r), max_abs_err(n, r)
        scale = max(1.0, r.abs().max().item()) if r.numel() else 1.0
        bound = factor * naive_err + FLOORS[dtype] * scale
        if err > bound:
            ratio = err / max(naive_err, 1e-300)
            problems.append(f"{name}: error {err:.3e} > bound {bound:.3e} (naive-{dtype} error "
                            f"{naive_err:.3e}, ratio {ratio:.1f}x; max|ref| {scale:.3g})")
    return problems


def forward_backward(fn, inputs: Sequence[torch.Tensor], grad_out: torch.Tensor):
    """Runs fn(*inputs) and its backward with grad_out; returns (out, [grads]) detached.

    The inputs are fresh leaves (copies), so the same tensors can feed several implementations.
    """
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype), allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]
    return out.detach(), [g.detach() for g in grads]
