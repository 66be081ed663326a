"""fox::nn::functional, the fused functions the modules are built from (RMSNorm, KV-shift mix,
gates, cross entropy, the MLP product and the LM loss that recompute in the backward, and the
inference paths: few-row linear, residual add + norm): forward and backward against float64
formulas with the 2x rule, on inputs that are slices of a wider tensor (as the model passes
them), on CPU (the ATen formulas) and on CUDA (the fused kernels)."""
import pytest
import torch
import torch.nn.functional as F

from forgetting_transformer import nn as fnn
from reference import forward_backward, rule_violations

fused = fnn.functional

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---- float formulas in a chosen compute dtype (float64: the reference) -----------------------------

def ref_rms_norm(x, w, group, eps, cd):
    shape = x.shape
    xf = x.to(cd).reshape(*shape[:-1], shape[-1] // group, group)
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).reshape(shape)
    return y * w.to(cd)


def ref_shift_mix(cur, logits, first, cd):
    B, T, C = cur.shape
    H = logits.shape[-1]
    a = torch.sigmoid(logits.to(cd))[..., None]
    row0 = first[:, None] if first is not None else torch.zeros(B, 1, C, dtype=cur.dtype, device=cur.device)
    prev = torch.cat([row0.to(cur.dtype), cur[:, :-1]], 1)
    mixed = a * prev.reshape(B, T, H, -1).to(cd) + (1 - a) * cur.reshape(B, T, H, -1).to(cd)
    return mixed.reshape(B, T, C)


def ref_gated(g, u, act, cd):
    gf = g.to(cd)
    return (F.silu(gf) if act != "sigmoid" else torch.sigmoid(gf)) * u.to(cd)


def check(fn, ref, inputs, dtype, grad_out, names):
    """got = fn in dtype; ref = ref(float64) on the same rounded inputs; naive = ref in float32
    math rounded to dtype (what the unfused formula gives)."""
    got_out, got_grads = forward_backward(fn, inputs, grad_out)
    ref_out, ref_grads = forward_backward(lambda *xs: ref(*xs, cd=torch.float64),
                                          [x.double() for x in inputs], grad_out.double())
    naive_out, naive_grads = forward_backward(lambda *xs: ref(*xs, cd=torch.float32).to(dtype),
                                              inputs, grad_out)
    assert got_out.dtype == dtype
    problems = rule_violations(["out"] + names, [got_out] + got_grads, [ref_out] + ref_grads,
                               [naive_out] + naive_grads, dtype)
    assert not problems, problems


