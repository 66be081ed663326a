"""Tests of the Forgetting Attention op (torch.ops.fox.*) and its Python wrapper.

Accuracy follows design.md section 5: every result (output and the four gradients) is compared
with a float64 evaluation of the plain formula (reference.py), and its error must be at most 2x
(plus a tiny floor) the error of that same formula evaluated in the op's dtype.
"""
import math
import re

import pytest
import torch
import torch.nn.functional as F

import forgetting_transformer
from conftest import HAS_CUDA, make_inputs, make_log_fgate
from reference import forward_backward, max_abs_err, naive_attention, rule_violations

op = torch.ops.fox.forgetting_attention

ALL_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
GRAD_NAMES = ("dq", "dk", "dv", "dlog_fgate")


def skip_unsupported(device, dtype):
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 is a CPU-only dtype")


def with_kernel_names(fn):
    """fn's result and the names of the CUDA kernels it launched (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    return result, {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


def fused_backward_ran(kernels):
    """Whether the kernels launched (with_kernel_names) include the fused backward's: the dK/dV
    kernel's instantiation with dQ, and dQ's conversion after it (as a pair, for the assertion)."""
    return (any(re.search(r"dkdv_kernel<[^>]*, true>", name) for name in kernels),
            any("dq_from_accumulator" in name for name in kernels))


def index_tensor(values, device, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=device)


def same_math_tol(dtype):
    """Two evaluations of the same math that may differ in summation order (another tiling, a
    contiguous copy): a few float32 ulps, or one ulp of the 16-bit dtype after rounding."""
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-5)
    return dict(rtol=1e-2, atol=1e-2)


def check_against_reference(q, k, v, log_fgate, *, seq_start=None, cu_seqlens=None,
                            sm_scale=None):
    """Forward and backward of the op against the float64 reference, by the 2x rule.

    Returns (out, grads) of the op for further checks.
    """
    dtype = q.dtype
    grad_out = torch.randn(q.shape, device=q.device)
    inputs = (q, k, v, log_fgate)
    opts = dict(seq_start=seq_start, cu_seqlens=cu_seqlens, sm_scale=sm_scale)

    out, grads = forward_backward(
        lambda *x: op(*x, seq_start, cu_seqlens, sm_scale), inputs, grad_out.to(dtype))
    ref, ref_grads = forward_backward(
        lambda *x: naive_attention(*x, **opts), [x.double() for x in inputs], grad_out.double())
    naive, naive_grads = forward_backward(
        lambda *x: naive_attention(*x, **opts, dtype=dtype), inputs, grad_out.to(dtype))

    assert out.dtype == dtype and out.shape == q.shape
    for x, g in zip(inputs, grads):
        assert g.dtype == x.dtype and g.shape == x.shape
    problems = rule_violations(("out",) + GRAD_NAMES, [out] + grads, [ref] + ref_grads,
                               [naive] + naive_grads, dtype)
    shape = f"q {tuple(q.shape)}, k {tuple(k.shape)}"
    assert not problems, f"[{dtype}, {shape}] " + "; ".join(problems)
    return out, grads


# ---- accuracy grid -------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [1, 40, 60, 64, 100, 128, 256])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_dtypes_and_head_dims(device, dtype, head_dim):
    skip_unsupported(device, dtype)
    check_against_reference(*make_inputs(B=2, Tq=97, H=2, D=head_dim, dtype=dtype, device=device))


# Lengths around the tile sizes (1, 63, 97, 1025), and Tq < Tk (the queries are the last Tq
# positions: chunked prefill and decoding). 1025 only in a few configurations (CPU time).
@pytest.mark.parametrize("seqlen_q,seqlen_k", [
    (1, 1), (63, 63), (97, 97), (1025, 1025),
    (1, 63), (1, 97), (33, 97), (63, 1025), (1, 1025),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_lengths(device, dtype, seqlen_q, seqlen_k):
    batch = 1 if seqlen_k > 1000 else 2
    check_against_reference(*make_inputs(B=batch, Tq=seqlen_q, Tk=seqlen_k, H=2, D=64,
                                         dtype=dtype, device=device))


# A prefill whose last query tile holds 64 rows or fewer behind full 128-row tiles: on Hopper the
# D=64 forward then runs its TMA walk, in which both warpgroups of every block walk, so the second
# warpgroup of that last tile computes rows past the sequence (not stored). Padded and packed
# (whose rows past a sequence are the next sequence's), with GQA, against the reference.
@pytest.mark.parametrize("last_rows", [1, 40, 64, 65])
def test_last_query_tile_of_few_rows(device, last_rows):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    T = 2 * 128 + last_rows
    check_against_reference(*make_inputs(B=2, Tq=T, H=4, Hkv=2, D=64, dtype=dtype, device=device,
                                         regime="mixed"))
    lengths = [T, 128 + last_rows, 200]
    q, k, v, g = make_inputs(B=1, Tq=sum(lengths), H=4, Hkv=2, D=64, dtype=dtype, device=device,
                             regime="mixed")
    cu_seqlens = index_tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device, torch.int32)
    check_against_reference(q, k, v, g, cu_seqlens=cu_seqlens)


# Queries offset from the keys (Tq < Tk) by 1, 40, 64, 65 and 127 positions past a 128-key tile:
# where a query tile's rows end on its diagonal tile decides whether each of its two 64-row
# halves needs that tile's first 64 keys only (the Hopper forwards then compute S and the
# softmax over those alone). Both halves hold queries (Tq = 300).
@pytest.mark.parametrize("offset", [1, 40, 64, 65, 127])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_query_offsets_around_a_key_tile(device, head_dim, offset):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    check_against_reference(*make_inputs(B=1, Tq=300, Tk=300 + 128 + offset, H=2, D=head_dim,
                                         dtype=dtype, device=device))


@pytest.mark.parametrize("regime", ["zero", "tiny", "normal", "strong", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gate_regimes(device, dtype, regime):
    check_against_reference(*make_inputs(B=1, Tq=300, H=2, D=64, dtype=dtype, device=device,
                                         regime=regime))


@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (4, 2), (6, 3), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gqa_mqa(device, dtype, heads, kv_heads):
    check_against_reference(*make_inputs(B=2, Tq=40, Tk=97, H=heads, Hkv=kv_heads, D=40,
                                         dtype=dtype, device=device, regime="mixed"))


def test_sm_scale(device):
    q, k, v, g = make_inputs(B=2, Tq=70, H=4, Hkv=2, D=64, device=device)
    check_against_reference(q, k, v, g, sm_scale=0.31)


# seq_start: batch rows 0 (no padding), 40 (queries before it see nothing when Tq == Tk) and
# Tk - 1 (only the last position is real).
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(97, 97), (33, 97), (1, 97), (300, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_seq_start(device, dtype, seqlen_q, seqlen_k):
    q, k, v, g = make_inputs(B=3, Tq=seqlen_q, Tk=seqlen_k, H=2, D=64, dtype=dtype, device=device)
    seq_start = index_tensor([0, 40, seqlen_k - 1], device)
    out, grads = check_against_reference(q, k, v, g, seq_start=seq_start)

    # Queries inside the padding have no key: exactly zero output and zero dq.
    no_key = torch.arange(seqlen_k - seqlen_q, seqlen_k, device=device)[None, :] < seq_start[:, None]
    assert (out[no_key] == 0).all() and (grads[0][no_key] == 0).all()


def test_seq_start_int32(device):
    q, k, v, g = make_inputs(B=2, Tq=50, H=2, D=32, device=device)
    check_against_reference(q, k, v, g, seq_start=index_tensor([3, 17], device, torch.int32))


# Packed batches (FlashAttention's varlen layout), including zero-length sequences.
@pytest.mark.parametrize("lengths", [[5, 0, 60, 32], [1, 97], [0, 130, 0, 1], [300]], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen(device, dtype, lengths):
    total = sum(lengths)
    q, k, v, g = make_inputs(B=1, Tq=total, H=4, Hkv=2, D=64, dtype=dtype, device=device,
                             regime="mixed")
    cu_seqlens = index_tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device,
                              torch.int32)
    out, _ = check_against_reference(q, k, v, g, cu_seqlens=cu_seqlens)

    # Each packed sequence gives exactly what the op gives for it alone (nothing leaks across).
    for b, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        if e > b:
            alone = op(q[:, b:e], k[:, b:e], v[:, b:e], g[:, b:e])
            torch.testing.assert_close(out[:, b:e], alone, **same_math_tol(dtype))


# ---- float64 gradcheck (CPU) ---------------------------------------------------------------------

GRADCHECK_CASES = {
    "plain": dict(B=2, Tq=6, H=2, D=3),
    "tq<tk": dict(B=2, Tq=3, Tk=7, H=2, D=3),
    "gqa": dict(B=1, Tq=6, H=4, Hkv=2, D=3),
    "mqa_strong": dict(B=1, Tq=6, H=3, Hkv=1, D=5, regime="strong"),
    "seq_start": dict(B=2, Tq=6, H=2, D=3, seq_start=[0, 3]),
    "seq_start_tq<tk": dict(B=2, Tq=4, Tk=6, H=2, D=3, seq_start=[2, 5]),
    "cu_seqlens": dict(B=1, Tq=9, H=2, Hkv=1, D=3, cu_seqlens=[0, 2, 2, 7, 9]),
    # Longer than a tile (CPU tiles are 128 queries x 256 keys; GPU tiles are smaller): the
    # carries of gate sums between tiles. Checked in fast mode (random projections) for time.
    "multi_tile": dict(B=1, Tq=140, Tk=300, H=1, D=2, regime="strong"),
    "multi_tile_varlen": dict(B=1, Tq=300, H=2, Hkv=1, D=2, cu_seqlens=[0, 30, 290, 300]),
}


@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=str)
def test_gradcheck_float64(case):
    cfg = dict(GRADCHECK_CASES[case])
    seq_start = cfg.pop("seq_start", None)
    cu_seqlens = cfg.pop("cu_seqlens", None)
    seq_start = None if seq_start is None else index_tensor(seq_start, "cpu")
    cu_seqlens = None if cu_seqlens is None else index_tensor(cu_seqlens, "cpu")
    inputs = [x.requires_grad_() for x in make_inputs(dtype=torch.float64, **cfg)]
    assert torch.autograd.gradcheck(
        lambda q, k, v, g: op(q, k, v, g, seq_start, cu_seqlens, 0.7),
        inputs, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=case.startswith("multi_tile"))


# ---- numerics at large |c| -----------------------------------------------------------------------


def test_position_robustness(device):
    """Late in a long sequence of a fast-forgetting head c = cumsum(log f) reaches ~-1e6, where one
    float32 ulp is 0.06. Local attention there must still be float32-accurate: the bias of nearby
    tokens may depend on their distance, never on the absolute position (design.md section 1)."""
    T, prefix, window, last = 4096, 2000, 1024, 256
    q, k, v, _ = make_inputs(B=1, Tq=T, H=1, D=64, device=device)
    # 2000 tokens of log f = -500 drive c to -1e6, then ordinary gates (spans of tens of tokens).
    log_fgate = make_log_fgate(1, T, 1, "normal", device=device)
    log_fgate[:, :prefix] = F.logsigmoid(torch.tensor(-500.0))
    c_end = log_fgate.double().sum().item()
    assert c_end < -9e5

    grad_out = torch.randn(q.shape, device=device)
    out, grads = forward_backward(op, (q, k, v, log_fgate), grad_out)

    # Reference on the last `window` positions only, with c restarted at the window (d_ij depends
    # only on differences, so this is exact up to the keys before the window, whose bias relative to
    # the last `last` queries is below -40: e^-40 of the mass, far below float32 resolution).
    w = slice(T - window, T)
    gap = log_fgate[0, T - window + 1:T - last + 1, 0].double().sum().item()
    assert gap < -40, gap
    ref, ref_grads = forward_backward(
        naive_attention, [x[:, w].double() for x in (q, k, v, log_fgate)], grad_out[:, w].double())

    # The kernel on the window alone (|c| small) is the float32 yardstick: at |c| ~ 1e6 the errors
    # must be the same (position independence), and small in absolute terms.
    window_out, window_grads = forward_backward(op, [x[:, w] for x in (q, k, v, log_fgate)],
                                                grad_out[:, w])
    tail = slice(window - last, window)  # the last `last` positions, in window coordinates
    # Relative to max|ref|: a few ulps times the number of summed terms.
    bounds = {"out": 1e-5, "dq": 3e-5, "dk": 3e-5, "dv": 3e-5, "dlog_fgate": 5e-5}
    errors, problems = {}, []
    for name, got, win, r in zip(("out",) + GRAD_NAMES, [out] + grads,
                                 [window_out] + window_grads, [ref] + ref_grads):
        r_tail = r[:, tail]
        magnitude = max(1.0, r_tail.abs().max().item())
        errors[name] = err = max_abs_err(got[:, T - last:], r_tail) / magnitude
        err_window = max_abs_err(win[:, tail], r_tail) / magnitude
        if err > bounds[name] or err > 2 * err_window + 1e-6:
            problems.append(f"{name}: relative error {err:.2e} at |c| ~ 1e6 vs {err_window:.2e} "
                            f"near c = 0 (bound {bounds[name]:.0e})")
    assert not problems, f"last {last} positions: " + "; ".join(problems)

    # The naive float32 formula (d = difference of two global prefix sums) is visibly wrong here.
    c32 = log_fgate[0, :, 0].cumsum(0)
    scores = (q[0, T - last:, 0] @ k[0, :, 0].T) / 8.0 + (c32[T - last:, None] - c32[None, :])
    causal = torch.arange(T, device=device)[None, :] <= torch.arange(T - last, T, device=device)[:, None]
    naive32 = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v[0, :, 0]
    ref_tail = ref[0, tail, 0]
    naive_err = max_abs_err(naive32, ref_tail) / max(1.0, ref_tail.abs().max().item())
    assert naive_err > 1e-2 and naive_err > 100 * errors["out"], (
        f"naive float32 relative error {naive_err:.2e} vs the op's {errors['out']:.2e}")


# ---- layouts -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_head_first(device, dtype):
    """head_first=True takes (B, H, T, D) / (B, H, T) and returns (B, H, Tq, D)."""
    q, k, v, g = make_inputs(B=2, Tq=33, Tk=70, H=4, Hkv=2, D=40, dtype=dtype, device=device)
    seq_start = index_tensor([0, 20], device)
    hf = [x.transpose(1, 2).contiguous() for x in (q, k, v, g)]
    grad_out = torch.randn(q.shape, device=device).to(dtype)

    out_hf, grads_hf = forward_backward(
        lambda *x: forgetting_transformer.forgetting_attention(*x, head_first=True,
                                                               seq_start=seq_start),
        hf, grad_out.transpose(1, 2))
    out, grads = forward_backward(lambda *x: op(*x, seq_start), (q, k, v, g), grad_out)

    assert out_hf.shape == (2, 4, 33, 40)
    tol = same_math_tol(dtype)
    torch.testing.assert_close(out_hf.transpose(1, 2), out, **tol)
    for name, a, b in zip(GRAD_NAMES, grads_hf, grads):
        torch.testing.assert_close(a.transpose(1, 2), b, **tol, msg=lambda m: f"{name}: {m}")


def _noncontiguous_inputs(kind, device, dtype, B=2, T=70, H=4, D=32):
    """Views as models produce them, plus the leaf tensors gradients flow to."""
    g_base = make_log_fgate(B, T, H, device=device)
    if kind == "fused_qkv":  # slices of one (B, T, 3, H, D) projection
        base = torch.randn(B, T, 3, H, D, device=device, dtype=dtype)
        views = lambda b, g: (b[:, :, 0], b[:, :, 1], b[:, :, 2], g)
        leaves = [base, g_base]
    elif kind == "transposed":  # (B, H, T, D) storage seen as (B, T, H, D); log f too
        base = torch.randn(3, B, H, T, D, device=device, dtype=dtype)
        g_base = g_base.transpose(1, 2).contiguous()
        views = lambda b, g: (b[0].transpose(1, 2), b[1].transpose(1, 2), b[2].transpose(1, 2),
                              g.transpose(1, 2))
        leaves = [base, g_base]
    elif kind == "strided_head_dim":  # every other element of the last dim
        base = torch.randn(3, B, T, H, 2 * D, device=device, dtype=dtype)
        g_wide = make_log_fgate(B, T, 2 * H, device=device)
        views = lambda b, g: (b[0, ..., ::2], b[1, ..., ::2], b[2, ..., 1::2], g[..., ::2])
        leaves = [base, g_wide]
    else:
        raise ValueError(kind)
    return leaves, views


@pytest.mark.parametrize("kind", ["fused_qkv", "transposed", "strided_head_dim"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_non_contiguous_inputs(device, dtype, kind):
    leaves, views = _noncontiguous_inputs(kind, device, dtype)
    q, k, v, g = views(*leaves)
    assert not all(x.is_contiguous() for x in (q, k, v, g))
    grad_out = torch.randn(q.shape, device=device, dtype=dtype)

    out, grads = forward_backward(lambda *x: op(*views(*x)), leaves, grad_out)
    contiguous = lambda *x: op(*(t.contiguous() for t in views(*x)))
    out_c, grads_c = forward_backward(contiguous, leaves, grad_out)

    tol = same_math_tol(dtype)
    torch.testing.assert_close(out, out_c, **tol)
    for a, b in zip(grads, grads_c):
        torch.testing.assert_close(a, b, **tol)
    # ...and it is right, not just consistent.
    check_against_reference(*(x.detach() for x in views(*leaves)))


@pytest.mark.parametrize("options", [
    {}, {"sm_scale": 0.2}, {"seq_start": [1, 30]}, {"adaptive_threshold": -30.0},
    {"cu_seqlens": [0, 13, 50]},
], ids=str)
def test_wrapper_matches_op(device, options):
    options = dict(options)
    batch = 1 if "cu_seqlens" in options else 2
    q, k, v, g = make_inputs(B=batch, Tq=50, H=4, Hkv=1, D=24, device=device)
    for key in ("seq_start", "cu_seqlens"):
        if key in options:
            options[key] = index_tensor(options[key], device)
    out = forgetting_transformer.forgetting_attention(q, k, v, g, **options)
    expected = op(q, k, v, g, options.get("seq_start"), options.get("cu_seqlens"),
                  options.get("sm_scale"), options.get("adaptive_threshold"))
    assert torch.equal(out, expected)


def test_fwd_and_bwd_ops(device):
    """fwd returns the output of the main op and the float32 log-sum-exp of each row; bwd
    returns what autograd of the main op returns."""
    q, k, v, g = make_inputs(B=2, Tq=40, Tk=60, H=4, Hkv=2, D=32, dtype=torch.bfloat16,
                             device=device)
    seq_start = index_tensor([0, 35], device)  # rows of batch 1 before position 35 have no key
    out, lse = torch.ops.fox.forgetting_attention_fwd(q, k, v, g, seq_start)
    assert torch.equal(out, op(q, k, v, g, seq_start))
    assert lse.shape == (2, 4, 40) and lse.dtype == torch.float32

    _, ref_lse = naive_attention(*(x.double() for x in (q, k, v, g)), seq_start=seq_start,
                                 return_lse=True)
    has_key = torch.isfinite(ref_lse)
    assert not has_key.all()  # the case really has empty rows
    torch.testing.assert_close(lse[has_key].double(), ref_lse[has_key], rtol=0, atol=1e-4)
    assert (lse[~has_key] == float("-inf")).all()

    grad_out = torch.randn_like(q)
    _, grads = forward_backward(lambda *x: op(*x, seq_start), (q, k, v, g), grad_out)
    bwd = torch.ops.fox.forgetting_attention_bwd(grad_out, q, k, v, g, out, lse, seq_start)
    for name, a, b in zip(GRAD_NAMES, bwd, grads):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_float16_gates(device, dtype):
    """float16 log_fgate (a compact decoding cache) means the float32 gates of the same values:
    the same output bit for bit (prefill and decoding shapes), and a float16 gradient that is the
    float32 one rounded."""
    for Tq, Tk in ((40, 60), (1, 300)):
        q, k, v, g = make_inputs(B=2, Tq=Tq, Tk=Tk, H=4, Hkv=2, D=64, dtype=dtype, device=device,
                                 regime="mixed")
        g16 = g.half()
        grad_out = torch.randn_like(q)
        out16, grads16 = forward_backward(op, (q, k, v, g16), grad_out)
        out32, grads32 = forward_backward(op, (q, k, v, g16.float()), grad_out)
        assert torch.equal(out16, out32)
        for name, a, b in zip(GRAD_NAMES[:3], grads16[:3], grads32[:3]):
            assert torch.equal(a, b), name
        assert grads16[3].dtype == torch.float16
        assert torch.equal(grads16[3], grads32[3].half())


# ---- edge cases ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_rows_without_keys_are_zero_not_nan(device, dtype):
    """Queries inside the left padding and empty packed sequences: 0 output, finite gradients."""
    skip_unsupported(device, dtype)
    q, k, v, g = make_inputs(B=2, Tq=80, H=2, D=16, dtype=dtype, device=device)
    seq_start = index_tensor([79, 50], device)
    out, grads = forward_backward(lambda *x: op(*x, seq_start), (q, k, v, g),
                                  torch.randn_like(q))
    assert (out[0, :79] == 0).all() and (out[1, :50] == 0).all()
    assert all(torch.isfinite(x).all() for x in [out] + grads)
    # Keys/values before seq_start are never read: no gradient.
    assert (grads[1][0, :79] == 0).all() and (grads[2][1, :50] == 0).all()

    q, k, v, g = make_inputs(B=1, Tq=20, H=2, D=16, dtype=dtype, device=device)
    cu_seqlens = index_tensor([0, 0, 7, 7, 20, 20], device)
    out, grads = forward_backward(lambda *x: op(*x, None, cu_seqlens), (q, k, v, g),
                                  torch.randn_like(q))
    assert all(torch.isfinite(x).all() for x in [out] + grads)


@pytest.mark.parametrize("shape", [(0, 5, 5), (2, 0, 0), (2, 0, 5)], ids=str)
def test_empty_inputs(device, shape):
    """Empty batch or sequence: empty output, zero gradients, no error."""
    B, Tq, Tk = shape
    q, k, v, g = make_inputs(B=B, Tq=Tq, Tk=Tk, H=2, D=8, device=device)
    out, grads = forward_backward(op, (q, k, v, g), torch.randn_like(q))
    assert out.shape == q.shape
    assert all(x.shape == y.shape and (x == 0).all() for x, y in zip(grads, (q, k, v, g)))


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_deterministic(device, kv_heads):
    """Same inputs twice: bitwise the same output and gradients (no order-dependent atomics)."""
    q, k, v, g = make_inputs(B=2, Tq=300, H=4, Hkv=kv_heads, D=64, dtype=torch.bfloat16,
                             device=device)
    grad_out = torch.randn_like(q)
    first = forward_backward(op, (q, k, v, g), grad_out)
    second = forward_backward(op, (q, k, v, g), grad_out)
    assert torch.equal(first[0], second[0])
    for name, a, b in zip(GRAD_NAMES, first[1], second[1]):
        assert torch.equal(a, b), name


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_gate_gradient_of_long_sequences(monkeypatch):
    """The gate's gradient is a reverse cumulative sum over the whole sequence, which the GPU splits
    into chunks of positions (up to 64 per sequence, several pieces of 1024 each past 64k): at chunk
    and piece boundaries it must be the gradient of the whole sequence. With a fast-forgetting gate
    (log f ~ -1.3) a position's gradient only depends on the pairs within W tokens around it, so
    the float64 op on a slice around it gives the reference; and a packed batch of long sequences
    gives each sequence what it gets alone (with one backward form for both: on Hopper the form
    follows the longest sequence of a call, and the two forms round differently)."""
    torch.manual_seed(0)
    N, H, D, W = 70_000, 2, 64, 128  # 64 chunks of 2 pieces (35 of them hold positions)
    q, k, v = (torch.randn(1, N, H, D, device="cuda") for _ in range(3))
    log_f = F.logsigmoid(torch.randn(1, N, H, device="cuda") * 0.5 - 1.0)
    grad_out = torch.randn(1, N, H, D, device="cuda")
    _, grads = forward_backward(op, (q, k, v, log_f), grad_out)
    dlog_f = grads[3]
    for t in (1, 1023, 1024, 2047, 2048, 2049, 4096, 40_000, 65_535, 65_536, 68_607, 68_608, N - 1):
        lo, hi = max(0, t - 2 * W), min(N, t + W)
        part = [x[:, lo:hi].cpu().double() for x in (q, k, v, log_f)]
        _, ref = forward_backward(op, part, grad_out[:, lo:hi].cpu().double())
        expected = ref[3][0, t - lo]
        torch.testing.assert_close(dlog_f[0, t].cpu().double(), expected, rtol=1e-4,
                                   atol=1e-4 * expected.abs().max().item(), msg=f"position {t}")

    monkeypatch.setenv("FOX_FUSED_BACKWARD_MIN_LEN", "0")
    lengths = [3000, 1, 2300, 0, 1025]
    bounds = torch.tensor([0] + lengths).cumsum(0).tolist()
    q, k, v, g = make_inputs(B=1, Tq=bounds[-1], H=2, D=64, dtype=torch.bfloat16, device="cuda",
                             regime="mixed")
    grad_out = torch.randn_like(q)
    cu_seqlens = index_tensor(bounds, "cuda", torch.int32)
    _, packed = forward_backward(lambda *x: op(*x, None, cu_seqlens), (q, k, v, g), grad_out)
    for b, e in zip(bounds[:-1], bounds[1:]):
        if e > b:
            _, alone = forward_backward(op, [x[:, b:e] for x in (q, k, v, g)], grad_out[:, b:e])
            scale = alone[3].abs().max().item()
            torch.testing.assert_close(packed[3][:, b:e], alone[3], rtol=1e-5, atol=1e-5 * scale)


FUSED_BACKWARD_CASES = [  # (name, B, Tq, Tk, H, Hkv, D, seq_start, varlen lengths, threshold)
    ("d128", 2, 300, 300, 2, 2, 128, None, None, None),
    ("d64", 2, 300, 300, 2, 2, 64, None, None, None),
    ("gqa_tq_lt_tk_partial_tiles", 1, 97, 400, 4, 2, 128, None, None, None),
    ("gqa_d64", 1, 260, 260, 4, 1, 64, None, None, None),
    ("seq_start", 2, 300, 300, 2, 2, 64, [0, 170], None, None),
    ("varlen_d128", 1, 0, 0, 2, 1, 128, None, [5, 0, 200, 131], None),
    ("varlen_d64", 1, 0, 0, 2, 2, 64, None, [130, 1, 257], None),
    ("threshold", 2, 300, 300, 2, 2, 128, None, None, -30.0),
    ("long_d128", 1, 2100, 2100, 2, 2, 128, None, None, None),  # 17 key tiles add to a query tile
    ("long_gqa_d64", 1, 1900, 1900, 4, 2, 64, None, None, None),
]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("case", FUSED_BACKWARD_CASES, ids=[c[0] for c in FUSED_BACKWARD_CASES])
@pytest.mark.parametrize("order", ["in_turns", "in_turns_walking_down", "any_order"])
def test_fused_backward(monkeypatch, case, order):
    """On Hopper, the five-product backward whose dQ a writer warpgroup adds up in float32
    (FOX_FUSED_BACKWARD_MIN_LEN=0: at every length, not only long sequences): in turns (the
    default), bitwise the same on every run, with the walks up from each key tile's diagonal or
    (FOX_FUSED_WALK_DOWN=1, the default only for the last blocks of a large grid) down to it;
    in any order (FOX_NONDETERMINISTIC_BACKWARD=1), which
    torch.use_deterministic_algorithms(True) turns off. Same 2x rule against the float64
    reference; out, dK and dV are the two-kernel backward's bits (FOX_FUSED_BACKWARD=0; walking
    down, dK and dV add the query tiles in the other order). In turns
    the first addition to each row stores it: the workspace starts as NaN here, so a row that no
    key tile writes (and dq_from_accumulator does not zero) shows. (Pruning, the threshold case,
    keeps the two kernels.)"""
    name, B, Tq, Tk, H, Hkv, D, starts, lengths, threshold = case
    cu_seqlens = seq_start = None
    if lengths is not None:
        Tq = Tk = sum(lengths)
        cu_seqlens = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda",
                                  dtype=torch.int32)
    if starts is not None:
        seq_start = torch.tensor(starts, device="cuda")
    q, k, v, g = make_inputs(B=B, Tq=Tq, Tk=Tk, H=H, Hkv=Hkv, D=D, dtype=torch.bfloat16,
                             device="cuda")
    grad_out = torch.randn(q.shape, device="cuda")
    opts = dict(seq_start=seq_start, cu_seqlens=cu_seqlens)
    run = lambda *x: op(*x, seq_start, cu_seqlens, None, threshold)  # noqa: E731
    monkeypatch.setenv("FOX_FUSED_BACKWARD", "0")
    deterministic = forward_backward(run, (q, k, v, g), grad_out.to(q.dtype))
    monkeypatch.delenv("FOX_FUSED_BACKWARD")
    if order == "any_order":
        monkeypatch.setenv("FOX_NONDETERMINISTIC_BACKWARD", "1")
    monkeypatch.setenv("FOX_FUSED_WALK_DOWN", "1" if order == "in_turns_walking_down" else "0")
    monkeypatch.setenv("FOX_FUSED_BACKWARD_MIN_LEN", "0")
    monkeypatch.setenv("FOX_POISON_FUSED_WORKSPACE", "1")
    (out, grads), kernels = with_kernel_names(
        lambda: forward_backward(run, (q, k, v, g), grad_out.to(q.dtype)))
    # Which backward ran, from the kernels launched: the fused form is the dK/dV kernel's
    # instantiation with dQ, and it ends with dQ's conversion (dQ's bits cannot tell: where a query
    # tile sees few key tiles, the two orders of the float32 sums often round to the same 16-bit dQ).
    fused, converted = fused_backward_ran(kernels)
    assert fused == converted == (threshold is None), sorted(kernels)
    ref, ref_grads = forward_backward(lambda *x: naive_attention(*x, **opts),
                                      [x.double() for x in (q, k, v, g)], grad_out.double())
    naive, naive_grads = forward_backward(lambda *x: naive_attention(*x, **opts, dtype=q.dtype),
                                          (q, k, v, g), grad_out.to(q.dtype))
    problems = rule_violations(("out",) + GRAD_NAMES, [out] + grads, [ref] + ref_grads,
                               [naive] + naive_grads, q.dtype)
    assert not problems, f"[{name}] " + "; ".join(problems)
    # The forward, dK and dV are the deterministic kernels' arithmetic; dQ and the gate gradient
    # differ by the order of float32 additions.
    assert torch.equal(out, deterministic[0])
    for grad_name, a, b in zip(GRAD_NAMES, grads, deterministic[1]):
        if grad_name in ("dk", "dv") and order != "in_turns_walking_down":
            assert torch.equal(a, b), grad_name
        else:
            torch.testing.assert_close(a, b, **same_math_tol(q.dtype))
    if order != "any_order":
        for _ in range(2):
            again = forward_backward(run, (q, k, v, g), grad_out.to(q.dtype))
            for grad_name, a, b in zip(GRAD_NAMES, again[1], grads):
                assert torch.equal(a, b), grad_name
        return
    # Under torch.use_deterministic_algorithms(True): the default's bits, the turns
    monkeypatch.delenv("FOX_NONDETERMINISTIC_BACKWARD")
    in_turns = forward_backward(run, (q, k, v, g), grad_out.to(q.dtype))
    monkeypatch.setenv("FOX_NONDETERMINISTIC_BACKWARD", "1")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        again = forward_backward(run, (q, k, v, g), grad_out.to(q.dtype))
    finally:
        torch.use_deterministic_algorithms(previous)
    for grad_name, a, b in zip(GRAD_NAMES, again[1], in_turns[1]):
        assert torch.equal(a, b), grad_name


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("D", [64, 128])
def test_fused_backward_last_blocks_walk_down(monkeypatch, D):
    """The default backward of a grid large enough that its last section of dK/dV blocks walks
    down (two waves of blocks before it): within the 2x rule of the float64 reference, bitwise the
    same on every run, and not the bits of a backward whose walks all go up (FOX_FUSED_WALK_DOWN=0),
    so the walks down did run. The fast-forgetting half of the heads (log f down to -20) tests C
    near the keys of a walk that starts 2k positions above them (sums of ~10^4 there)."""
    torch.manual_seed(0)
    B, N, H = (4, 2048, 16) if D == 128 else (2, 2048, 32)
    q, k, v, g = make_inputs(B=B, Tq=N, H=H, D=D, dtype=torch.bfloat16, device="cuda",
                             regime="mixed")
    grad_out = torch.randn(q.shape, device="cuda").to(q.dtype)
    out, grads = forward_backward(op, (q, k, v, g), grad_out)
    for _ in range(2):
        again = forward_backward(op, (q, k, v, g), grad_out)[1]
        for grad_name, a, b in zip(GRAD_NAMES, again, grads):
            assert torch.equal(a, b), grad_name
    monkeypatch.setenv("FOX_FUSED_WALK_DOWN", "0")
    walks_up = forward_backward(op, (q, k, v, g), grad_out)[1]
    assert not torch.equal(walks_up[1], grads[1])  # dK: the last section's query tiles in another order
    ref, ref_grads = forward_backward(naive_attention, [x.double() for x in (q, k, v, g)],
                                      grad_out.double())
    naive, naive_grads = forward_backward(lambda *x: naive_attention(*x, dtype=q.dtype),
                                          (q, k, v, g), grad_out)
    problems = rule_violations(("out",) + GRAD_NAMES, [out] + grads, [ref] + ref_grads,
                               [naive] + naive_grads, q.dtype)
    assert not problems, "; ".join(problems)


TMA_CASES = [  # (name, B, Tq, Tk, H, Hkv, D, layout)
    ("padded", 2, 700, 700, 4, 4, 64, "bthd"),
    ("gqa_tq_lt_tk", 1, 300, 900, 4, 2, 128, "bthd"),
    ("head_first", 2, 513, 513, 2, 2, 64, "bhtd"),
    ("varlen", 1, 0, 0, 2, 1, 128, "varlen"),
    ("row_stride_not_16_bytes", 1, 400, 400, 2, 2, 64, "odd_stride"),
]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("case", TMA_CASES, ids=[c[0] for c in TMA_CASES])
def test_tma_and_cp_async_paths_agree(monkeypatch, case):
    """The Hopper kernels load full tiles by TMA where the layout allows it, else by cp.async
    (FOX_DISABLE_TMA=1 forces it): the same arithmetic, so bitwise the same output and gradients,
    with and without pruning. (Elsewhere than on a Hopper GPU both runs take the same path.) The
    backward in two kernels: the fused one has no cp.async form (test_fused_backward's)."""
    name, B, Tq, Tk, H, Hkv, D, layout = case
    monkeypatch.setenv("FOX_FUSED_BACKWARD", "0")
    cu_seqlens = None
    if layout == "varlen":
        lengths = [130, 700, 1, 257]
        q, k, v, g = make_inputs(B=1, Tq=sum(lengths), H=H, Hkv=Hkv, D=D, dtype=torch.bfloat16,
                                 device="cuda")
        cu_seqlens = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda",
                                  dtype=torch.int32)
    else:
        q, k, v, g = make_inputs(B=B, Tq=Tq, Tk=Tk, H=H, Hkv=Hkv, D=D, dtype=torch.bfloat16,
                                 device="cuda")
    if layout == "bhtd":  # head-first storage, viewed in the op's layout
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    if layout == "odd_stride":  # rows 2 * (H * D + 4) bytes apart: no tensor map, cp.async
        def padded_rows(x):
            rows = torch.zeros(*x.shape[:2], x.shape[2] * D + 4, dtype=x.dtype, device=x.device)
            view = rows[..., : x.shape[2] * D].unflatten(-1, (x.shape[2], D))
            view.copy_(x)
            return view
        q, k, v = (padded_rows(x) for x in (q, k, v))
    grad_out = torch.randn_like(q)
    for threshold in (None, -5.0):
        results = []
        for disable in ("0", "1"):
            monkeypatch.setenv("FOX_DISABLE_TMA", disable)
            inputs = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g)]
            out = op(*inputs, None, cu_seqlens, None, threshold)
            grads = torch.autograd.grad(out, inputs, grad_out)
            results.append((out, grads))
        assert torch.equal(results[0][0], results[1][0]), (name, threshold)
        for grad_name, a, b in zip(GRAD_NAMES, results[0][1], results[1][1]):
            assert torch.equal(a, b), (name, threshold, grad_name)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_blocks_in_several_sections():
    """The tensor-core kernels take their tiles in sections of rows (sequence x head) whose walked
    tiles fill ~8 MB, the longest walks first inside a section: at D=128 and 2500 positions a
    section holds 6 of the 10 rows, so the last one is narrower. Every tile must still be computed
    exactly once (the portable kernels share the order: FOX_DISABLE_HOPPER_KERNELS=1 runs them)."""
    check_against_reference(*make_inputs(B=2, Tq=2500, H=5, D=128, dtype=torch.bfloat16,
                                         device="cuda"))


