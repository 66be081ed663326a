"""fox::nn::functional, the fused elementwise functions the modules are built from (RMSNorm,
KV-shift mix, gates, cross entropy): forward and backward against float64 formulas with the 2x
rule, on inputs that are slices of a wider tensor (as the model passes them), on CPU (the ATen
formulas) and on CUDA (the fused kernels)."""
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
def test_rms_norm(device, dtype, group, offset):
    B, T, C = 2, 37, 192
    wide = torch.randn(B, T, C + 40, device=device).to(dtype)  # x is a slice: row stride C + 40
    w = (1 + 0.3 * torch.randn(C, device=device))
    check(lambda xw, w: fused.rms_norm(xw[..., offset:offset + C], w, group, 1e-5),
          lambda xw, w, cd: ref_rms_norm(xw[..., offset:offset + C], w, group, 1e-5, cd),
          [wide, w], dtype, torch.randn(B, T, C, device=device), ["dx", "dweight"])


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
def test_shift_mix(device, dtype, with_first, extra):
    B, T, H, D = 2, 29, 3, 64
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
@pytest.mark.parametrize("act", ["swish", "sigmoid"])
def test_gated(device, dtype, act):
    N, C = 67, 160
    gu = torch.randn(N, 2 * C, device=device).to(dtype)  # SwiGLU: the two halves of one projection
    check(lambda gu: fused.gated(gu[:, :C], gu[:, C:], act),
          lambda gu, cd: ref_gated(gu[:, :C], gu[:, C:], act, cd),
          [gu], dtype, torch.randn(N, C, device=device), ["dgate_up"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy(device, dtype):
    B, T, V = 3, 41, 1000
    logits = (3 * torch.randn(B, T, V, device=device)).to(dtype)
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


def test_bad_arguments_name_the_argument():
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
    with pytest.raises(RuntimeError, match="labels"):
        fused.cross_entropy(x, torch.zeros(2, 4, dtype=torch.long))