# ---- tests -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [64, 96, 192])
@pytest.mark.parametrize("offset", [0, 5])  # 16-byte aligned rows (wide loads) or not
@pytest.mark.parametrize("T", [37, 3001])  # one block's rows or a few; many blocks, long walks
def test_rms_norm(device, dtype, group, offset, T):
    B, C = 2, 192
    wide = torch.randn(B, T, C + 40, device=device).to(dtype)  # x is a slice: row stride C + 40
    w = (1 + 0.3 * torch.randn(C, device=device))
    check(lambda xw, w: fused.rms_norm(xw[..., offset:offset + C], w, group, 1e-5),
          lambda xw, w, cd: ref_rms_norm(xw[..., offset:offset + C], w, group, 1e-5, cd),
          [wide, w], dtype, torch.randn(B, T, C, device=device), ["dx", "dweight"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("offset", [0, 5])
def test_rms_norm_input_gradient_alone(device, dtype, weighted, offset):
    """x's gradient without the weight's (no weight, or one that needs no gradient): on CUDA the
    backward's blocks then take one step each, 16-bit rows two block rows a thread, no walk."""
    B, T, C, group = 2, 3001, 192, 64
    wide = torch.randn(B, T, C + 40, device=device).to(dtype)
    w = 1 + 0.3 * torch.randn(C, device=device) if weighted else None
    w_ref = w if weighted else torch.ones(C, device=device)
    check(lambda xw: fused.rms_norm(xw[..., offset:offset + C], w, group, 1e-5),
          lambda xw, cd: ref_rms_norm(xw[..., offset:offset + C], w_ref, group, 1e-5, cd),
          [wide], dtype, torch.randn(B, T, C, device=device), ["dx"])


def test_rms_norm_without_weight_and_autocast_dtype(device):
    x = torch.randn(3, 5, 64, device=device)
    y = fused.rms_norm(x, None, 32, 1e-6)
    torch.testing.assert_close(y, ref_rms_norm(x, torch.ones(64, device=device), 32, 1e-6, torch.float32))
    with torch.autocast(device, dtype=torch.bfloat16):
        assert fused.rms_norm(x, None, 64, 1e-6).dtype == torch.bfloat16  # float32 in: autocast out
        assert fused.rms_norm(x.half(), None, 64, 1e-6).dtype == torch.float16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_first", [False, True])
@pytest.mark.parametrize("extra", [7, 61])  # row stride C + 10 (2-element loads) or C + 64 (16-byte)
@pytest.mark.parametrize("T", [29, 1002])  # a sequence's last chunk of positions short; many blocks
def test_shift_mix(device, dtype, with_first, extra, T):
    B, H, D = 2, 3, 64
    C = H * D
    wide = torch.randn(B, T, C + H + extra, device=device).to(dtype)  # [cur | logits | other]
    first = torch.randn(B, C, device=device).to(dtype) if with_first else None

    def fn(wide, *rest):
        return fused.shift_mix(wide[..., :C], wide[..., C:C + H], rest[0] if rest else None)

    def ref(wide, *rest, cd):
        return ref_shift_mix(wide[..., :C], wide[..., C:C + H], rest[0] if rest else None, cd)

    inputs = [wide] + ([first] if with_first else [])
    check(fn, ref, inputs, dtype, torch.randn(B, T, C, device=device),
          ["dwide"] + (["dfirst"] if with_first else []))


def test_shift_mix_single_token_with_state(device):
    """Decoding: T = 1, the previous token's projection from the cache."""
    cur, logits, first = (torch.randn(2, 1, 8, device=device), torch.randn(2, 1, 2, device=device),
                          torch.randn(2, 8, device=device))
    torch.testing.assert_close(fused.shift_mix(cur, logits, first),
                               ref_shift_mix(cur, logits, first, torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", ["float32", "same", None])  # a float32 parameter under autocast
def test_log_forget_gate(device, dtype, bias, monkeypatch):
    """log f = logsigmoid(logits + bias), the logits a slice of a wider projection (as the
    attention layer passes them), some far in the tails: the output (float32) and the gradients
    of the projection and of the bias by the 2x rule against float64, the naive side being the
    composition (FOX_FUSED_FORGET_GATE=0: the bias cast to the logits' dtype, added, cast up,
    log-sigmoid); and, fused, the output within one float32 ulp of the exact log-sigmoid of the
    sum as the composition rounds it (the kernel evaluates it in float64 and rounds once)."""
    B, T, H = 2, 37, 5
    wide = 3 * torch.randn(B, T, 40 + H, device=device)
    wide[0, :4, 40:] = torch.tensor([-90.0, -20.0, 30.0, 90.0], device=device)[:, None]
    wide = wide.to(dtype)
    inputs = [wide]
    if bias is not None:
        inputs.append(torch.randn(H, device=device).to(torch.float32 if bias == "float32" else dtype))

    def fn(wide, *b):
        return fused.log_forget_gate(wide[..., 40:], b[0] if b else None)

    def ref(wide, *b):  # float64: no rounding of the sum
        z = wide[..., 40:] + (b[0] if b else 0)
        return F.logsigmoid(z)

    grad_out = torch.randn(B, T, H, device=device)
    got_out, got_grads = forward_backward(fn, inputs, grad_out)
    ref_out, ref_grads = forward_backward(ref, [x.double() for x in inputs], grad_out.double())
    monkeypatch.setenv("FOX_FUSED_FORGET_GATE", "0")
    naive_out, naive_grads = forward_backward(fn, inputs, grad_out)
    monkeypatch.delenv("FOX_FUSED_FORGET_GATE")
    assert got_out.dtype == torch.float32 and naive_out.dtype == torch.float32
    names = ["dlogits"] + (["dbias"] if bias is not None else [])
    problems = rule_violations(["out"], [got_out], [ref_out], [naive_out], torch.float32)
    problems += rule_violations(names, got_grads, ref_grads, naive_grads, dtype)
    assert not problems, problems
    if device == "cuda":
        # The sum rounded as the composition rounds it, then the log-sigmoid exactly (results
        # below float32's normal range may flush to zero).
        summed = wide[..., 40:] + (inputs[1].to(dtype) if bias is not None else 0)
        exact = F.logsigmoid(summed.double())
        f32 = torch.finfo(torch.float32)
        assert ((got_out.double() - exact).abs() <= f32.eps * exact.abs() + f32.tiny).all()


# ---- the inference paths: few-row linear, residual add + norm, KV-shift with the state --------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 9])  # up to 8: the matrix-vector kernel; 9: F.linear
@pytest.mark.parametrize("n,k", [(1, 8), (67, 72), (1000, 768), (129, 2056)])
@pytest.mark.parametrize("with_bias,with_residual", [(False, False), (True, False), (True, True)])
@torch.no_grad()
def test_linear(device, dtype, rows, n, k, with_bias, with_residual):
    """x is a slice of a wider tensor (rows 16-byte aligned but not contiguous), as a decoding
    step's projection inputs are; bias and residual of x's dtype."""
    wide = torch.randn(rows, k + 24, device=device).to(dtype)
    x = wide[:, 8:8 + k]
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if with_bias else None
    r = torch.randn(rows, n, device=device).to(dtype) if with_residual else None

    def formula(x, w, b, r, cd):
        y = F.linear(x.to(cd), w.to(cd), None if b is None else b.to(cd))
        return y if r is None else y + r.to(cd)

    got = fused.linear(x, w, b, r)
    ref = formula(x, w, b, r, torch.float64)
    naive = F.linear(x, w, b) + (0 if r is None else r)  # what the unfused modules give
    assert got.dtype == dtype and got.shape == (rows, n)
    problems = rule_violations(["y"], [got], [ref], [naive], dtype)
    assert not problems, problems
    # Leading dimensions are kept; the matrix-vector kernel (CUDA, fp16/bf16, <= 8 rows) sums in
    # a fixed order, so its result does not depend on the call's shape.
    got3 = fused.linear(x.reshape(rows, 1, k), w, b, None if r is None else r.reshape(rows, 1, n))
    assert got3.shape == (rows, 1, n)
    if device == "cuda" and dtype != torch.float32 and rows <= 8:
        assert torch.equal(got3.reshape(rows, n), got)
    else:  # F.linear: cuBLAS may pick another algorithm for another shape
        assert not rule_violations(["y3"], [got3.reshape(rows, n)], [ref], [naive], dtype)


def test_linear_with_autograd_is_f_linear(device):
    x = torch.randn(2, 64, device=device, requires_grad=True)
    w = torch.randn(32, 64, device=device, requires_grad=True)
    r = torch.randn(2, 32, device=device)
    fused.linear(x, w, None, r).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    (F.linear(x2, w2) + r).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_add_rms_norm(device, dtype, rows):
    """The sum is x + delta rounded to x's dtype and the norm is rms_norm of that sum: bitwise the
    two separate steps, with or without autograd."""
    C = 192
    x, d = (torch.randn(rows, C, device=device).to(dtype), torch.randn(rows, C, device=device).to(dtype))
    w = (1 + 0.3 * torch.randn(C, device=device)).to(dtype)
    with torch.no_grad():
        total, normed = fused.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(total, x + d)
    assert torch.equal(normed, fused.rms_norm(x + d, w, C, 1e-6))
    xg = x.clone().requires_grad_(True)
    total_g, normed_g = fused.add_rms_norm(xg, d, w, 1e-6)
    assert torch.equal(total_g.detach(), total) and torch.equal(normed_g.detach(), normed)
    normed_g.float().sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()


@pytest.mark.parametrize("x_dtype,d_dtype,autocast", [
    (torch.float32, torch.bfloat16, True),   # a training step: float32 stream, bf16 branch
    (torch.float32, torch.float16, True),
    (torch.float32, torch.float32, True),
    (torch.float32, torch.float32, False),
    (torch.bfloat16, torch.bfloat16, False),
])
def test_add_rms_norm_with_autograd_is_the_separate_steps(device, x_dtype, d_dtype, autocast):
    """With autograd (CUDA: one fused function each way): the sum, the norm and the gradients of
    x, delta and the weight are bitwise those of the add, the cast and rms_norm as separate
    autograd steps, with gradients arriving through both the sum and the norm."""
    if device == "cpu" and autocast and torch.float16 in (x_dtype, d_dtype):
        pytest.skip("float16 autocast is a CUDA mode")
    B, T, C = 3, 50, 192
    x = torch.randn(B, T, C, device=device).to(x_dtype)
    wide = torch.randn(B, T, C + 64, device=device).to(d_dtype)  # delta: a slice, as o_proj's
    w = 1 + 0.3 * torch.randn(C, device=device)
    g_sum, g_norm = torch.randn(B, T, C, device=device), torch.randn(B, T, C, device=device)
    amp_dtype = d_dtype if d_dtype != torch.float32 else torch.bfloat16

    def run(fused_path):
        xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        wd = wide.clone().requires_grad_(True)
        d = wd[..., :C]
        with torch.autocast(device, dtype=amp_dtype, enabled=autocast):
            if fused_path:
                total, normed = fused.add_rms_norm(xs, d, ws, 1e-6)
            else:
                total = xs + d.to(torch.promote_types(x_dtype, d_dtype))
                normed = fused.rms_norm(total, ws, C, 1e-6)
        ((total.float() * g_sum).sum() + (normed.float() * g_norm).sum()).backward()
        return total, normed, xs.grad, wd.grad, ws.grad

    got, expected = run(True), run(False)
    for name, a, b in zip(["sum", "norm", "dx", "ddelta", "dweight"], got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3])
@torch.no_grad()
def test_shift_mix_update(device, dtype, T):
    """Equals shift_mix against the state, and leaves the last token's projection in the state."""
    B, H, D = 3, 2, 64
    C = H * D
    wide = torch.randn(B, T, C + H + 8, device=device).to(dtype)  # [cur | logits | other]
    cur, logits = wide[..., :C], wide[..., C:C + H]
    state = torch.randn(B, C, device=device).to(dtype)
    expected = fused.shift_mix(cur, logits, state.clone())
    out = fused.shift_mix_update(cur, logits, state)
    assert torch.equal(out, expected)
    assert torch.equal(state, cur[:, -1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 50277), (5, 1), (3, 8193), (2, 3, 100)])
def test_argmax(device, dtype, shape):
    """torch.argmax's index, ties (the first) and NaN (counts as the largest) included."""
    x = torch.randn(shape, device=device).to(dtype)
    assert torch.equal(fused.argmax(x), x.argmax(-1))
    flat = x.reshape(-1, shape[-1])
    flat[:, -1] = flat.max(-1).values  # a tie with an earlier maximum: the earlier one wins
    assert torch.equal(fused.argmax(x), x.argmax(-1))
    if shape[-1] > 3:
        flat[0, 2] = float("nan")
        assert torch.equal(fused.argmax(x), x.argmax(-1))
    wide = torch.randn(4, shape[-1] + 3, device=device).to(dtype)  # rows with a stride
    assert torch.equal(fused.argmax(wide[:, 1:1 + shape[-1]]), wide[:, 1:1 + shape[-1]].argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["swish", "sigmoid"])
def test_gated(device, dtype, act):
    N, C = 67, 160
    gu = torch.randn(N, 2 * C, device=device).to(dtype)  # SwiGLU: the two halves of one projection
    check(lambda gu: fused.gated(gu[:, :C], gu[:, C:], act),
          lambda gu, cd: ref_gated(gu[:, :C], gu[:, C:], act, cd),
          [gu], dtype, torch.randn(N, C, device=device), ["dgate_up"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [1000, 1001])  # 16-byte loads where rows allow them; one per logit
@pytest.mark.parametrize("row_pad", [0, 23])  # 1001 of rows of 1024: whole loads, then one logit
def test_cross_entropy(device, dtype, V, row_pad):
    B, T = 3, 41
    logits = (3 * torch.randn(B, T, V + row_pad, device=device)).to(dtype)[..., :V]
    labels = torch.randint(0, V, (B, T), device=device)
    labels[0, :5] = -100

    def ref(logits, cd):
        out = F.cross_entropy(logits.to(cd).flatten(0, 1), labels.flatten(), reduction="none",
                              ignore_index=-100)
        return out.view(B, T)

    g = torch.rand(B, T, device=device)
    got, got_grads = forward_backward(lambda lg: fused.cross_entropy(lg, labels), [logits], g)
    assert got.dtype == torch.float32 and got_grads[0].dtype == dtype
    assert (got[0, :5] == 0).all() and (got_grads[0][0, :5] == 0).all()
    ref_out, ref_grads = forward_backward(lambda lg: ref(lg, torch.float64), [logits.double()], g.double())
    naive_out, naive_grads = forward_backward(lambda lg: ref(lg, torch.float32), [logits], g)
    naive_grads = [x.to(dtype) for x in naive_grads]
    problems = rule_violations(["loss", "dlogits"], [got] + got_grads, [ref_out] + ref_grads,
                               [naive_out] + naive_grads, dtype)
    assert not problems, problems


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, "autocast_bf16"])
@pytest.mark.parametrize("with_bias,with_residual", [(False, False), (True, True)])
@pytest.mark.parametrize("split", [False, True], ids=["gate_value", "split"])
def test_gated_linear_is_the_composition(device, dtype, with_bias, with_residual, split):
    """gated_linear keeps gate, value and weight, not the product, and computes the product again
    in the backward: the output and every gradient bitwise those of linear(gated(...), ...),
    under bf16 autocast too (float32 weight, residual and gate/value). split_gated_linear takes
    gate and value as the halves of one tensor (its gradient comes back as one): the same bits."""
    autocast = dtype == "autocast_bf16"
    dt = torch.float32 if autocast else dtype
    N, C, O = 37, 96, 40
    gu = torch.randn(N, 2 * C, device=device).to(dt)
    w = (torch.randn(O, C, device=device) / C**0.5).to(dt)
    b = torch.randn(O, device=device).to(dt) if with_bias else None
    r = torch.randn(N, O, device=device).to(dt) if with_residual else None
    inputs = [t for t in (gu, w, b, r) if t is not None]

    def unpack(xs):
        xs = list(xs)
        gu, w = xs.pop(0), xs.pop(0)
        return gu, w, xs.pop(0) if with_bias else None, xs.pop(0) if with_residual else None

    def composed(*xs):
        gu, w, b, r = unpack(xs)
        return fused.linear(fused.gated(gu[:, :C], gu[:, C:], "swish"), w, b, r)

    def recomputed(*xs):
        gu, w, b, r = unpack(xs)
        if split:
            return fused.split_gated_linear(gu, "swish", w, b, r)
        return fused.gated_linear(gu[:, :C], gu[:, C:], "swish", w, b, r)

    g = torch.randn(N, O, device=device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        out, grads = forward_backward(composed, inputs, g)
        out_r, grads_r = forward_backward(recomputed, inputs, g)
        with torch.no_grad():
            assert torch.equal(recomputed(*inputs), composed(*inputs))
    assert torch.equal(out, out_r)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_r))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("fn", ["linear", "gated_linear", "split_gated_linear"])
