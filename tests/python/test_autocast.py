"""torch.autocast: the op runs in the autocast dtype even when q, k, v arrive in mixed dtypes (a
float32 QK-norm output next to bf16 projections), and the models train under autocast."""
import torch
import torch.nn.functional as F

import forgetting_transformer as fox
from forgetting_transformer import nn as fnn


def test_op_under_autocast_casts_mixed_inputs(device):
    torch.manual_seed(0)
    q = torch.randn(2, 33, 4, 16, device=device, requires_grad=True)  # float32 (e.g. after a norm)
    k = torch.randn(2, 33, 2, 16, device=device).bfloat16().requires_grad_()
    v = torch.randn(2, 33, 2, 16, device=device, requires_grad=True)
    g = F.logsigmoid(torch.randn(2, 33, 4, device=device)).requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        out = fox.forgetting_attention(q, k, v, g)
    assert out.dtype == torch.bfloat16
    ref = fox.forgetting_attention(q.detach().bfloat16(), k.detach(), v.detach().bfloat16(), g.detach())
    assert torch.equal(out, ref)
    out.float().square().sum().backward()
    assert q.grad.dtype == torch.float32 and k.grad.dtype == torch.bfloat16
    assert g.grad.dtype == torch.float32 and torch.isfinite(g.grad).all()


def test_model_training_step_under_autocast(device):
    torch.manual_seed(0)
    config = fnn.ForgettingTransformerConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                             num_heads=4).preset("fox_pro")
    model = fnn.ForgettingTransformerForCausalLM(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 24), device=device)
    losses = []
    for _ in range(5):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(ids, labels=ids).float().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert losses[-1] < losses[0]
