"""The decoding path of the op on CUDA (seqlen_q <= 16, fp16/bf16, head dim 64/128: decode.cuh):
the query heads of a KV group packed into one tile, the cache split into chunks whose gate sums
the combine kernel carries, per-row cache lengths (cache_seqlens) and left padding (seq_start).

Every case is compared with the float64 formula by the 2x rule (reference.py); rows of a batch
with different lengths are compared with the formula on each row's own keys.
"""
import pytest
import torch

import forgetting_transformer  # noqa: F401  (loads the ops)

from conftest import HAS_CUDA, make_inputs
from reference import forward_backward, naive_attention, rule_violations

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")]

fwd = torch.ops.fox.forgetting_attention_fwd
op = torch.ops.fox.forgetting_attention


def reference_rows(q, k, v, g, *, seq_start=None, cache_seqlens=None, dtype=torch.float64):
    """The formula row by row: row b sees keys [0, cache_seqlens[b]) (all when None)."""
    outs = []
    for b in range(q.shape[0]):
        n = k.shape[1] if cache_seqlens is None else int(cache_seqlens[b])
        start = None if seq_start is None else seq_start[b:b + 1]
        outs.append(naive_attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], g[b:b + 1, :n],
                                    seq_start=start, dtype=dtype))
    return torch.cat(outs)


@pytest.fixture(params=["single", "paired"])
def blocks(request, monkeypatch):
    """Both block forms of the decoding kernel (FOX_DECODE_PAIRED, read at each call): paired
    blocks, two groups of warps each taking half of a chunk, are planned where a grid has at most
    one block an SM."""
    monkeypatch.setenv("FOX_DECODE_PAIRED", "1" if request.param == "paired" else "0")
    return request.param


def check_forward(q, k, v, g, *, seq_start=None, cache_seqlens=None):
    extra = () if cache_seqlens is None else (None, None, None, cache_seqlens)
    out, lse = fwd(q, k, v, g, seq_start, *extra)
    ref = reference_rows(q.double(), k.double(), v.double(), g.double(), seq_start=seq_start,
                         cache_seqlens=cache_seqlens)
    naive = reference_rows(q, k, v, g.float(), seq_start=seq_start, cache_seqlens=cache_seqlens,
                           dtype=q.dtype)
    problems = rule_violations(["out"], [out], [ref], [naive], q.dtype)
    assert not problems, f"q {tuple(q.shape)} k {tuple(k.shape)}: " + "; ".join(problems)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H,Hkv", [(4, 4), (8, 2), (32, 1), (6, 2)])
@pytest.mark.parametrize("Tq", [1, 3, 16])
def test_packed_heads(blocks, dtype, D, H, Hkv, Tq):
    # 32 query heads of one KV head (MQA) with 16 queries: 512 packed rows in 32 row tiles.
    for Tk in (Tq, 100, 3000):
        q, k, v, g = make_inputs(2, Tq, Tk, H, Hkv, D, dtype=dtype, device="cuda",
                                 regime="mixed")
        check_forward(q, k, v, g)


@pytest.mark.parametrize("D", [64, 128])
def test_default_plan_of_a_short_mha_cache(D):
    # B=8 x 12 heads: 96 unsplit blocks, between half of an H100's SMs and all of them, so the
    # planner pairs them (each group of warps a half of the cache, merged in the block).
    q, k, v, g = make_inputs(8, 1, 2048, 12, 12, D, dtype=torch.bfloat16, device="cuda",
                             regime="mixed")
    check_forward(q, k, v, g)
    check_forward(q, k, v, g, cache_seqlens=torch.tensor([2048, 1, 63, 64, 65, 1000, 1500, 129],
                                                         device="cuda"))


@pytest.mark.parametrize("regime", ["zero", "tiny", "normal", "strong", "mixed"])
def test_gate_regimes(regime):
    q, k, v, g = make_inputs(1, 1, 20000, 16, 4, 128, dtype=torch.bfloat16, device="cuda",
                             regime=regime)
    check_forward(q, k, v, g)


def test_many_chunks_long_cache(blocks):
    # One sequence, one KV head: the planner cuts 200k keys into as many chunks as it allows; the
    # bias of nearby keys must survive the carry over all of them (mixed: fast-forgetting heads).
    q, k, v, g = make_inputs(1, 2, 200_000, 8, 1, 64, dtype=torch.bfloat16, device="cuda",
                             regime="mixed")
    check_forward(q, k, v, g)