def test_float32_weight_gradient_under_autocast(fn):
    """Under bf16 autocast a float32 weight's gradient comes from the GEMM in float32 (bf16
    operands, float32 output), where autocast's composition makes it in bf16 and casts it up: the
    output and the input's gradient bitwise the composition's, the weight's gradient that GEMM's
    bit for bit and closer to float64 than the composition's."""
    g = torch.Generator(device="cuda").manual_seed(7)
    N, C, O = 300, 96, 40
    gu = torch.randn(N, 2 * C, device="cuda", generator=g)
    w = torch.randn(O, C, device="cuda", generator=g) / C**0.5
    dy = torch.randn(N, O, device="cuda", generator=g)

    def product(gu):  # what the weight multiplies
        return gu[:, :C] if fn == "linear" else fused.gated(gu[:, :C], gu[:, C:], "swish")

    def ours(gu, w):
        if fn == "linear":
            return fused.linear(gu[:, :C], w)
        if fn == "gated_linear":
            return fused.gated_linear(gu[:, :C], gu[:, C:], "swish", w)
        return fused.split_gated_linear(gu.bfloat16(), "swish", w)

    def composition(gu, w):
        return F.linear(product(gu.bfloat16() if fn == "split_gated_linear" else gu), w)

    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, (dgu, dw) = forward_backward(ours, [gu, w], dy)
        out_c, (dgu_c, dw_c) = forward_backward(composition, [gu, w], dy)
        x = product(gu.bfloat16() if fn == "split_gated_linear" else gu).bfloat16()
    assert torch.equal(out, out_c) and torch.equal(dgu, dgu_c)
    assert dw.dtype == torch.float32
    assert torch.equal(dw, torch.mm(dy.bfloat16().t(), x, out_dtype=torch.float32))
    exact = dy.bfloat16().double().t() @ x.double()
    assert (dw - exact).abs().max() < (dw_c - exact).abs().max()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("reduction", ["none", "sum"])