# ---- adaptive computation pruning ----------------------------------------------------------------


def _pruning_case(device, T=2048, H=2, D=32, log_f=-0.1, qk_scale=0.25):
    q, k, v, _ = make_inputs(B=1, Tq=T, H=H, D=D, device=device, qk_scale=qk_scale)
    # Gates near log_f per token (the attention span is ~ 1 / |log f|): logsigmoid(x) = log_f
    # for x = -log(expm1(-log_f)); a little noise on the logits.
    logits = -math.log(math.expm1(-log_f)) + 0.2 * torch.randn(1, T, H)
    return q, k, v, F.logsigmoid(logits).to(device)


def _dropped_mass(q, k, v, log_fgate, threshold):
    """Per query, the float64 attention mass of the keys a pruning at `threshold` may skip (those
    with d_ij < threshold: whole tiles are skipped only when every d_ij in them is below it)."""
    q, k, v, log_fgate = (x.double() for x in (q, k, v, log_fgate))
    T, D = q.shape[1], q.shape[-1]
    c = log_fgate.cumsum(1).transpose(1, 2)  # (B, H, T)
    d = c[..., :, None] - c[..., None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(D) + d
    p = s.masked_fill(~causal, float("-inf")).softmax(-1)
    return (p * (d < threshold)).sum(-1).transpose(1, 2)  # (B, T, H)


def test_pruning_off_when_threshold_very_negative(device):
    q, k, v, g = _pruning_case(device, T=600, log_f=-2.0)
    grad_out = torch.randn_like(q)
    exact = forward_backward(op, (q, k, v, g), grad_out)
    for threshold in (-1e9, float("-inf")):
        pruned = forward_backward(lambda *x: op(*x, None, None, None, threshold), (q, k, v, g),
                                  grad_out)
        assert torch.equal(pruned[0], exact[0])
        for name, a, b in zip(GRAD_NAMES, pruned[1], exact[1]):
            assert torch.equal(a, b), name


def test_pruning_design_bound(device):
    """design.md: with |scale q.k| <= U, skipping keys with d < log(eps) - 2U - log N loses at most
    eps of each row's mass, so the output moves by at most 2 eps max|v|."""
    eps = 1e-3
    q, k, v, g = _pruning_case(device)
    T, D = q.shape[1], q.shape[-1]
    U = q.norm(dim=-1).max().item() * k.norm(dim=-1).max().item() / math.sqrt(D)
    threshold = math.log(eps) - 2 * U - math.log(T)
    assert -40 < threshold < -10  # a threshold that prunes a lot with these gates

    dropped = _dropped_mass(q, k, v, g, threshold)
    assert dropped.max() <= eps  # the bound itself (a sanity check of the test)

    grad_out = torch.randn_like(q)
    exact_out, exact_grads = forward_backward(op, (q, k, v, g), grad_out)
    out, grads = forward_backward(lambda *x: op(*x, None, None, None, threshold), (q, k, v, g),
                                  grad_out)
    err = max_abs_err(out, exact_out)
    assert err <= 2 * eps * v.abs().max().item() + 1e-5, err
    # Gradients are sums of the same probabilities: they move by O(eps) of their magnitude too.
    for name, a, b in zip(GRAD_NAMES, grads, exact_grads):
        rel = max_abs_err(a, b) / max(1.0, b.abs().max().item())
        assert rel <= 10 * eps, f"{name}: relative change {rel:.2e}"


def test_pruning_error_bounded_by_dropped_mass(device):
    """A moderate threshold with gates whose span is comparable to a tile: pruning visibly changes
    the result, but each row only by the mass of keys whose bias is below the threshold."""
    threshold = -3.0
    q, k, v, g = _pruning_case(device, log_f=-0.02, qk_scale=1.0)
    exact = op(q, k, v, g)
    pruned = op(q, k, v, g, None, None, None, threshold)
    assert torch.isfinite(pruned).all()

    dropped = _dropped_mass(q, k, v, g, threshold)  # (B, T, H)
    row_err = (pruned.double() - exact.double()).abs().amax(-1)  # (B, T, H)
    bound = 2 * dropped * v.abs().max().item() + 1e-5
    worst = (row_err - bound).max().item()
    assert worst <= 0, f"a row moved by {worst:.2e} more than its dropped mass allows"
    assert row_err.max() > 1e-4, "the threshold pruned nothing"


# ---- PyTorch integration -------------------------------------------------------------------------

OPCHECK_CASES = {
    "plain": dict(B=2, Tq=9, H=2, D=8),
    "gqa_tq<tk": dict(B=2, Tq=5, Tk=11, H=4, Hkv=2, D=8),
    "seq_start": dict(B=2, Tq=9, H=2, D=8, seq_start=[0, 4]),
    "cu_seqlens": dict(B=1, Tq=12, H=2, D=8, cu_seqlens=[0, 5, 5, 12]),
    "options": dict(B=1, Tq=9, H=2, D=8, sm_scale=0.5, adaptive_threshold=-5.0),
    "cache_seqlens": dict(B=3, Tq=2, Tk=10, H=4, Hkv=2, D=8, cache_seqlens=[10, 2, 7]),
    "float16_gates": dict(B=2, Tq=3, Tk=10, H=4, Hkv=2, D=8, gate_dtype=torch.float16),
}


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
def test_opcheck(case, requires_grad):
    cfg = dict(OPCHECK_CASES[case])
    extra = {key: cfg.pop(key, None) for key in
             ("seq_start", "cu_seqlens", "sm_scale", "adaptive_threshold", "cache_seqlens")}
    for key in ("seq_start", "cu_seqlens", "cache_seqlens"):
        if extra[key] is not None:
            extra[key] = index_tensor(extra[key], "cpu")
    gate_dtype = cfg.pop("gate_dtype", None)
    inputs = make_inputs(**cfg)
    if gate_dtype is not None:
        inputs = inputs[:3] + (inputs[3].to(gate_dtype),)
    inputs = [x.requires_grad_(requires_grad) for x in inputs]
    torch.library.opcheck(op.default, tuple(inputs), extra)
    if not requires_grad:
        torch.library.opcheck(torch.ops.fox.forgetting_attention_fwd.default, tuple(inputs), extra)


@pytest.mark.slow
def test_torch_compile_fullgraph():
    """The op inside a compiled model function: fake kernels and autograd trace without graph
    breaks, and compiled forward and backward agree with eager."""
    torch._dynamo.reset()

    def block(x, w_qkv, w_f, seq_start):
        B, T, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in (x @ w_qkv).view(B, T, 3, 2, 16).unbind(2))
        log_f = F.logsigmoid(x @ w_f).transpose(1, 2)
        out = forgetting_transformer.forgetting_attention(q, k, v, log_f, head_first=True,
                                                          seq_start=seq_start)
        return out.transpose(1, 2).flatten(2).tanh()

    x = torch.randn(2, 40, 32)
    w_qkv = (torch.randn(32, 96) / 6).requires_grad_()
    w_f = (torch.randn(32, 2) / 6).requires_grad_()
    seq_start = index_tensor([0, 7], "cpu")
    compiled = torch.compile(block, fullgraph=True)

    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):  # the second call must reuse the compiled graph
            out_c, grads_c = forward_backward(lambda a, b: compiled(x, a, b, seq_start),
                                              (w_qkv, w_f), torch.ones(2, 40, 32))
    out_e, grads_e = forward_backward(lambda a, b: block(x, a, b, seq_start), (w_qkv, w_f),
                                      torch.ones(2, 40, 32))
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# ---- per-row cache lengths (cache_seqlens) ---------------------------------------------------------


