"""forgetting_transformer.nn: the bound C++ modules against a small pure-PyTorch reference of the
same math (weights shared through state_dict), state_dict round trip, a training step with
torch.optim, the KV cache and generation; and bench/bench_authors.py's loading of the authors'
package (same name) beside this one, which its comparison of the two models rests on."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from forgetting_transformer import nn as fnn
from forgetting_transformer.reference import causal_lm as ref_lm
from reference import rule_violations

ARCHS = ["fox_llama", "fox_pro", "transformer_llama", "transformer_pro"]


def tiny(arch, **kw):
    c = fnn.ForgettingTransformerConfig(vocab_size=53, hidden_size=32, num_hidden_layers=2,
                                        num_heads=4, **kw).preset(arch)
    c.intermediate_size = 48
    return c


def randomized(model, scale=0.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return model


# ---- tests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_causal_lm_matches_reference(arch):
    torch.manual_seed(0)
    c = tiny(arch)
    model = randomized(fnn.ForgettingTransformerForCausalLM(c).double())
    assert isinstance(model, torch.nn.Module)
    ids = torch.randint(0, 53, (2, 9))
    sd = model.state_dict()
    torch.testing.assert_close(model(ids), ref_lm(c, sd, ids), rtol=1e-9, atol=1e-9)
    labels = torch.randint(0, 53, (2, 9))
    loss = model(ids, labels=labels)
    ref = F.cross_entropy(ref_lm(c, sd, ids).flatten(0, 1), labels.flatten(), reduction="none")
    torch.testing.assert_close(loss, ref.view(2, 9), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("fgate_type", ["full", "bias_only", "fixed"])
def test_gate_types_and_gqa_match_reference(fgate_type):
    """The other forget-gate types and grouped kv heads (2 kv heads for 4 heads), with QK-norm
    weights shared across heads."""
    torch.manual_seed(0)
    c = tiny("fox_pro", fgate_type=fgate_type, num_kv_heads=2,
             fgate_bias_init=fgate_type != "full", qk_norm_share_param_across_head=True)
    model = randomized(fnn.ForgettingTransformerForCausalLM(c).double())
    ids = torch.randint(0, 53, (2, 9))
    torch.testing.assert_close(model(ids), ref_lm(c, model.state_dict(), ids), rtol=1e-9, atol=1e-9)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("arch", ARCHS)
def test_causal_lm_on_cuda_matches_reference(arch):
    """On CUDA the modules run the fused kernels (norms, KV-shift, gates, loss) and one GEMM for
    all input projections: float32 loss and every parameter's gradient against the float64
    reference, and a bf16-autocast loss close to it."""
    torch.manual_seed(0)
    c = tiny(arch)
    model = randomized(fnn.ForgettingTransformerForCausalLM(c)).cuda()
    ids, labels = torch.randint(0, 53, (2, 70)), torch.randint(0, 53, (2, 70))
    labels[1, :3] = -100
    sd = {k: v.detach().double().cpu().requires_grad_(v.is_floating_point())
          for k, v in model.state_dict().items()}
    ref = F.cross_entropy(ref_lm(c, sd, ids).flatten(0, 1), labels.flatten(), reduction="none")
    ref.sum().backward()
    loss = model(ids.cuda(), labels=labels.cuda())
    loss.sum().backward()
    torch.testing.assert_close(loss.cpu().double(), ref.view(2, 70), rtol=1e-4, atol=1e-4)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu().double(), sd[name].grad, rtol=1e-3, atol=1e-4,
                                   msg=lambda m: f"{name}: {m}")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss_bf16 = model(ids.cuda(), labels=labels.cuda())
    assert (loss_bf16.float().cpu().double() - ref.view(2, 70)).abs().max() < 0.1


def test_parameter_names_and_shapes():
    c = fnn.ForgettingTransformerConfig(vocab_size=100, hidden_size=1536, num_hidden_layers=1,
                                        num_heads=24).preset("fox_pro")
    model = fnn.ForgettingTransformerForCausalLM(c)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["model.layers.0.attn.k_proj.linear.weight"] == (1536, 1536)
    assert shapes["model.layers.0.attn.k_proj.shift_proj.weight"] == (24, 1536)
    assert shapes["model.layers.0.attn.fgate_proj.bias"] == (24,)
    assert shapes["model.layers.0.attn.q_norm.weight"] == (1536,)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (2 * 3584, 1536)  # ratio 3.5
    assert shapes["lm_head.weight"] == (100, 1536)
    assert fnn.mlp_intermediate_size(1536, 4.0) == 4096


def test_layer_options_and_errors():
    layer = fnn.ForgettingAttentionLayer(32, 4, fgate_type="fixed", fgate_bias_init=True,
                                         decay_time_min=2.0, decay_time_max=64.0)
    assert "fgate_bias" in dict(layer.named_buffers())
    assert "fgate_bias" not in dict(layer.named_parameters())
    with pytest.raises(RuntimeError, match="fgate_type"):
        fnn.ForgettingAttentionLayer(32, 4, fgate_type="nope")
    with pytest.raises(AttributeError):
        fnn.ForgettingAttentionLayer(32, 4, not_an_option=1)
    with pytest.raises(RuntimeError, match="unknown architecture"):
        fnn.ForgettingTransformerConfig().preset("rwkv")


def test_setattr_of_a_buffer_reaches_the_cpp_module():
    # Loaders that set every tensor by name (transformers' from_pretrained) replace buffers too.
    layer = fnn.ForgettingAttentionLayer(32, 4, fgate_type="fixed", fgate_bias_init=True,
                                         decay_time_min=2.0, decay_time_max=64.0)
    x = torch.randn(1, 5, 32)
    before = layer(x)
    new_bias = torch.full_like(layer.fgate_bias, -3.0)
    layer.fgate_bias = new_bias
    assert torch.equal(dict(layer.named_buffers())["fgate_bias"], new_bias)
    assert not torch.allclose(layer(x), before)


def test_state_dict_round_trip(tmp_path):
    c = tiny("fox_pro")
    a = randomized(fnn.ForgettingTransformerForCausalLM(c), seed=1)
    b = fnn.ForgettingTransformerForCausalLM(c)
    ids = torch.randint(0, 53, (2, 6))
    torch.save(a.state_dict(), tmp_path / "sd.pt")
    b.load_state_dict(torch.load(tmp_path / "sd.pt"))
    torch.testing.assert_close(a(ids), b(ids), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="missing keys"):
        b.load_state_dict({})


def test_training_step_reduces_loss():
    torch.manual_seed(2)
    model = fnn.ForgettingTransformerForCausalLM(tiny("fox_pro"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 53, (4, 16))
    labels = torch.roll(ids, -1, 1)
    losses = []
    model.train()
    for _ in range(8):
        loss = model(ids, labels=labels).mean()
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_activation_checkpointing(arch):
    """Per-block checkpointing: the same loss and gradients bit for bit, and the blocks'
    activations are no longer kept (the bytes saved for backward outside the checkpointed blocks
    fall to the embedding, the final norm, the head and the loss); decoding with a cache is
    unaffected."""
    model = randomized(fnn.ForgettingTransformerForCausalLM(tiny(arch)))
    ids = torch.randint(0, 53, (2, 24), generator=torch.Generator().manual_seed(0))

    def step(checkpointing):
        model.set_activation_checkpointing(checkpointing)
        model.zero_grad()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
            loss = model(ids, labels=torch.roll(ids, -1, 1)).mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()], sum(saved)

    loss, grads, kept = step(False)
    loss_ck, grads_ck, kept_ck = step(True)
    assert torch.equal(loss, loss_ck)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ck))
    assert kept_ck < kept / 3, (kept_ck, kept)
    with torch.no_grad():
        out = model.generate(ids[:, :5], max_new_tokens=4, do_sample=False)
    model.set_activation_checkpointing(False)
    with torch.no_grad():
        assert torch.equal(out, model.generate(ids[:, :5], max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("arch", ["fox_pro", "transformer_pro"])
def test_cache_decoding_equals_full_forward(arch, grad):
    """Chunked prefill + one-token steps give the full forward's logits; without autograd the
    one-token steps run each input projection on its own instead of the fused GEMM."""
    model = randomized(fnn.ForgettingTransformerForCausalLM(tiny(arch)).double(), 0.1)
    ids = torch.randint(1, 53, (2, 10))
    seq_start = torch.tensor([2, 0])
    with torch.set_grad_enabled(grad):
        full = model(ids, seq_start=seq_start)
        cache = model.new_cache()
        parts = [model(ids[:, :4], cache=cache, seq_start=seq_start)]
        for t in range(4, 10):
            parts.append(model(ids[:, t:t + 1], cache=cache))
    assert len(cache) == 10
    assert cache.layer(0).log_fgate.shape == (2, 10, 4)
    torch.testing.assert_close(torch.cat(parts, 1)[:, 2:], full[:, 2:], rtol=1e-9, atol=1e-9)


def test_generate_greedy_and_sampling():
    torch.manual_seed(3)
    model = randomized(fnn.ForgettingTransformerForCausalLM(tiny("fox_llama")).double())
    prompt = torch.randint(0, 53, (2, 5))
    out = model.generate(prompt, max_new_tokens=5)
    seq = prompt
    with torch.no_grad():
        for _ in range(5):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)
    stopped = model.generate(prompt, max_new_tokens=5, stop_tokens=out[:, 5].tolist())
    assert stopped.shape == (2, 6)
    sampled = model.generate(prompt, max_new_tokens=4, do_sample=True, temperature=0.7, top_k=5,
                             top_p=0.9)
    assert sampled.shape == (2, 9) and torch.equal(sampled[:, :5], prompt)


# ---- the Python module tree over the C++ modules (hooks, parameter swaps: FSDP2's needs) ------

def test_module_tree_is_python_modules():
    m = fnn.ForgettingTransformerForCausalLM(tiny("fox_pro"))
    mods = dict(m.named_modules())
    assert all(isinstance(v, torch.nn.Module) for v in mods.values())
    assert isinstance(mods["model.layers.1"], fnn.ForgettingTransformerBlock)
    assert isinstance(mods["model.layers.0.attn"], fnn.ForgettingAttentionLayer)
    assert isinstance(mods["model.layers.0.attn.k_proj"], fnn.ShiftLinear)
    assert mods["model.layers.0"] is m.model.layers[0] is dict(m.named_modules())["model.layers.0"]
    assert len(m.model.layers) == 2
    assert list(m.model.layers) == [m.model.layers[0], m.model.layers[1]]
    # every parameter belongs to exactly one module of the tree, under its full name
    owned = {f"{n}.{p}" if n else p: t for n, mod in mods.items()
             for p, t in mod.named_parameters(recurse=False)}
    assert owned.keys() == dict(m.named_parameters()).keys()
    assert all(owned[k] is v for k, v in m.named_parameters())


def test_forward_hooks_fire_on_blocks():
    m = fnn.ForgettingTransformerForCausalLM(tiny("fox_llama"))
    ids = torch.randint(0, 53, (2, 6))
    seen = []
    hooks = [b.register_forward_hook(lambda mod, args, out, i=i: seen.append((i, out.shape)))
             for i, b in enumerate(m.model.layers)]
    m(ids)
    assert seen == [(0, (2, 6, 32)), (1, (2, 6, 32))]
    # a hook's return value replaces the block's output inside the C++ forward
    hooks.append(m.model.layers[1].register_forward_hook(lambda mod, args, out: out * 0))
    h = m.model(ids)
    assert torch.allclose(h, torch.zeros_like(h))     # final RMSNorm of zeros
    for hk in hooks:
        hk.remove()
    m.generate(ids[:, :2], max_new_tokens=2)          # the C++ loop calls back into Python


@pytest.mark.parametrize("arch", ["fox_pro", "fox_llama"])
def test_setattr_swaps_the_cpp_parameter(arch):
    """module.weight = p (as fully_shard does) re-points the C++ module: forward reads p and the
    gradient lands in p."""
    torch.manual_seed(0)
    cfg = tiny(arch, tie_word_embeddings=arch == "fox_llama")
    m = fnn.ForgettingTransformerForCausalLM(cfg)
    ids, labels = torch.randint(0, 53, (2, 6)), torch.randint(0, 53, (2, 6))
    ref = m(ids, labels=labels).sum()
    old, new = {}, {}
    for name, mod in m.named_modules():
        for pname, p in list(mod.named_parameters(recurse=False)):
            full = f"{name}.{pname}" if name else pname
            old[full], new[full] = p, torch.nn.Parameter(p.detach().clone())
            setattr(mod, pname, new[full])
    assert all(a is new[k] for k, a in m.named_parameters())
    assert m.model.layers[0].attn.q_proj.weight is new["model.layers.0.attn.q_proj.weight"]
    loss = m(ids, labels=labels).sum()
    assert torch.equal(loss, ref)
    loss.backward()
    assert all(new[k].grad is not None and old[k].grad is None for k in new)
    with torch.no_grad():
        new["model.norm.weight"].mul_(0)               # forward reads the new tensor
    assert torch.allclose(m.model(ids), torch.zeros(2, 6, 32))
    q = m.model.layers[0].attn.q_proj
    with pytest.raises(RuntimeError, match="has shape"):
        q.weight = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(KeyError, match="fixed"):
        q.register_parameter("scale", torch.nn.Parameter(torch.ones(1)))


def test_zero_grad_as_nn_module():
    """zero_grad() (the C++ module's own walk) sets every gradient to None, on the whole model and
    on a submodule alone, also after a parameter was swapped; zero_grad(set_to_none=False) zeros
    them in place as nn.Module's does."""
    torch.manual_seed(0)
    m = fnn.ForgettingTransformerForCausalLM(tiny("fox_pro"))
    ids = torch.randint(0, 53, (2, 6))
    swapped = torch.nn.Parameter(m.model.layers[1].attn.q_proj.weight.detach().clone())
    m.model.layers[1].attn.q_proj.weight = swapped

    def backward():
        m(ids, labels=ids).sum().backward()
        assert all(p.grad is not None for p in m.parameters())

    backward()
    attn = m.model.layers[0].attn
    attn.zero_grad()
    assert all(p.grad is None for p in attn.parameters())
    m.model.layers[1].attn.q_proj.zero_grad()  # a torch::nn::Linear, its parameter swapped
    assert swapped.grad is None
    assert all(p.grad is not None for p in m.model.layers[1].mlp.parameters())
    m.zero_grad()
    assert all(p.grad is None for p in m.parameters())
    backward()
    kept = {n: p.grad for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=False)
    for n, p in m.named_parameters():
        assert p.grad is kept[n] and torch.count_nonzero(p.grad) == 0, n


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("preset", ["fox_pro", "fox_llama"])
def test_training_step_is_deterministic(preset):
    """Two training steps of one model on the same tokens (bf16 autocast, summed loss, 4096
    tokens of a vocabulary of 64: every id repeated many times) give bitwise the same loss and
    gradients: not only the attention backward but everything around it accumulates in a fixed
    order (ATen's embedding backward did not, on this many ids)."""
    torch.manual_seed(0)
    c = fnn.ForgettingTransformerConfig(vocab_size=64, hidden_size=256, num_hidden_layers=2,
                                        num_heads=4).preset(preset)
    model = fnn.ForgettingTransformerForCausalLM(c).cuda()
    ids = torch.randint(0, 64, (2, 2048), device="cuda")

    def step():
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids, reduction="sum")
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    (loss1, grads1), (loss2, grads2) = step(), step()
    assert torch.equal(loss1, loss2)
    assert [n for n in grads1 if not torch.equal(grads1[n], grads2[n])] == []