@pytest.mark.parametrize("V", [1000, 1001])  # 1001: the weight cast into a padded copy
def test_loss_weight_gradient_in_float32_under_autocast(reduction, V):
    """The LM head loss under bf16 autocast makes a float32 weight's gradient in float32 (its
    chunks' GEMMs add up in float32 and the sum is no longer rounded to bf16): closer to the
    float64 gradient of the same bf16 operands than the composition's, which rounds it."""
    g = torch.Generator(device="cuda").manual_seed(8)
    N, C = 300, 64
    hidden = torch.randn(N, C, device="cuda", generator=g)
    w = torch.randn(V, C, device="cuda", generator=g) * 3 / C**0.5
    labels = torch.randint(0, V, (N,), device="cuda", generator=g)
    dloss = torch.rand(N, device="cuda", generator=g) + 0.5 if reduction == "none" else torch.ones((), device="cuda")

    def composition(h, w):
        return F.cross_entropy(F.linear(h, w).float(), labels, reduction=reduction)

    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, (_, dw) = forward_backward(
            lambda h, w: fused.linear_cross_entropy(h, w, labels, chunk_rows=128, reduction=reduction),
            [hidden, w], dloss)
        _, (_, dw_c) = forward_backward(composition, [hidden, w], dloss)
    h64, w64 = hidden.bfloat16().double(), w.bfloat16().double()
    d = torch.softmax(h64 @ w64.t(), -1) - F.one_hot(labels, V).double()
    exact = (d * dloss.double().reshape(-1, 1) if reduction == "none" else d).t() @ h64
    assert dw.dtype == torch.float32
    assert (dw - exact).abs().max() < (dw_c - exact).abs().max()


