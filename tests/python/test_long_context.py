"""One million tokens on the GPU (B=1, H=1, D=64): with a fast-forgetting gate the cumulative sum
c reaches about -1e6, where a float32 ulp is 0.06. The op keeps the bias of nearby tokens exact
(tile-local sums); a global float32 cumsum formulation visibly drifts there."""
import math

import pytest
import torch
import torch.nn.functional as F

import forgetting_transformer as fox

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

N, D, WINDOW, LAST = 1 << 20, 64, 512, 128


def local_reference(q, k, v, log_f, positions, bias_dtype):
    """Attention of the given query positions over their last WINDOW keys (the gate makes older
    keys weigh < e^-300), biases from a cumsum in bias_dtype: float64 and local = exact;
    float32 and global = the drifting formulation."""
    outs = []
    c = log_f.to(bias_dtype).cumsum(0)
    for i in positions.tolist():
        j = torch.arange(max(0, i - WINDOW + 1), i + 1, device=q.device)
        s = (k[j].double() @ q[i].double()) / math.sqrt(D) + (c[i] - c[j]).double()
        outs.append(torch.softmax(s, 0) @ v[j].double())
    return torch.stack(outs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_one_million_tokens_keep_local_bias_exact():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, N, 1, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    log_f = F.logsigmoid(torch.randn(1, N, 1, device="cuda") - 0.5)  # mean log f ~ -1: |c| ~ 1e6
    assert log_f.sum().item() < -5e5
    out = fox.forgetting_attention(q, k, v, log_f)
    positions = torch.arange(N - LAST, N, device="cuda")
    qq, kk, vv, ff = q[0, :, 0], k[0, :, 0], v[0, :, 0], log_f[0, :, 0]
    exact = local_reference(qq, kk, vv, ff, positions, torch.float64)
    drifting = local_reference(qq, kk, vv, ff, positions, torch.float32)
    # the same local formula, exact biases, evaluated in bf16: the dtype's own error
    err_ours = (out[0, N - LAST:, 0].double() - exact).abs().max().item()
    err_global = (drifting - exact).abs().max().item()
    bf16_scale = exact.abs().max().item() * 2 ** -8
    assert err_ours <= 2 * bf16_scale, (err_ours, bf16_scale)
    assert err_global > 10 * err_ours and err_global > 1e-2, (err_global, err_ours)