@pytest.mark.parametrize("Tq", [1, 4, 16])
def test_cache_seqlens_and_seq_start(blocks, Tq):
    B, Tk = 6, 5000
    q, k, v, g = make_inputs(B, Tq, Tk, 8, 2, 128, dtype=torch.bfloat16, device="cuda",
                             regime="mixed")
    lengths = torch.tensor([Tk, Tq, 17, 64, 1000, 4097], device="cuda")
    starts = torch.tensor([0, 0, 3, 63, 900, 4096 - Tq], device="cuda")
    check_forward(q, k, v, g, cache_seqlens=lengths)
    check_forward(q, k, v, g, cache_seqlens=lengths, seq_start=starts)
    # Keys past a row's length do not matter: garbage there changes nothing, bit for bit.
    out, _ = fwd(q, k, v, g, starts, None, None, None, lengths)
    k2, v2, g2 = k.clone(), v.clone(), g.clone()
    for b, n in enumerate(lengths.tolist()):
        k2[b, n:] = 1e4
        v2[b, n:] = float("nan")
        g2[b, n:] = -1e4
    out2, _ = fwd(q, k2, v2, g2, starts, None, None, None, lengths)
    assert torch.equal(out, out2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [16, 80, 96, 200, 256])
@pytest.mark.parametrize("Tq", [1, 5])
def test_other_head_dims(dtype, D, Tq):
    # Head dims other than 64/128 (and float32) decode through the generic split-KV kernels:
    # correct for any D <= 256, with GQA, per-row lengths and left padding.
    B, Tk = 3, 3000
    q, k, v, g = make_inputs(B, Tq, Tk, 6, 2, D, dtype=dtype, device="cuda", regime="mixed")
    lengths = torch.tensor([Tk, Tq + 7, 1500], device="cuda")
    starts = torch.tensor([0, 2, 1000], device="cuda")
    check_forward(q, k, v, g)
    check_forward(q, k, v, g, cache_seqlens=lengths, seq_start=starts)


def test_rows_inside_the_padding_are_zero():
    q, k, v, g = make_inputs(2, 4, 300, 4, 2, 64, dtype=torch.float16, device="cuda")
    starts = torch.tensor([298, 0], device="cuda")  # row 0: queries 296, 297 see no key
    out, lse = check_forward(q, k, v, g, seq_start=starts)
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2]))
    assert torch.isinf(lse[0, :, :2]).all()


def test_lse_feeds_the_backward():
    # The decode forward's lse is what the backward kernels use: gradients by the 2x rule.
    dtype = torch.bfloat16
    q, k, v, g = make_inputs(2, 3, 4000, 8, 2, 64, dtype=dtype, device="cuda", regime="mixed")
    grad_out = torch.randn(q.shape, device="cuda")
    inputs = (q, k, v, g)
    out, grads = forward_backward(lambda *x: op(*x), inputs, grad_out.to(dtype))
    ref, ref_grads = forward_backward(lambda *x: naive_attention(*x), [x.double() for x in inputs],
                                      grad_out.double())
    naive, naive_grads = forward_backward(lambda *x: naive_attention(*x, dtype=dtype), inputs,
                                          grad_out.to(dtype))
    names = ("out", "dq", "dk", "dv", "dlog_fgate")
    problems = rule_violations(names, [out] + grads, [ref] + ref_grads, [naive] + naive_grads,
                               dtype)
    assert not problems, "; ".join(problems)


def test_strided_inputs_and_head_first():
    # q, k, v as slices of fused projections (row strides > H * D), gates head-first.
    B, Tk, H, Hkv, D = 3, 2500, 8, 4, 64
    qkv = torch.randn(B, Tk, H + 2 * Hkv, D, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, -1:, :H]
    k, v = qkv[:, :, H:H + Hkv], qkv[:, :, H + Hkv:]
    g = make_inputs(B, 1, Tk, H, Hkv, D, device="cuda", regime="mixed")[3]
    g_head_first = g.transpose(1, 2).contiguous().transpose(1, 2)  # (B, Tk, H), strided
    out_strided = check_forward(q, k, v, g_head_first)[0]
    out_contig = fwd(q.contiguous(), k.contiguous(), v.contiguous(), g)[0]
    assert torch.equal(out_strided, out_contig)