def loss_case(device, dtype, V=1000):
    """(hidden (3, 41, 64), weight (V, 64), labels (3, 41) with 6 ignored) of the loss tests."""
    B, T, C = 3, 41, 64
    hidden = torch.randn(B, T, C, device=device).to(dtype)
    weight = (torch.randn(V, C, device=device) * 3 / C**0.5).to(dtype)
    labels = torch.randint(0, V, (B, T), device=device)
    labels[0, :5] = -100
    labels[2, -1] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_rows", [0, 7, 200])  # 0: ~256 MiB chunks (one here)
@pytest.mark.parametrize("V", [1000, 1001])  # 1001: the CUDA path pads the weight to 1024 rows
def test_linear_cross_entropy(device, dtype, chunk_rows, V):
    """The LM head and loss in row chunks (123 rows: 7 gives 18 chunks, the last of 4), the logits
    made again in the backward: loss, d hidden and d weight by the 2x rule against float64, the
    whole-logits composition in dtype as the naive result; ignored labels give 0."""
    hidden, weight, labels = loss_case(device, dtype, V)
    g = torch.rand(labels.shape, device=device)

    def whole(h, w):
        return fused.cross_entropy(fused.linear(h, w), labels)

    got, got_grads = forward_backward(
        lambda h, w: fused.linear_cross_entropy(h, w, labels, chunk_rows=chunk_rows),
        [hidden, weight], g)
    assert got.dtype == torch.float32 and [x.dtype for x in got_grads] == [dtype, dtype]
    assert (got[labels == -100] == 0).all()
    ref, ref_grads = forward_backward(whole, [hidden.double(), weight.double()], g.double())
    naive, naive_grads = forward_backward(whole, [hidden, weight], g)
    problems = rule_violations(["loss", "dhidden", "dweight"], [got] + got_grads,
                               [ref] + ref_grads, [naive] + naive_grads, dtype)
    assert not problems, problems
    with torch.no_grad():  # without autograd: the composition
        assert torch.equal(fused.linear_cross_entropy(hidden, weight, labels, chunk_rows=7),
                           whole(hidden, weight))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_rows", [0, 7])