def rowwise_reference(q, k, v, g, lengths, seq_start=None, dtype=torch.float64):
    """The formula on each row's own keys: row b keeps keys [0, lengths[b])."""
    outs = []
    for b, n in enumerate(lengths.tolist()):
        start = None if seq_start is None else seq_start[b:b + 1]
        outs.append(naive_attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], g[b:b + 1, :n],
                                    seq_start=start, dtype=dtype))
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqlen_q", [1, 3, 16, 40])
def test_cache_seqlens(device, dtype, seqlen_q):
    """A cache filled to a different length per row equals the formula on each row's keys, forward
    and backward; keys past a row's length get exactly zero gradient."""
    B, Tk = 4, 150
    q, k, v, g = make_inputs(B, seqlen_q, Tk, 4, 2, 64, dtype=dtype, device=device,
                             regime="mixed")
    lengths = index_tensor([Tk, seqlen_q, 77, 100], device)
    starts = index_tensor([0, 0, 5, 99 - seqlen_q], device)
    grad_out = torch.randn(q.shape, device=device)
    for seq_start in (None, starts):
        inputs = (q, k, v, g)
        out, grads = forward_backward(lambda *x: op(*x, seq_start, None, None, None, lengths),
                                      inputs, grad_out.to(dtype))
        ref, ref_grads = forward_backward(
            lambda *x: rowwise_reference(*x, lengths, seq_start), [x.double() for x in inputs],
            grad_out.double())
        naive, naive_grads = forward_backward(
            lambda *x: rowwise_reference(*x, lengths, seq_start, dtype=dtype), inputs,
            grad_out.to(dtype))
        problems = rule_violations(("out",) + GRAD_NAMES, [out] + grads, [ref] + ref_grads,
                                   [naive] + naive_grads, dtype)
        assert not problems, "; ".join(problems)
        for b, n in enumerate(lengths.tolist()):
            for grad in grads[1:]:
                assert torch.count_nonzero(grad[b, n:]) == 0


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("walk", ["up", "down"])
def test_cache_seqlens_fused_backward(monkeypatch, walk):
    """The five-product backward (forced at every length) with per-row cache lengths and seq_start:
    the queries before a row's seq_start sit at positions of that row's own length, and their dQ
    rows, which no key tile writes in turns, are zeros (the workspace starts as NaN). Every block
    walking its query tiles up, and down (FOX_FUSED_WALK_DOWN=1, the grid's last section's order)."""
    monkeypatch.setenv("FOX_FUSED_WALK_DOWN", "1" if walk == "down" else "0")
    B, Tq, Tk = 3, 200, 700
    q, k, v, g = make_inputs(B, Tq, Tk, 2, 2, 64, dtype=torch.bfloat16, device="cuda",
                             regime="mixed")
    lengths = index_tensor([Tk, 250, 500], "cuda")
    starts = index_tensor([0, 0, 420], "cuda")  # row 2: queries at 300..499, keys from 420
    grad_out = torch.randn(q.shape, device="cuda").to(q.dtype)
    monkeypatch.setenv("FOX_FUSED_BACKWARD_MIN_LEN", "0")
    monkeypatch.setenv("FOX_POISON_FUSED_WORKSPACE", "1")
    (out, grads), kernels = with_kernel_names(lambda: forward_backward(
        lambda *x: op(*x, starts, None, None, None, lengths), (q, k, v, g), grad_out))
    # The fused kernel ran (its instantiation with dQ, and dQ's conversion: test_fused_backward's
    # witness; dQ's bits cannot tell).
    assert fused_backward_ran(kernels) == (True, True), sorted(kernels)
    ref, ref_grads = forward_backward(lambda *x: rowwise_reference(*x, lengths, starts),
                                      [x.double() for x in (q, k, v, g)], grad_out.double())
    naive, naive_grads = forward_backward(
        lambda *x: rowwise_reference(*x, lengths, starts, dtype=q.dtype), (q, k, v, g), grad_out)
    problems = rule_violations(("out",) + GRAD_NAMES, [out] + grads, [ref] + ref_grads,
                               [naive] + naive_grads, q.dtype)
    assert not problems, "; ".join(problems)
    assert torch.count_nonzero(grads[0][2, :120]) == 0


