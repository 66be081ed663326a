"""The model written out in plain PyTorch from a state_dict (the authors' parameter names), with
full attention matrices: slow and O(T^2) in memory, but the readable definition of the math of the
C++ modules. The tests check the modules against it; `fox inspect` uses it to see the attention
maps and forget gates.

    logits = causal_lm(config, model.state_dict(), ids)
    keep = []; causal_lm(config, sd, ids, keep)  # keep[layer] = {"log_fgate", "attn"}
"""
import math
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F


def rms(x, w, groups, eps):
    """RMSNorm over `groups` equal slices of the last dim (per-head norms); w covers one slice
    (shared across heads) or all of them."""
    shape = x.shape
    g = x.reshape(*shape[:-1], groups, -1)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    if w.numel() == g.shape[-1]:
        return (g * w).reshape(shape)
    return g.reshape(shape) * w


def shift(x, sd, p, heads):
    """ShiftLinear (KV-shift): per head, a data-dependent mix of this and the previous token."""
    out = x @ sd[p + "linear.weight"].T
    alpha = torch.sigmoid(x @ sd[p + "shift_proj.weight"].T)[..., None]
    B, T, _ = out.shape
    cur = out.view(B, T, heads, -1)
    prev = F.pad(cur, (0, 0, 0, 0, 1, 0))[:, :-1]
    return (alpha * prev + (1 - alpha) * cur).reshape(B, T, -1)


def rope(x, base):
    """Rotary embedding on (B, T, H, D), rotating the two halves of D."""
    T, D = x.shape[1], x.shape[-1]
    inv = base ** (-torch.arange(0, D, 2, dtype=torch.float64, device=x.device) / D)
    ang = torch.arange(T, dtype=torch.float64, device=x.device)[:, None] * inv
    cos, sin = (t.to(x.dtype)[None, :, None] for t in (ang.cos(), ang.sin()))
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def log_forget_gate(c, sd, p, x):
    """log f, (B, T, H): data-dependent ("full"), per-head constants ("bias_only", "fixed") or 0."""
    B, T, _ = x.shape
    if c.fgate_type == "full":
        return F.logsigmoid(x @ sd[p + "fgate_proj.weight"].T + sd[p + "fgate_proj.bias"])
    if c.fgate_type in ("bias_only", "fixed"):
        return F.logsigmoid(sd[p + "fgate_bias"].to(x.dtype)).expand(B, T, -1)
    return torch.zeros(B, T, c.num_heads, dtype=x.dtype)


def attention(c, sd, p, x, keep: Optional[List[Dict]] = None):
    """One ForgettingAttentionLayer (prefix p) on x (B, T, hidden)."""
    B, T, _ = x.shape
    H, D = c.num_heads, c.hidden_size // c.num_heads
    Hkv = c.num_kv_heads or H
    q = x @ sd[p + "q_proj.weight"].T
    k = shift(x, sd, p + "k_proj.", Hkv) if c.use_k_shift else x @ sd[p + "k_proj.weight"].T
    v = shift(x, sd, p + "v_proj.", Hkv) if c.use_v_shift else x @ sd[p + "v_proj.weight"].T
    if c.qk_norm:
        q, k = rms(q, sd[p + "q_norm.weight"], H, 1e-5), rms(k, sd[p + "k_norm.weight"], Hkv, 1e-5)
    q, k, v = q.view(B, T, H, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
    if c.use_rope:
        q, k = rope(q, c.rope_base), rope(k, c.rope_base)
    k, v = (t.repeat_interleave(H // Hkv, dim=2) for t in (k, v))  # head h reads kv head h // group
    lf = log_forget_gate(c, sd, p, x)
    cs = lf.cumsum(1).transpose(1, 2)  # (B, H, T)
    s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(D) + cs[..., :, None] - cs[..., None, :]
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    probs = s.softmax(-1)
    if keep is not None:
        keep.append({"log_fgate": lf, "attn": probs})
    o = torch.einsum("bhij,bjhd->bihd", probs, v).reshape(B, T, H * D)
    if c.use_output_norm:
        o = rms(o, sd[p + "output_norm.weight"], H, c.norm_eps)
    if c.use_output_gate:
        o = o * torch.sigmoid(x @ sd[p + "ogate_proj.weight"].T)
    return o @ sd[p + "o_proj.weight"].T


def causal_lm(c, sd, ids, keep: Optional[List[Dict]] = None):
    """Logits (B, T, vocab) of ForgettingTransformerForCausalLM; per-layer internals into `keep`."""
    h = sd["model.embeddings.weight"][ids]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        h = h + attention(c, sd, p + "attn.", rms(h, sd[p + "attn_norm.weight"], 1, c.norm_eps), keep)
        g, y = (rms(h, sd[p + "mlp_norm.weight"], 1, c.norm_eps)
                @ sd[p + "mlp.gate_proj.weight"].T).chunk(2, -1)
        h = h + (F.silu(g) * y) @ sd[p + "mlp.down_proj.weight"].T
    head = sd.get("lm_head.weight", sd["model.embeddings.weight"])
    return rms(h, sd["model.norm.weight"], 1, c.norm_eps) @ head.T