@pytest.mark.parametrize("needs", ["both", "hidden", "weight"])
@pytest.mark.parametrize("V", [1000, 1001])
def test_linear_cross_entropy_reduced(device, dtype, chunk_rows, reduction, needs, V):
    """The summed / mean loss, whose gradients the CUDA path makes in the forward (the backward
    scales them by the incoming scalar): loss, d hidden and d weight by the 2x rule against
    float64, the whole-logits composition in dtype as the naive result; only the gradients asked
    for are made; equal to the per-token loss reduced, up to the rounding of a sum."""
    hidden, weight, labels = loss_case(device, dtype, V)
    g = torch.tensor(0.37, device=device)
    valid = (labels != -100).sum()

    def whole(h, w):
        total = fused.cross_entropy(fused.linear(h, w), labels).sum()
        return total if reduction == "sum" else total / valid.to(total.dtype)

    def reduced(h, w):
        return fused.linear_cross_entropy(h, w, labels, chunk_rows=chunk_rows, reduction=reduction)

    got, got_grads = forward_backward(reduced, [hidden, weight], g)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert [x.dtype for x in got_grads] == [dtype, dtype]
    ref, ref_grads = forward_backward(whole, [hidden.double(), weight.double()], g.double())
    naive, naive_grads = forward_backward(whole, [hidden, weight], g)
    problems = rule_violations(["loss", "dhidden", "dweight"], [got] + got_grads,
                               [ref] + ref_grads, [naive] + naive_grads, dtype)
    assert not problems, problems
    per_token = fused.linear_cross_entropy(hidden, weight, labels, chunk_rows=chunk_rows)
    expected = per_token.sum() if reduction == "sum" else per_token.sum() / valid
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    # Only the gradients asked for: the other input is a constant.
    h = hidden.clone().requires_grad_(needs != "weight")
    w = weight.clone().requires_grad_(needs != "hidden")
    reduced(h, w).backward(g)
    for x, grad, name in ((h, got_grads[0], "hidden"), (w, got_grads[1], "weight")):
        if needs in ("both", name):
            assert torch.equal(x.grad, grad), name
        else:
            assert x.grad is None, name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("V", [1000, 1001])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("shape", [(2, 600), (1, 16)])  # a prefill's rows; a decoding step's