# ---- the training step's memory savings ------------------------------------------------------------

SAVINGS_OFF = {"FOX_RECOMPUTE_GATED": "0", "FOX_LOSS_CHUNK_ROWS": "0"}


def savings_step(model, ids, labels, env, monkeypatch, autocast=None, storages=False):
    """Loss, every parameter's gradient and the bytes saved for backward of one training step
    with the savings' knobs set as in env (unset ones at their default: on). The bytes are those
    of the saved tensors, or with `storages` those of the distinct storages they keep alive."""
    for name in SAVINGS_OFF:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    model.zero_grad()
    saved, kept = [], {}

    def pack(t):
        if storages:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        else:
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(ids.device.type, dtype=autocast, enabled=autocast is not None):
            loss = model(ids, labels=labels)
    # Per-token weights, so that each row's gradient differs.
    weights = torch.linspace(0.5, 1.5, loss.numel(), device=loss.device).view(loss.shape)
    (loss * weights).sum().backward()
    return (loss.detach().double(), {n: p.grad.detach().clone() for n, p in model.named_parameters()},
            sum(kept.values()) if storages else sum(saved))


def savings_model(tied, device, dtype):
    c = tiny("fox_pro", tie_word_embeddings=tied)
    return randomized(fnn.ForgettingTransformerForCausalLM(c)).to(device, dtype), c


