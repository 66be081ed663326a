"""Generation on the static cache: cached decoding equals full forward passes for every
architecture, with GQA, left padding, prompts of different lengths and chunked prefill (KV-shift
carried); the static cache equals the growing one; streaming yields generate's tokens; bad input
is a clear error. On a GPU the replayed CUDA graph equals the eager step bit for bit."""
import pytest
import torch

from forgetting_transformer import nn as fnn

ARCHS = ["fox_llama", "fox_pro", "transformer_llama", "transformer_pro"]
HAS_CUDA = torch.cuda.is_available()


def tiny_model(arch, kv_heads=2, dtype=torch.float64, device="cpu", seed=0):
    c = fnn.ForgettingTransformerConfig(vocab_size=61, hidden_size=64, num_hidden_layers=2,
                                        num_heads=4, num_kv_heads=kv_heads).preset(arch)
    model = fnn.ForgettingTransformerForCausalLM(c)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # random weights far from the init, so that tokens differ per position
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return model.to(device=device, dtype=dtype).eval()


def greedy_by_full_forward(model, ids, n, seq_start=None):
    """The reference: n greedy tokens, each from a full forward over everything so far, plus the
    last-position logits of each step."""
    seq, logits = ids, []
    with torch.no_grad():
        for _ in range(n):
            last = model(seq, seq_start=seq_start)[:, -1]
            logits.append(last)
            seq = torch.cat([seq, last.argmax(-1, keepdim=True)], 1)
    return seq, torch.stack(logits, 1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_static_cache_equals_full_forward(arch, kv_heads):
    model = tiny_model(arch, kv_heads)
    ids = torch.randint(0, 61, (3, 9))
    ref, _ = greedy_by_full_forward(model, ids, 6)
    assert torch.equal(model.generate(ids, max_new_tokens=6), ref)
    assert torch.equal(model.generate(ids, max_new_tokens=6, prefill_chunk_size=4), ref)
    assert torch.equal(model.generate(ids, max_new_tokens=6, static_cache=False), ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_of_cached_steps(arch):
    """The static cache's one-token forwards give the full forward's logits (float64: to
    rounding)."""
    model = tiny_model(arch)
    ids = torch.randint(0, 61, (2, 12))
    full = model(ids)
    cache = model.new_static_cache(2, 16)
    with torch.no_grad():
        parts = [model(ids[:, :5], cache=cache)]
        for t in range(5, 12):
            parts.append(model(ids[:, t:t + 1], cache=cache))
    assert cache.is_static and cache.lengths.tolist() == [12, 12]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padding(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, 61, (3, 10))
    seq_start = torch.tensor([0, 4, 7])
    static = model.generate(ids, max_new_tokens=5, seq_start=seq_start)
    dynamic = model.generate(ids, max_new_tokens=5, seq_start=seq_start, static_cache=False)
    assert torch.equal(static, dynamic)
    for b in range(3):  # each row alone, without its padding
        alone = model.generate(ids[b:b + 1, seq_start[b]:], max_new_tokens=5)
        assert torch.equal(static[b, -5:], alone[0, -5:])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", [0, 3])
def test_prompts_of_different_lengths(arch, chunk):
    model = tiny_model(arch)
    ids = torch.randint(0, 61, (4, 11))
    lengths = torch.tensor([11, 1, 6, 9])
    out = model.generate(ids, max_new_tokens=6, prompt_lengths=lengths, prefill_chunk_size=chunk)
    assert out.shape == (4, 17)
    for b, n in enumerate(lengths.tolist()):
        ref, _ = greedy_by_full_forward(model, ids[b:b + 1, :n], 6)
        assert torch.equal(out[b, 11:], ref[0, n:])


def test_stop_tokens_and_padding():
    model = tiny_model("fox_pro")
    ids = torch.randint(0, 61, (2, 6))
    free = model.generate(ids, max_new_tokens=8)
    stop = int(free[0, 8])  # row 0 stops at its third new token
    for static in (True, False):
        out = model.generate(ids, max_new_tokens=8, stop_tokens=[stop], pad_token_id=0,
                             static_cache=static)
        ref = model.generate(ids, max_new_tokens=8, stop_tokens=[stop], pad_token_id=0,
                             static_cache=False)
        assert torch.equal(out, ref)
        assert torch.all(out[0, 9:] == 0)


def test_streaming_yields_the_generated_tokens():
    model = tiny_model("fox_pro")
    ids = torch.randint(0, 61, (2, 7))
    out = model.generate(ids, max_new_tokens=9)
    streamed = list(model.stream(ids, max_new_tokens=9))
    assert len(streamed) == 9 and all(t.shape == (2,) for t in streamed)
    assert torch.equal(torch.stack(streamed, 1), out[:, 7:])


def test_sampling_inside_the_step():
    torch.manual_seed(0)
    model = tiny_model("fox_llama")
    ids = torch.randint(0, 61, (64, 4))
    out = model.generate(ids, max_new_tokens=3, do_sample=True, temperature=0.8, top_k=7,
                         top_p=0.9)
    assert out.shape == (64, 7) and torch.equal(out[:, :4], ids)
    # top_k=1 leaves one candidate: sampling is the greedy choice.
    one = model.generate(ids, max_new_tokens=3, do_sample=True, top_k=1)
    assert torch.equal(one, model.generate(ids, max_new_tokens=3))


def test_gumbel_sampling_follows_the_softmax():
    torch.manual_seed(1)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(40000, 1)
    opts = fnn.GenerationOptions(do_sample=True, temperature=1.0)
    counts = torch.bincount(fnn.sample_next_token(logits, opts), minlength=4).double()
    torch.testing.assert_close(counts / counts.sum(), logits[0].softmax(-1).double(),
                               atol=0.01, rtol=0)


def test_bad_input_is_a_clear_error():
    model = tiny_model("fox_pro")
    ids = torch.randint(0, 61, (2, 8))
    with pytest.raises(RuntimeError, match="max_length"):
        model.generate(ids, max_new_tokens=4, max_length=6)  # prompt longer than the cache
    with pytest.raises(RuntimeError, match="max_new_tokens"):
        model.generate(ids, max_new_tokens=6, max_length=10)  # overflows while generating
    with pytest.raises(RuntimeError, match="prompt_lengths"):
        model.generate(ids, max_new_tokens=2, prompt_lengths=torch.tensor([8, 9]))
    with pytest.raises(RuntimeError, match="prompt_lengths"):
        model.generate(ids, max_new_tokens=2, prompt_lengths=torch.tensor([0, 3]))
    with pytest.raises(RuntimeError, match="prompt_lengths"):
        model.generate(ids, max_new_tokens=2, prompt_lengths=torch.tensor([3]))
    cache = model.new_static_cache(2, 8)
    with torch.no_grad():
        model(ids, cache=cache)
        with pytest.raises(RuntimeError, match="do not fit"):
            model(ids[:, :1], cache=cache)
    with pytest.raises(RuntimeError, match="gate_dtype must be float32 or float16"):
        model.new_static_cache(2, 8, gate_dtype=torch.bfloat16)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_float16_gate_cache(device):
    """A static cache with float16 gates: the first layer's gates are the float32 cache's rounded
    to float16 (the cache write, on CUDA the fused kernel), the cached steps' logits stay within
    float16's rounding of log f of the full forward's, and generation with it runs (graph replay
    equal to eager on a GPU, GQA: the decoding kernel reads the float16 gates)."""
    if device == "cuda" and not HAS_CUDA:
        pytest.skip("no CUDA device")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = tiny_model("fox_pro", kv_heads=2, dtype=dtype, device=device)
    ids = torch.randint(0, 61, (2, 12), device=device)
    full = model(ids).float()
    caches = {g: model.new_static_cache(2, 16, gate_dtype=g) for g in (None, torch.float16)}
    logits = {}
    with torch.no_grad():
        for g, cache in caches.items():
            parts = [model(ids[:, :5], cache=cache)]
            for t in range(5, 12):
                parts.append(model(ids[:, t:t + 1], cache=cache))
            logits[g] = torch.cat(parts, 1).float()
    # The first layer's gates (the later layers' inputs differ by the rounding above them).
    g32, g16 = caches[None].layer(0).log_fgate, caches[torch.float16].layer(0).log_fgate
    assert g32.dtype == torch.float32 and g16.dtype == torch.float16
    assert torch.equal(g16, g32.half())
    # log f to 11 bits moves these logits (random weights, |logits| up to ~10) by up to ~3e-3; on
    # a GPU (bf16) against the float32 gate cache through the same kernels.
    if device == "cpu":
        torch.testing.assert_close(logits[torch.float16], full, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(logits[None], full, rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(logits[torch.float16], logits[None], rtol=0.1, atol=0.1)
    out = model.generate(ids, max_new_tokens=6, gate_cache_dtype=torch.float16)
    assert out.shape == (2, 18) and torch.equal(out[:, :12], ids)
    assert fnn.GenerationOptions(gate_cache_dtype=torch.float16).gate_cache_dtype == torch.float16
    if device == "cuda":
        eager = model.generate(ids, max_new_tokens=6, gate_cache_dtype=torch.float16,
                               cuda_graph=False)
        assert torch.equal(out, eager)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_graph_equals_eager_bitwise(arch):
    model = tiny_model(arch, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 61, (3, 40), device="cuda")
    lengths = torch.tensor([40, 17, 33])
    for opts in (dict(), dict(prompt_lengths=lengths), dict(seq_start=torch.tensor([0, 5, 9]))):
        graph = model.generate(ids, max_new_tokens=20, cuda_graph=True, **opts)
        eager = model.generate(ids, max_new_tokens=20, cuda_graph=False, **opts)
        assert torch.equal(graph, eager), opts
    session = fnn.GenerationSession(model.cpp_module, ids,
                                    fnn.GenerationOptions(max_new_tokens=4))
    assert session.uses_cuda_graph


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_cuda_graph_greedy_equals_full_forward():
    model = tiny_model("fox_pro", dtype=torch.float32, device="cuda")
    ids = torch.randint(0, 61, (2, 30), device="cuda")
    ref, _ = greedy_by_full_forward(model, ids, 12)
    assert torch.equal(model.generate(ids, max_new_tokens=12), ref)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("batch", [3, 16])  # the few-row kernel; cuBLAS
def test_odd_vocabulary_head_of_a_session(batch, monkeypatch):
    """A vocabulary that is no multiple of 8 (61 here): the session multiplies the LM head on a
    copy padded to 64 rows (16-byte aligned logits rows). The tokens are the full forwards' and
    those of the weight as it is (FOX_PAD_VOCAB=0), with and without the captured graph."""
    model = tiny_model("fox_pro", dtype=torch.float32, device="cuda")
    ids = torch.randint(0, 61, (batch, 20), device="cuda")
    ref, _ = greedy_by_full_forward(model, ids, 10)
    for graph in (True, False):
        assert torch.equal(model.generate(ids, max_new_tokens=10, cuda_graph=graph), ref), graph
    monkeypatch.setenv("FOX_PAD_VOCAB", "0")
    assert torch.equal(model.generate(ids, max_new_tokens=10), ref)


def test_decoding_projection_follows_parameter_updates():
    """Few-row inference keeps the layer's concatenated projection weights: an in-place update of
    a parameter (an optimizer step) or a load_state_dict must reach the next decoding forward."""
    model = tiny_model("fox_pro")
    ids = torch.randint(0, 61, (2, 1))
    with torch.no_grad():
        before = model(ids)
        for p in model.parameters():
            p.mul_(1.25)
        after = model(ids)
    with torch.enable_grad():
        expected = model(ids).detach()  # autograd path: a fresh concatenation
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, expected, rtol=1e-12, atol=1e-12)
    other = tiny_model("fox_pro", seed=1)
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(ids), other(ids), rtol=1e-12, atol=1e-12)


def test_static_cache_in_the_autocast_dtype():
    """A float32 model under autocast computes K and V in the autocast dtype; the static cache
    that generation allocates keeps them in it (no conversion per step), with the same tokens as
    the growing cache, which stores them as they come."""
    model = tiny_model("fox_pro", dtype=torch.float32)
    cache = model.new_static_cache(2, 8, torch.bfloat16)
    assert cache.layer(0).k.dtype == torch.bfloat16 and cache.layer(0).log_fgate.dtype == torch.float32
    assert model.new_static_cache(2, 8).layer(0).k.dtype == torch.float32
    ids = torch.randint(0, 61, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        static = model.generate(ids, max_new_tokens=6)
        growing = model.generate(ids, max_new_tokens=6, static_cache=False)
    assert torch.equal(static, growing)