@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("H,Hkv", [(32, 4), (12, 4), (16, 1), (5, 5)])
@pytest.mark.parametrize("layout", ["heads_fastest", "wide_rows", "head_first"])
@pytest.mark.parametrize("D", [64, 128])
def test_gate_layouts(blocks, H, Hkv, layout, D, gate_dtype):
    # The gate loader's walks: heads fastest (groups of 8, 3 and 16 heads, so slots wrap to the
    # next key at different steps; one head: keys fastest), rows wider than the heads, head-first;
    # float32 gates by cp.async, float16 ones through registers. B=1 with few KV heads and a long
    # cache: the most chunks, merged by the combine kernel. The reference reads the same gates.
    B, Tk = 1, 70_000
    q, k, v, g = make_inputs(B, 2, Tk, H, Hkv, D, dtype=torch.bfloat16, device="cuda",
                             regime="mixed")
    g = g.to(gate_dtype)
    if layout == "wide_rows":
        wide = torch.full((B, Tk, H + 3), float("nan"), device="cuda", dtype=gate_dtype)
        wide[..., 1:H + 1] = g
        g = wide[..., 1:H + 1]
    elif layout == "head_first":
        g = g.transpose(1, 2).contiguous().transpose(1, 2)
    check_forward(q, k, v, g)
    check_forward(q[:, -1:], k, v, g, cache_seqlens=torch.tensor([Tk - 1], device="cuda"))


@pytest.mark.parametrize("Tq", [1, 3, 8])
def test_float16_gates_are_the_float32_gates_they_hold(Tq):
    # float16 gates give what float32 gates of the same values give (the kernel sums in float32),
    # with per-row lengths and left padding; the backward converts them and returns float16.
    # Tq 1 and 8: read as float16, two heads a copy (row tiles start at even heads); Tq 3: a tile
    # starts at head 5, so the gates go in as float32.
    B, Tk = 3, 9000
    q, k, v, g = make_inputs(B, Tq, Tk, 32, 4, 64, dtype=torch.bfloat16, device="cuda",
                             regime="mixed")
    g16 = g.half()
    lengths = torch.tensor([Tk, Tq + 5, 4097], device="cuda")
    starts = torch.tensor([0, 1, 300], device="cuda")
    out16, lse16 = fwd(q, k, v, g16, starts, None, None, None, lengths)
    out32, lse32 = fwd(q, k, v, g16.float(), starts, None, None, None, lengths)
    assert torch.equal(out16, out32) and torch.equal(lse16, lse32)
    check_forward(q, k, v, g16, seq_start=starts, cache_seqlens=lengths)
    qg, kg, vg, gg = (x.clone().requires_grad_() for x in (q, k, v, g16))
    op(qg, kg, vg, gg).sum().backward()
    g32 = g16.float().requires_grad_()
    op(q, k, v, g32).sum().backward()
    assert gg.grad.dtype == torch.float16
    assert torch.equal(gg.grad, g32.grad.half())


def test_deterministic(blocks):
    q, k, v, g = make_inputs(1, 1, 50_000, 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    a = fwd(q, k, v, g)
    b = fwd(q, k, v, g)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_cuda_graph_replay_with_new_lengths(blocks):
    # A captured decode step reads cache_seqlens from device memory: a replay after the lengths
    # changed in place equals an eager call with the new lengths, bit for bit.
    B, Tk, H, Hkv, D = 4, 8192, 16, 4, 128
    q, k, v, g = make_inputs(B, 1, Tk, H, Hkv, D, dtype=torch.bfloat16, device="cuda")
    lengths = torch.tensor([100, 2000, 8192, 5], device="cuda")
    fwd(q, k, v, g, None, None, None, None, lengths)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            out, lse = fwd(q, k, v, g, None, None, None, None, lengths)
    torch.cuda.current_stream().wait_stream(stream)
    for new in ([101, 2001, 8000, 6], [8192, 1, 4096, 3000]):
        lengths.copy_(torch.tensor(new))
        graph.replay()
        eager = fwd(q, k, v, g, None, None, None, None, lengths)
        assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])


@pytest.mark.parametrize("splits", [2, 3, 8, 16, 17])
@pytest.mark.parametrize("H,Hkv,Tq,D", [(8, 8, 1, 128), (32, 4, 1, 64), (8, 2, 16, 128)])
def test_forced_splits_with_empty_chunks(monkeypatch, blocks, splits, H, Hkv, Tq, D):
    # The cache cut into a given number of chunks (FOX_DECODE_SPLITS, read at each call), with
    # rows too short to give every chunk a key: the empty chunks must weigh nothing in the merge.
    monkeypatch.setenv("FOX_DECODE_SPLITS", str(splits))
    B, Tk = 3, 5000
    q, k, v, g = make_inputs(B, Tq, Tk, H, Hkv, D, dtype=torch.bfloat16, device="cuda",
                             regime="mixed")
    check_forward(q, k, v, g, cache_seqlens=torch.tensor([Tk, 700, Tq], device="cuda"))