def savings_case(device, dtype, tied):
    """(autocast dtype or None, model, config, ids, labels) of a savings test; float64 is CPU's."""
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 runs on the CPU backend")
    autocast = torch.bfloat16 if dtype == "autocast_bf16" else None
    model, c = savings_model(tied, device, torch.float32 if autocast else dtype)
    return (autocast, model, c) + savings_batch(device)


def savings_batch(device):
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 53, (2, 24), generator=g), torch.randint(0, 53, (2, 24), generator=g)
    labels[0, :5] = -100
    labels[1, -3:] = -100
    return ids.to(device), labels.to(device)


@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, "autocast_bf16"])
def test_gated_recompute_same_loss_and_gradients(device, dtype, tied, monkeypatch):
    """GatedMLP without the product act(g) * u kept for the backward, the attention layer without
    its gated output: bitwise the same loss and gradients, and at least the products' bytes (rows
    x (intermediate + hidden) per layer) less kept."""
    autocast, model, c, ids, labels = savings_case(device, dtype, tied)
    off = SAVINGS_OFF
    loss, grads, kept = savings_step(model, ids, labels, off, monkeypatch, autocast)
    loss_r, grads_r, kept_r = savings_step(model, ids, labels, {"FOX_LOSS_CHUNK_ROWS": "0"},
                                           monkeypatch, autocast)
    assert torch.equal(loss, loss_r)
    for name in grads:
        assert torch.equal(grads[name], grads_r[name]), name
    product = c.num_hidden_layers * ids.numel() * (
        c.intermediate_size + (c.hidden_size if c.use_output_gate else 0))
    product *= 2 if autocast else torch.empty((), dtype=dtype).element_size()
    assert kept_r <= kept - product, (kept_r, kept, product)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, "autocast_bf16"])