def test_logits(V, autocast, shape, monkeypatch):
    """The LM head's logits without autograd: from 9 rows an odd vocabulary multiplies a padded
    weight and copies the logits out. Contiguous, of F.linear's dtype, by the 2x rule against
    float64 with F.linear as the naive result (FOX_PAD_VOCAB=0 gives F.linear's bits)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    hidden = torch.randn(*shape, 64, device="cuda", generator=g)
    weight = torch.randn(V, 64, device="cuda", generator=g) / 8
    if not autocast:
        hidden, weight = hidden.bfloat16(), weight.bfloat16()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        got = fused.logits(hidden, weight)
        naive = F.linear(hidden, weight)
        monkeypatch.setenv("FOX_PAD_VOCAB", "0")
        assert torch.equal(fused.logits(hidden, weight), naive)
    assert got.is_contiguous() and got.dtype == naive.dtype == torch.bfloat16
    exact = hidden.bfloat16().double() @ weight.bfloat16().double().t()
    problems = rule_violations(["logits"], [got], [exact], [naive], torch.bfloat16)
    assert not problems, problems


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("V", [1000, 1001, 32768])  # 1001: rows not 16-byte aligned
def test_reduced_loss_bitwise_the_per_token_loss(V):
    """On CUDA the summed loss makes d logits in its forward where the per-token loss makes the
    logits again in its backward: with the same chunks and d loss = 1 the loss and both
    gradients are bitwise equal."""
    g = torch.Generator(device="cuda").manual_seed(3)
    hidden = torch.randn(2, 37, 64, device="cuda", generator=g).to(torch.bfloat16)
    weight = (torch.randn(V, 64, device="cuda", generator=g) / 4).to(torch.bfloat16)
    labels = torch.randint(0, V, (2, 37), device="cuda", generator=g)
    labels[1, :4] = -100
    per_token, per_token_grads = forward_backward(
        lambda h, w: fused.linear_cross_entropy(h, w, labels, chunk_rows=16),
        [hidden, weight], torch.ones(2, 37, device="cuda"))
    summed, summed_grads = forward_backward(
        lambda h, w: fused.linear_cross_entropy(h, w, labels, chunk_rows=16, reduction="sum"),
        [hidden, weight], torch.ones((), device="cuda"))
    assert torch.equal(summed, per_token.sum())
    for a, b in zip(summed_grads, per_token_grads):
        assert torch.equal(a, b)


# Layouts of an attention layer's input projection y (..., 320): q, k, v of 4 heads of 16, then
# what the layer passes on (the output gate, the forget gate) and the KV-shift logits, and 52
# columns of padding that no part covers.
ATTENTION_INPUT_LAYOUTS = {
    "pro": dict(q=0, k=64, v=128, q_width=64, kv_width=64, k_shift=256, v_shift=260, shift_heads=4,
                q_group=16, k_group=16, passed=[(192, 64), (264, 4)]),
    "llama": dict(q=0, k=64, v=128, q_width=64, kv_width=64, passed=[(192, 4)]),
    "shift_only": dict(q=0, k=64, v=128, q_width=64, kv_width=64, k_shift=256, v_shift=260,
                       shift_heads=4, passed=[(192, 64), (264, 4)]),
    "norm_only": dict(q=0, k=64, v=128, q_width=64, kv_width=64, q_group=16, k_group=16,
                      norm_eps=1e-5, passed=[(264, 4)]),
}


def attention_inputs_step(y, weights, layout, fused_node, monkeypatch, seed):
    """attention_inputs of y (and the q and k norm weights) under autograd, its fused node on
    (FOX_FUSED_ATTENTION_INPUTS=fused_node "1") or composed ("0"), backward from random incoming
    gradients (seeded): (outputs, gradients of y and of both weights)."""
    monkeypatch.setenv("FOX_FUSED_ATTENTION_INPUTS", fused_node)
    xs = [t.detach().clone().requires_grad_() for t in [y] + weights]
    outs = fused.attention_inputs(xs[0], **layout, q_norm_weight=xs[1], k_norm_weight=xs[2])
    gen = torch.Generator(device=y.device).manual_seed(seed)
    grads = [torch.randn(o.shape, device=y.device, generator=gen).to(o.dtype) for o in outs]
    torch.autograd.backward(outs, grads)
    return outs, [x.grad for x in xs]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("layout", list(ATTENTION_INPUT_LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_inputs_is_the_composition(layout, dtype, monkeypatch):
    """attention_inputs on CUDA under autograd is one node whose backward writes every part's
    gradient into one tensor: outputs and the gradients of y and of both norm weights bitwise
    those of the composition (FOX_FUSED_ATTENTION_INPUTS=0: shift_mix and rms_norm on views of
    y), the padding's columns zero."""
    kw = ATTENTION_INPUT_LAYOUTS[layout]
    g = torch.Generator(device="cuda").manual_seed(5)
    y = torch.randn(2, 37, 320, device="cuda", generator=g).to(dtype)
    weights = [1 + 0.1 * torch.randn(64, device="cuda", generator=g) for _ in range(2)]

    outs, grads = attention_inputs_step(y, weights, kw, "1", monkeypatch, seed=6)
    assert "AttentionInputs" in outs[0].grad_fn.name()  # the fused node, not the composition
    outs_c, grads_c = attention_inputs_step(y, weights, kw, "0", monkeypatch, seed=6)
    assert "AttentionInputs" not in outs_c[0].grad_fn.name()
    for a, b in zip(outs, outs_c):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip(grads, grads_c):
        assert (a is None and b is None) or torch.equal(a, b)
    assert torch.all(grads[0][..., 268:] == 0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_inputs_shift_norm_walks(dtype, monkeypatch):
    """The k part's KV-shift and norm as one kernel each way, at a width and length where the
    backward's threads walk runs of rows (12 heads of 64, 2 x 2501 positions: the second
    sequence starts inside a run): outputs and y's gradient bitwise the composition's; the k norm
    weight's gradient is summed in another grouping of the rows, so it agrees to float32 rounding
    (the q norm's, one kernel in both, bitwise)."""
    H, D = 12, 64
    C = H * D
    kw = dict(q=0, k=C, v=2 * C, q_width=C, kv_width=C, k_shift=4 * C, v_shift=4 * C + H,
              shift_heads=H, q_group=D, k_group=D, passed=[(3 * C, C), (4 * C + 2 * H, H)])
    W = 4 * C + 3 * H + 20
    g = torch.Generator(device="cuda").manual_seed(11)
    y = torch.randn(2, 2501, W, device="cuda", generator=g).to(dtype)
    weights = [1 + 0.1 * torch.randn(C, device="cuda", generator=g) for _ in range(2)]

    outs, grads = attention_inputs_step(y, weights, kw, "1", monkeypatch, seed=12)
    outs_c, grads_c = attention_inputs_step(y, weights, kw, "0", monkeypatch, seed=12)
    for a, b in zip(outs, outs_c):
        assert torch.equal(a, b)
    assert torch.equal(grads[0], grads_c[0]) and torch.equal(grads[1], grads_c[1])
    dw, dw_c = grads[2], grads_c[2]
    torch.testing.assert_close(dw, dw_c, rtol=0, atol=1e-4 * dw_c.abs().max().item())


def test_bad_arguments_name_the_argument():
    gu, w = torch.randn(4, 16, requires_grad=True), torch.randn(6, 8)
    with pytest.raises(RuntimeError, match="act"):
        fused.gated_linear(gu[:, :8], gu[:, 8:], "relu", w)
    with pytest.raises(RuntimeError, match="act"):
        fused.split_gated_linear(gu, "relu", w)
    with pytest.raises(RuntimeError, match="gate_value"):
        fused.split_gated_linear(gu[:, :15], "swish", w)
    hidden, labels = torch.randn(2, 5, 8, requires_grad=True), torch.randint(0, 6, (2, 5))
    with pytest.raises(RuntimeError, match="labels"):
        fused.linear_cross_entropy(hidden, w, labels[:, :-1])
    with pytest.raises(RuntimeError, match="reduction"):
        fused.linear_cross_entropy(hidden, w, labels, reduction="avg")
    x = torch.randn(2, 3, 8)
    with pytest.raises(RuntimeError, match="group_size"):
        fused.rms_norm(x, None, 3, 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        fused.rms_norm(x, torch.ones(4), 8, 1e-6)
    with pytest.raises(RuntimeError, match="shift_logits"):
        fused.shift_mix(x, torch.randn(2, 3, 3))
    with pytest.raises(RuntimeError, match="first"):
        fused.shift_mix(x, torch.randn(2, 3, 2), torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="act"):
        fused.gated(x, x, "relu")
    with pytest.raises(RuntimeError, match="logits"):
        fused.log_forget_gate(torch.randn(2, 3))
    with pytest.raises(RuntimeError, match="bias"):
        fused.log_forget_gate(torch.randn(2, 3, 4), torch.randn(5))
    with pytest.raises(RuntimeError, match="labels"):
        fused.cross_entropy(x, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(RuntimeError, match="weight"):
        fused.logits(x, torch.randn(8))
    with pytest.raises(RuntimeError, match="hidden"):
        fused.logits(x, torch.randn(5, 7))
    y = torch.randn(2, 3, 320)
    with pytest.raises(RuntimeError, match="part passed"):
        fused.attention_inputs(y, q=0, k=64, v=128, q_width=64, kv_width=64, passed=[(300, 64)])
    with pytest.raises(RuntimeError, match="shift_heads"):
        fused.attention_inputs(y, q=0, k=64, v=128, q_width=64, kv_width=64, k_shift=256,
                               shift_heads=5)
    with pytest.raises(RuntimeError, match="q_group"):
        fused.attention_inputs(y, q=0, k=64, v=128, q_width=64, kv_width=64, q_group=24)
    with pytest.raises(RuntimeError, match="overlap"):
        fused.attention_inputs(y, q=0, k=64, v=128, q_width=64, kv_width=64, passed=[(100, 8)])