def test_cache_seqlens_gradcheck_float64():
    q, k, v, g = make_inputs(2, 2, 9, 2, 1, 8, dtype=torch.float64, regime="mixed")
    lengths = index_tensor([5, 9], "cpu")
    inputs = [x.clone().requires_grad_() for x in (q, k, v, g)]
    assert torch.autograd.gradcheck(lambda *x: op(*x, None, None, None, None, lengths), inputs)


def test_cache_seqlens_full_equals_none(device):
    q, k, v, g = make_inputs(3, 5, 70, 4, 4, 32, device=device)
    full = index_tensor([70, 70, 70], device)
    assert torch.equal(op(q, k, v, g), op(q, k, v, g, None, None, None, None, full))


# ---- argument errors -----------------------------------------------------------------------------


def _valid(device, B=2, Tq=6, Tk=8, H=4, Hkv=2, D=16):
    q, k, v, g = make_inputs(B=B, Tq=Tq, Tk=Tk, H=H, Hkv=Hkv, D=D, device=device)
    return dict(q=q, k=k, v=v, log_fgate=g, seq_start=None, cu_seqlens=None, sm_scale=None,
                adaptive_threshold=None, cache_seqlens=None)


def _packed(device, lengths=(3, 5)):
    a = _valid(device, B=1, Tq=sum(lengths), Tk=sum(lengths))
    a["cu_seqlens"] = index_tensor([0, lengths[0], sum(lengths)], device)
    return a