def test_deferred_residual_is_block_by_block(device, dtype, monkeypatch):
    """The model's own block loop adds each block's MLP branch to the stream inside the next
    block's first norm (ForgettingTransformerBlock.forward_deferred); with a forward hook on a
    block the loop calls every block's whole forward, which adds it after the MLP: bitwise the
    same loss and gradients, and no more bytes saved for the backward."""
    autocast, model, c, ids, labels = savings_case(device, dtype, False)
    loss, grads, kept = savings_step(model, ids, labels, {}, monkeypatch, autocast)
    hook = model.model.layers[0].register_forward_hook(lambda mod, args, out: None)
    loss_b, grads_b, kept_b = savings_step(model, ids, labels, {}, monkeypatch, autocast)
    hook.remove()
    assert torch.equal(loss, loss_b)
    for name in grads:
        assert torch.equal(grads[name], grads_b[name]), name
    assert kept <= kept_b, (kept, kept_b)


@pytest.mark.parametrize("arch", ["fox_pro", "fox_llama"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, "autocast_bf16"])
def test_fused_attention_inputs_same_loss_and_gradients(device, dtype, arch, monkeypatch):
    """The attention layer's input side as one autograd node (functional.attention_inputs, whose
    backward writes the input projection's gradient as one tensor) against shift_mix and
    rms_norm on split views (FOX_FUSED_ATTENTION_INPUTS=0): bitwise the same loss and gradients,
    and no more memory kept for the backward (the bytes of the storages the saved tensors keep:
    the node saves the projection's output whole where the composition saves views of it)."""
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 runs on the CPU backend")
    autocast = torch.bfloat16 if dtype == "autocast_bf16" else None
    model = randomized(fnn.ForgettingTransformerForCausalLM(tiny(arch)))
    model = model.to(device, torch.float32 if autocast else dtype)
    ids, labels = savings_batch(device)
    loss_c, grads_c, kept_c = savings_step(model, ids, labels, {"FOX_FUSED_ATTENTION_INPUTS": "0"},
                                           monkeypatch, autocast, storages=True)
    monkeypatch.delenv("FOX_FUSED_ATTENTION_INPUTS")
    loss, grads, kept = savings_step(model, ids, labels, {}, monkeypatch, autocast, storages=True)
    assert torch.equal(loss, loss_c)
    for name in grads:
        assert torch.equal(grads[name], grads_c[name]), name
    assert kept <= kept_c, (kept, kept_c)