def _with(base, **changes):
    def build(device):
        a = _valid(device) if base is None else base(device)
        for key, fn in changes.items():
            a[key] = fn(a, device)
        return a
    return build


# (id, argument builder, name the message must mention)
ERROR_CASES = [
    ("q_rank", _with(None, q=lambda a, d: a["q"][0]), "q"),
    ("k_rank", _with(None, k=lambda a, d: a["k"][..., 0]), "k"),
    ("v_rank", _with(None, v=lambda a, d: a["v"][None]), "v"),
    ("log_fgate_rank", _with(None, log_fgate=lambda a, d: a["log_fgate"][..., None]), "log_fgate"),
    ("k_batch", _with(None, k=lambda a, d: a["k"][:1]), "k"),
    ("k_head_dim", _with(None, k=lambda a, d: a["k"][..., :8]), "k"),
    ("v_seqlen", _with(None, v=lambda a, d: a["v"][:, :5]), "v"),
    ("v_heads", _with(None, v=lambda a, d: a["v"][:, :, :1]), "v"),
    ("log_fgate_seqlen", _with(None, log_fgate=lambda a, d: a["log_fgate"][:, :6]), "log_fgate"),
    ("log_fgate_heads", _with(None, log_fgate=lambda a, d: a["log_fgate"][..., :2]), "log_fgate"),
    ("k_dtype", _with(None, k=lambda a, d: a["k"].half()), "k"),
    ("v_dtype", _with(None, v=lambda a, d: a["v"].bfloat16()), "v"),
    ("q_int", _with(None, q=lambda a, d: a["q"].int(), k=lambda a, d: a["k"].int(),
                    v=lambda a, d: a["v"].int()), "q"),
    ("log_fgate_bf16", _with(None, log_fgate=lambda a, d: a["log_fgate"].bfloat16()), "log_fgate"),
    ("log_fgate_fp64_with_fp32_q", _with(None, log_fgate=lambda a, d: a["log_fgate"].double()),
     "log_fgate"),
    ("log_fgate_fp16_with_fp64_q", _with(None, **{x: (lambda x: lambda a, d: a[x].double())(x)
                                                  for x in ("q", "k", "v")},
                                          log_fgate=lambda a, d: a["log_fgate"].half()),
     "log_fgate"),
    ("head_dim_0", lambda d: _valid(d, D=0), "head_dim"),
    ("head_dim_257", lambda d: _valid(d, D=257), "head_dim"),
    ("kv_heads_not_dividing", lambda d: _valid(d, H=4, Hkv=3), "num_kv_heads"),
    ("seqlen_q_gt_seqlen_k", lambda d: _valid(d, Tq=9, Tk=8), "seqlen_q"),
    ("seq_start_negative", _with(None, seq_start=lambda a, d: index_tensor([0, -1], d)),
     "seq_start"),
    ("seq_start_too_large", _with(None, seq_start=lambda a, d: index_tensor([0, 8], d)),
     "seq_start"),
    ("seq_start_length", _with(None, seq_start=lambda a, d: index_tensor([0, 1, 2], d)),
     "seq_start"),
    ("seq_start_float", _with(None, seq_start=lambda a, d: torch.zeros(2, device=d)), "seq_start"),
    ("seq_start_2d", _with(None, seq_start=lambda a, d: index_tensor([[0], [1]], d)), "seq_start"),
    ("cu_seqlens_decreasing", _with(_packed, cu_seqlens=lambda a, d: index_tensor([0, 5, 3, 8], d)),
     "cu_seqlens"),
    ("cu_seqlens_total", _with(_packed, cu_seqlens=lambda a, d: index_tensor([0, 3, 7], d)),
     "cu_seqlens"),
    ("cu_seqlens_beyond_total", _with(_packed, cu_seqlens=lambda a, d: index_tensor([0, 3, 9], d)),
     "cu_seqlens"),
    ("cu_seqlens_start", _with(_packed, cu_seqlens=lambda a, d: index_tensor([1, 3, 8], d)),
     "cu_seqlens"),
    ("cu_seqlens_one_entry", _with(_packed, cu_seqlens=lambda a, d: index_tensor([8], d)),
     "cu_seqlens"),
    ("cu_seqlens_float", _with(_packed, cu_seqlens=lambda a, d: torch.tensor([0., 3., 8.], device=d)),
     "cu_seqlens"),
    ("cu_seqlens_batch_2", _with(None, cu_seqlens=lambda a, d: index_tensor([0, 8], d)),
     "cu_seqlens"),
    ("cu_seqlens_with_tq<tk", _with(_packed, q=lambda a, d: a["q"][:, 2:]), "cu_seqlens"),
    ("cu_seqlens_and_seq_start", _with(_packed, seq_start=lambda a, d: index_tensor([0], d)),
     "cu_seqlens"),
    ("cache_seqlens_below_seqlen_q",
     _with(None, cache_seqlens=lambda a, d: index_tensor([8, 5], d)), "cache_seqlens"),
    ("cache_seqlens_above_seqlen_k",
     _with(None, cache_seqlens=lambda a, d: index_tensor([9, 8], d)), "cache_seqlens"),
    ("cache_seqlens_length", _with(None, cache_seqlens=lambda a, d: index_tensor([8, 8, 8], d)),
     "cache_seqlens"),
    ("cache_seqlens_float", _with(None, cache_seqlens=lambda a, d: torch.full((2,), 8.0, device=d)),
     "cache_seqlens"),
    ("cache_seqlens_and_cu_seqlens",
     _with(_packed, cache_seqlens=lambda a, d: index_tensor([8], d)), "cache_seqlens"),
    ("sm_scale_nan", _with(None, sm_scale=lambda a, d: float("nan")), "sm_scale"),
    ("adaptive_threshold_nan", _with(None, adaptive_threshold=lambda a, d: float("nan")),
     "adaptive_threshold"),
]