def assert_step_matches(dtype, autocast, got, base, reference):
    """A training step's (loss, {name: gradient}) got against base, the same step another way:
    in float64 equal to 1e-12; else the 2x rule against reference() (the float64 model on the
    CPU backend), base as the naive result."""
    (loss_g, grads_g), (loss_b, grads_b) = got, base
    names = list(grads_b)
    if dtype == torch.float64:
        torch.testing.assert_close(loss_g, loss_b, rtol=0, atol=1e-12)
        for name in names:
            torch.testing.assert_close(grads_g[name], grads_b[name], rtol=0, atol=1e-12,
                                       msg=lambda m: f"{name}: {m}")
        return
    ref_loss, ref_grads = reference()
    got = [t.cpu() for t in [loss_g] + [grads_g[n] for n in names]]
    naive = [t.cpu() for t in [loss_b] + [grads_b[n] for n in names]]
    ref = [ref_loss] + [ref_grads[n] for n in names]
    problems = rule_violations(["loss"] + names, got, ref, naive,
                               torch.bfloat16 if autocast else dtype)
    assert not problems, problems


@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, "autocast_bf16"])
def test_chunked_loss_matches_whole_logits(device, dtype, tied, monkeypatch):
    """The LM head and loss in row chunks (7 rows: 48 rows in 7 chunks, the last of 6), the
    logits made again in the backward: float64 agrees to 1e-12 with the whole-logits path; float32
    and bf16 autocast keep the 2x rule against the float64 model (the whole-logits path in the
    same dtype as the naive result). The logits are no longer kept for the backward."""
    autocast, model, c, ids, labels = savings_case(device, dtype, tied)
    off = SAVINGS_OFF
    chunked = {"FOX_LOSS_CHUNK_ROWS": "7", "FOX_RECOMPUTE_GATED": "0"}
    loss, grads, kept = savings_step(model, ids, labels, off, monkeypatch, autocast)
    loss_c, grads_c, kept_c = savings_step(model, ids, labels, chunked, monkeypatch, autocast)
    assert (loss_c[labels == -100] == 0).all()
    logits_bytes = ids.numel() * c.vocab_size * (
        2 if autocast else torch.empty((), dtype=dtype).element_size())
    assert kept_c <= kept - logits_bytes, (kept_c, kept, logits_bytes)
    assert_step_matches(dtype, autocast, (loss_c, grads_c), (loss, grads), lambda: savings_step(
        model.double().cpu(), ids.cpu(), labels.cpu(), off, monkeypatch)[:2])


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, "autocast_bf16"])
def test_reduced_loss_matches_per_token(device, dtype, tied, reduction, monkeypatch):
    """forward(labels=..., reduction="sum" / "mean"): the per-token loss reduced (mean over the
    tokens not ignored), with every gradient of the per-token loss's sum (mean); float64 to
    1e-12, float32 and bf16 autocast by the 2x rule against the float64 model, the per-token
    path in the same dtype as the naive result. On CUDA the reduced loss makes its gradients in
    the forward."""
    autocast, model, c, ids, labels = savings_case(device, dtype, tied)
    valid = int((labels != -100).sum())

    def step(model, ids, labels, reduced):
        for name in SAVINGS_OFF:
            monkeypatch.delenv(name, raising=False)
        model.zero_grad()
        with torch.autocast(ids.device.type, dtype=autocast, enabled=autocast is not None):
            if reduced:
                loss = model(ids, labels=labels, reduction=reduction)
            else:
                loss = model(ids, labels=labels).sum()
                loss = loss / valid if reduction == "mean" else loss
        (loss * 0.37).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        return loss.detach().double(), grads

    loss_r, grads_r = step(model, ids, labels, True)
    loss, grads = step(model, ids, labels, False)
    assert loss_r.dim() == 0
    if device == "cpu":  # (bad-argument errors are checked on the CPU: see NOTES, "Hygiene run")
        with pytest.raises(RuntimeError, match="reduction"):
            model(ids, labels=labels, reduction="avg")
    monkeypatch.setenv("FOX_LOSS_CHUNK_ROWS", "0")  # the whole logits: reduced by reduce_loss
    with torch.no_grad(), torch.autocast(ids.device.type, dtype=autocast,
                                         enabled=autocast is not None):
        whole = model(ids, labels=labels, reduction=reduction)
    monkeypatch.delenv("FOX_LOSS_CHUNK_ROWS")
    torch.testing.assert_close(whole.double(), loss, rtol=1e-6 if dtype == torch.float64 else 2e-3,
                               atol=0)
    assert_step_matches(dtype, autocast, (loss_r, grads_r), (loss, grads), lambda: step(
        model.double().cpu(), ids.cpu(), labels.cpu(), False))