CUDA_ERROR_CASES = [
    ("k_on_cpu", _with(None, k=lambda a, d: a["k"].cpu()), "k"),
    ("log_fgate_on_cpu", _with(None, log_fgate=lambda a, d: a["log_fgate"].cpu()), "log_fgate"),
    ("seq_start_on_cpu", _with(None, seq_start=lambda a, d: index_tensor([0, 1], "cpu")),
     "seq_start"),
    ("cache_seqlens_on_cpu", _with(None, cache_seqlens=lambda a, d: index_tensor([8, 7], "cpu")),
     "cache_seqlens"),
    ("q_float64", _with(None, **{x: (lambda x: lambda a, d: a[x].double())(x)
                                 for x in ("q", "k", "v", "log_fgate")}), "q"),
]


def _assert_error_names(fn, name):
    with pytest.raises(RuntimeError) as info:
        fn()
    message = str(info.value)
    assert re.search(rf"\b{re.escape(name)}\b", message), f"{name!r} not in message: {message}"


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_bad_arguments(device, case):
    _, build, name = case
    a = build(device)
    args = (a["q"], a["k"], a["v"], a["log_fgate"], a["seq_start"], a["cu_seqlens"],
            a["sm_scale"], a["adaptive_threshold"], a["cache_seqlens"])
    _assert_error_names(lambda: op(*args), name)
    _assert_error_names(lambda: torch.ops.fox.forgetting_attention_fwd(*args), name)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("case", CUDA_ERROR_CASES, ids=[c[0] for c in CUDA_ERROR_CASES])