def test_memory_savings_on_by_default(monkeypatch):
    """Unset knobs: both savings on (less kept than with both off); any chunk size gives the same
    loss in float64, and without autograd the loss is the whole-logits one, bitwise."""
    model, _ = savings_model(False, "cpu", torch.float64)
    ids, labels = savings_batch("cpu")
    loss, _, kept = savings_step(model, ids, labels, {}, monkeypatch)
    loss_off, _, kept_off = savings_step(model, ids, labels, SAVINGS_OFF, monkeypatch)
    assert kept < kept_off
    torch.testing.assert_close(loss, loss_off, rtol=0, atol=1e-12)
    for rows in ("1", "47", "48", "1000"):
        monkeypatch.setenv("FOX_LOSS_CHUNK_ROWS", rows)
        torch.testing.assert_close(model(ids, labels=labels).detach().double(), loss, rtol=0,
                                   atol=1e-12)
    with torch.no_grad():
        monkeypatch.setenv("FOX_LOSS_CHUNK_ROWS", "5")
        chunked = model(ids, labels=labels)
        monkeypatch.setenv("FOX_LOSS_CHUNK_ROWS", "0")
        assert torch.equal(chunked, model(ids, labels=labels))
    monkeypatch.setenv("FOX_LOSS_CHUNK_ROWS", "x")
    with pytest.raises(RuntimeError, match="FOX_LOSS_CHUNK_ROWS"):
        model(ids, labels=labels)