def test_bad_arguments_cuda(case):
    _, build, name = case
    a = build("cuda")
    _assert_error_names(lambda: op(a["q"], a["k"], a["v"], a["log_fgate"], a["seq_start"], None,
                                   None, None, a["cache_seqlens"]), name)


def test_bad_backward_arguments(device):
    a = _valid(device)
    q, k, v, g = a["q"], a["k"], a["v"], a["log_fgate"]
    out, lse = torch.ops.fox.forgetting_attention_fwd(q, k, v, g)
    bwd = torch.ops.fox.forgetting_attention_bwd
    _assert_error_names(lambda: bwd(out[:, :3], q, k, v, g, out, lse), "grad_out")
    _assert_error_names(lambda: bwd(out, q, k, v, g, out, lse[:, :1]), "lse")
    _assert_error_names(lambda: bwd(out, q, k, v, g, out, lse.half()), "lse")


def test_head_first_bad_rank(device):
    a = _valid(device)
    with pytest.raises(RuntimeError, match="log_fgate"):
        forgetting_transformer.forgetting_attention(
            a["q"], a["k"], a["v"], a["log_fgate"][..., None], head_first=True)


def test_pruning_threshold_tolerance_form(device):
    """pruning_threshold(q, k, eps) gives a threshold whose pruned output stays within
    2 * eps * max|v| of the exact one (at most eps of each row's mass is dropped)."""
    torch.manual_seed(0)
    B, T, H, D = 1, 700, 2, 32
    q, k, v = (torch.randn(B, T, H, D, device=device) * 0.3 for _ in range(3))
    # a slow gate and a loose tolerance, so that the skipped keys (bias about -11 to -14) still
    # carry mass that shows in float32 while the early key tiles get pruned
    log_fgate = torch.full((B, T, H), -0.03, device=device)
    eps = 0.1
    threshold = forgetting_transformer.pruning_threshold(q, k, eps)
    assert threshold < math.log(eps)
    exact = forgetting_transformer.forgetting_attention(q, k, v, log_fgate)
    pruned = forgetting_transformer.forgetting_attention(q, k, v, log_fgate, adaptive_threshold=threshold)
    assert not torch.equal(pruned, exact)  # tiles were really skipped
    assert (pruned - exact).abs().max().item() <= 2 * eps * v.abs().max().item()
    with pytest.raises(ValueError, match="tolerance"):
        forgetting_transformer.pruning_threshold(q, k, 0.0)


@pytest.mark.parametrize("dtype,D", [(torch.float32, 32), (torch.bfloat16, 64), (torch.bfloat16, 128)])
def test_pruned_tiles_are_not_computed(device, dtype, D):
    """Pruning really skips work: keys poisoned with NaN far in the past of fast-forgetting heads
    reach every later row without pruning (0 * NaN), and no row whose tiles with them are pruned
    (forward and dQ; every kernel: generic, tensor-core and the CPU one)."""
    if device == "cpu" and dtype != torch.float32:
        pytest.skip("one CPU case is enough")
    torch.manual_seed(0)
    B, T, H = 1, 2048, 2
    q, k, v = (torch.randn(B, T, H, D, device=device, dtype=dtype) for _ in range(3))
    k[:, :256] = float("nan")
    v[:, :256] = float("nan")
    log_fgate = torch.full((B, T, H), -1.0, device=device)  # bias -(i - j)
    far = slice(1024, None)  # rows at least ~500 positions past every poisoned tile

    def run(threshold):
        qq, kk, vv, gg = (x.clone().requires_grad_() for x in (q, k, v, log_fgate))
        out = forgetting_transformer.forgetting_attention(qq, kk, vv, gg, adaptive_threshold=threshold)
        out[:, far].float().sum().backward()
        return out.detach(), qq.grad

    out, dq = run(None)
    assert out[:, far].isnan().any() and dq[:, far].isnan().any()  # the poison does reach them
    out, dq = run(-30.0)
    assert torch.isfinite(out[:, far]).all()
    assert torch.isfinite(dq[:, far]).all()


@pytest.mark.parametrize("dtype,D", [(torch.float32, 32), (torch.bfloat16, 64), (torch.bfloat16, 128)])
def test_pruned_tiles_are_not_computed_dkdv(device, dtype, D):
    """The dK/dV pass skips pruned tiles too: output gradients poisoned with NaN far after the
    first keys reach dK and dV of those keys without pruning (their probabilities underflow to 0,
    but 0 * NaN is NaN), and not with it."""
    if device == "cpu" and dtype != torch.float32:
        pytest.skip("one CPU case is enough")
    torch.manual_seed(0)
    B, T, H = 1, 2048, 2
    q, k, v = (torch.randn(B, T, H, D, device=device, dtype=dtype) for _ in range(3))
    log_fgate = torch.full((B, T, H), -1.0, device=device)
    grad_out = torch.randn_like(q)
    grad_out[:, 1024:] = float("nan")
    near = slice(0, 256)  # keys at least ~700 positions before every poisoned row

    def run(threshold):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        out = forgetting_transformer.forgetting_attention(qq, kk, vv, log_fgate, adaptive_threshold=threshold)
        return torch.autograd.grad(out, (kk, vv), grad_out)

    dk, dv = run(None)
    assert dk[:, near].isnan().any() and dv[:, near].isnan().any()  # the poison does reach them
    dk, dv = run(-30.0)
    assert torch.isfinite(dk[:, near]).all() and torch.isfinite(dv[:, near]).all()