def test_authors_benchmark_sets_their_package_aside(tmp_path):
    """bench/bench_authors.py imports the authors' package, which has this package's name, from a
    source folder and then takes it out of sys.modules: their classes come back, and
    `forgetting_transformer` is ours before and after (a stand-in package plays theirs)."""
    theirs = tmp_path / "forgetting_transformer" / "model" / "forgetting_transformer"
    theirs.mkdir(parents=True)
    (tmp_path / "forgetting_transformer" / "__init__.py").write_text("THEIRS = True\n")
    (tmp_path / "forgetting_transformer" / "model" / "__init__.py").write_text("")
    (theirs / "__init__.py").write_text(
        "class ForgettingTransformerConfig:\n    STAND_IN = True\n"
        "class ForgettingTransformerForCausalLM:\n    STAND_IN = True\n")
    bench = Path(__file__).parents[2] / "bench"
    code = f"""
import sys
sys.path.insert(0, {str(bench)!r})
import forgetting_transformer as before
import bench_authors
config, model = bench_authors.load_authors({str(tmp_path)!r})
assert config.STAND_IN and model.STAND_IN
import forgetting_transformer as after
assert after is before and not hasattr(after, "THEIRS") and hasattr(after, "nn")
assert {str(tmp_path)!r} not in sys.path
assert not any(getattr(m, "__file__", None) and m.__file__.startswith({str(tmp_path)!r})
               for m in list(sys.modules.values()))
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
