"""forgetting_transformer.model: the authors' Hugging Face classes over our C++ modules. Checked
against the nn model (same tensors) and the plain-PyTorch reference in float64, the authors'
README snippets, checkpoints (ours, the authors' layout, sharded, bf16), the cache, left padding
and generate (our fast path and transformers' own loop). The GPU variants run the same under
bf16 autocast."""
import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import forgetting_transformer.model as fm  # noqa: E402  (registers the Auto* classes)
from forgetting_transformer import nn as fnn  # noqa: E402
from forgetting_transformer.reference import causal_lm as ref_lm  # noqa: E402
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda,
                                pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")]),
]
VOCAB = 61
WORDS = ("the a cat dog sat on mat and ran to house big small red blue is was of in it at "
         "by for with from up down left right old new one two three four five six seven eight "
         "nine ten sun moon star tree river hill road car boat bird fish cold warm best thing "
         "do").split()


def tiny_config(**kw):
    """A tiny FoX (Pro): every component (QK-norm, output gate and norm, KV-shift), GQA."""
    fields = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=4,
                  num_kv_heads=2, intermediate_size=48, use_output_gate=True,
                  use_output_norm=True, qk_norm=True, use_k_shift=True, use_v_shift=True,
                  bos_token_id=2, eos_token_id=3, pad_token_id=0)
    fields.update(kw)
    return fm.ForgettingTransformerConfig(**fields)


def randomized(model, scale=0.3, seed=0):
    """Parameters away from their init (norm weights not all ones, gate biases not zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=g) * scale).to(p))
    return model


def tiny_model(device="cpu", dtype=torch.float64, **kw):
    model = randomized(fm.ForgettingTransformerForCausalLM(tiny_config(**kw)))
    return model.to(device=device, dtype=dtype).eval()


def model_dtype(device):
    return torch.float64 if device == "cpu" else torch.float32


def autocast(device):
    """bf16 autocast on the GPU (as the authors' README generates), nothing on the CPU."""
    if device == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def close(device):
    return dict(rtol=1e-9, atol=1e-9) if device == "cpu" else dict(rtol=2e-2, atol=2e-2)


def assert_greedy_for(model, context, new_tokens, device):
    """new_tokens (1, n) are greedy continuations of context (1, T) by the model itself, run on
    that row alone: each is the argmax of its logits (on the GPU, under bf16, within rounding of
    the largest logit: other batch shapes may round near-ties the other way)."""
    ids = torch.cat([context, new_tokens[:, :-1]], 1)
    with autocast(device), torch.no_grad():
        logits = model(input_ids=ids).logits[0, context.shape[1] - 1:].float()
    chosen = logits.gather(-1, new_tokens[0, :, None])[:, 0]
    slack = 0.0 if device == "cpu" else 0.1
    assert (chosen >= logits.max(-1).values - slack).all(), (chosen, logits.max(-1))


def tiny_tokenizer():
    """A word-level tokenizer over WORDS, built locally (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[BOS]", "[EOS]"] + WORDS)}
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   bos_token="[BOS]", eos_token="[EOS]")


def prompt(batch, length, device="cpu"):
    return torch.randint(4, VOCAB, (batch, length), device=device)


# ---- config, parameters -------------------------------------------------------------------------

def test_config_has_the_authors_type_fields_and_keeps_unknown_ones(tmp_path):
    config = fm.ForgettingTransformerConfig(hidden_size=64, num_heads=4, my_extra_field=[1, 2])
    assert config.model_type == "forgetting_transformer-project_fox"
    assert (config.vocab_size, config.bos_token_id, config.eos_token_id) == (32000, 1, 2)
    assert config.hidden_ratio == 4 and config.fgate_type == "full" and not config.use_k_shift
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is fm.ForgettingTransformerConfig
    assert loaded.my_extra_field == [1, 2] and loaded.hidden_size == 64
    fox = loaded.to_fox_config()
    assert (fox.hidden_size, fox.num_heads, fox.vocab_size) == (64, 4, 32000)


@pytest.mark.parametrize("field,value", [("window_size", 128), ("attention_bias", True),
                                         ("elementwise_affine", False)])
def test_config_rejects_what_the_modules_do_not_implement(field, value):
    config = tiny_config(**{field: value})
    with pytest.raises(RuntimeError, match=field):
        fm.ForgettingTransformerForCausalLM(config)


def test_parameters_are_the_nn_models_under_the_authors_names():
    model = fm.ForgettingTransformerForCausalLM(tiny_config())
    keys = list(model.state_dict())
    assert keys == list(model.fox_model.state_dict())
    for key in ("model.embeddings.weight", "model.layers.0.attn.q_proj.weight",
                "model.layers.1.attn.k_proj.shift_proj.weight",
                "model.layers.0.attn.fgate_proj.bias",
                "model.layers.0.mlp.gate_proj.weight", "model.norm.weight", "lm_head.weight"):
        assert key in keys
    ours = dict(model.named_parameters())
    for name, p in model.fox_model.named_parameters():
        assert ours[name] is p or ours[name].data_ptr() == p.data_ptr()  # shared, not copied
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for p in model.fox_model.parameters())
    wrapped = fm.ForgettingTransformerForCausalLM.from_fox(model.fox_model)
    assert wrapped.state_dict().keys() == model.state_dict().keys()
    tied = fm.ForgettingTransformerForCausalLM(tiny_config(tie_word_embeddings=True))
    assert "lm_head.weight" not in tied.state_dict() and tied.get_output_embeddings() is None


# ---- forward ------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_forward_matches_nn_model_and_reference(device):
    model = tiny_model(device, model_dtype(device))
    ids, labels = prompt(2, 13, device), prompt(2, 13, device)
    labels[0, :2] = -100
    with autocast(device), torch.no_grad():
        out = model(input_ids=ids)
        assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithPast)
        assert out.loss is None and out.logits.shape == (2, 13, VOCAB)
        torch.testing.assert_close(out.logits, model.fox_model(ids), rtol=0, atol=0)
        with_labels = model(input_ids=ids, labels=labels)
        assert with_labels.logits is None and with_labels.loss.shape == (2, 13)
        torch.testing.assert_close(with_labels.loss, model.fox_model(ids, labels=labels),
                                   rtol=0, atol=0)
        # the other routes through the same blocks: hidden states, embeddings, logits_to_keep
        hidden = model(input_ids=ids, output_hidden_states=True)
        embeds = model(inputs_embeds=model.get_input_embeddings()(ids))
        last = model(input_ids=ids, logits_to_keep=1)
        base = model.model(input_ids=ids)
    assert len(hidden.hidden_states) == 3  # embeddings, after block 0, after the final norm
    with autocast(device), torch.no_grad():
        as_tuple = model(input_ids=ids, labels=labels, return_dict=False, use_cache=False)
    assert len(as_tuple) == 1 and torch.equal(as_tuple[0], with_labels.loss)
    torch.testing.assert_close(hidden.logits, out.logits, **close(device))
    torch.testing.assert_close(embeds.logits, out.logits, **close(device))
    torch.testing.assert_close(last.logits, out.logits[:, -1:], **close(device))
    torch.testing.assert_close(base.last_hidden_state, hidden.hidden_states[-1], **close(device))
    if device == "cpu":
        ref = ref_lm(model.config.to_fox_config(), model.state_dict(), ids)
        torch.testing.assert_close(out.logits, ref, rtol=1e-9, atol=1e-9)
        ref_loss = F.cross_entropy(ref.flatten(0, 1), labels.flatten(), reduction="none")
        torch.testing.assert_close(with_labels.loss, ref_loss.view(2, 13), rtol=1e-9, atol=1e-9)
        assert (with_labels.loss[0, :2] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_training_step_gradients_match_nn_model(device):
    model = tiny_model(device, model_dtype(device)).train()
    ids, labels = prompt(2, 11, device), prompt(2, 11, device)
    with autocast(device):
        model.fox_model(ids, labels=labels).mean().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with autocast(device):
        out = model(input_ids=ids, labels=labels)
    assert out.past_key_values is None  # training: no cache, as the authors
    out.loss.mean().backward()
    # the same computation (bit for bit on the CPU; the GPU's backward may sum in another order)
    same = dict(rtol=0, atol=0) if device == "cpu" else close(device)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], **same, msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("static", [False, True])
def test_cache_decoding_matches_full_forward(device, static):
    model = tiny_model(device, model_dtype(device))
    ids = prompt(2, 12, device)
    with autocast(device), torch.no_grad():
        full = model(input_ids=ids).logits
        cache = (fm.ForgettingTransformerCache.for_model(model, 2, 16) if static else None)
        out = model(input_ids=ids[:, :7], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        assert isinstance(cache, transformers.cache_utils.Cache) and cache.is_static == static
        assert cache.get_seq_length() == 7 and len(cache) == 2
        steps = [out.logits]
        for t in range(7, 12):
            out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            assert out.past_key_values is cache
            steps.append(out.logits)
    assert cache.get_seq_length() == 12
    layer = cache.layer(0)
    assert layer.k.shape[:2] == (2, 16 if static else 12) and layer.key_shift.shape == (2, 16)
    torch.testing.assert_close(torch.cat(steps, 1), full, **close(device))


@pytest.mark.parametrize("device", DEVICES)
def test_left_padding_matches_unpadded_rows(device):
    model = tiny_model(device, model_dtype(device))
    lengths = [9, 5, 7]
    rows = [prompt(1, n, device) for n in lengths]
    ids = torch.zeros(3, 9, dtype=torch.long, device=device)
    mask = torch.zeros(3, 9, dtype=torch.long, device=device)
    for b, row in enumerate(rows):
        ids[b, 9 - lengths[b]:] = row
        mask[b, 9 - lengths[b]:] = 1
    ids[1, :4] = prompt(1, 4, device)  # what stands in the padding must not matter
    with autocast(device), torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask).logits
        for b, row in enumerate(rows):
            single = model(input_ids=row).logits
            torch.testing.assert_close(padded[b:b + 1, 9 - lengths[b]:], single, **close(device))
        fast = model.generate(ids, attention_mask=mask, max_new_tokens=6)
        loop = model.generate(ids, attention_mask=mask, max_new_tokens=6,
                              return_dict_in_generate=True, output_scores=True)
        for b, row in enumerate(rows):
            if device == "cpu":  # float64: exactly the row's own greedy generation
                alone = model.generate(row, max_new_tokens=6)
                assert torch.equal(fast[b, 9:], alone[0, lengths[b]:]), b
            assert_greedy_for(model, row, fast[b:b + 1, 9:], device)
    assert torch.equal(loop.sequences, fast)
    assert len(loop.scores) == 6


# ---- generate -----------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_greedy_generate_matches_nn_generate(device):
    model = tiny_model(device, model_dtype(device))
    ids = prompt(2, 8, device)
    with autocast(device):
        ours = model.fox_model.generate(ids, max_new_tokens=10, stop_tokens=[-1])
        fast = model.generate(ids, max_new_tokens=10, eos_token_id=None)
        loop = model.generate(ids, max_new_tokens=10, eos_token_id=None,
                              return_dict_in_generate=True, output_logits=True)
        # transformers' defaults: 20 new tokens
        default = model.generate(ids, attention_mask=torch.ones_like(ids), eos_token_id=None)
    assert fast.shape == (2, 18) and torch.equal(fast, ours)
    assert torch.equal(loop.sequences, ours)
    assert isinstance(loop.past_key_values, fm.ForgettingTransformerCache)
    assert default.shape == (2, 28) and torch.equal(default[:, :18], ours)
    # the loop's logits (transformers keeps them in float32) are the full forward's
    with autocast(device), torch.no_grad():
        full = model(input_ids=ours[:, :-1]).logits[:, 7:].float()
    torch.testing.assert_close(torch.stack(loop.logits, 1), full,
                               **(dict(rtol=1e-5, atol=1e-5) if device == "cpu" else
                                  dict(rtol=5e-2, atol=5e-2)))
    assert_greedy_for(model, ids[:1], ours[:1, 8:], device)


@pytest.mark.parametrize("device", DEVICES)
def test_generate_stops_at_eos_and_pads(device):
    model = tiny_model(device, model_dtype(device))
    ids = prompt(2, 6, device)
    with autocast(device):
        free = model.generate(ids, max_new_tokens=12, eos_token_id=None)
    eos = int(free[0, 8])  # row 0's third new token: row 0 stops there
    first_eos = [(free[b, 6:] == eos).nonzero() for b in range(2)]
    with autocast(device):
        fast = model.generate(ids, max_new_tokens=12, eos_token_id=eos, pad_token_id=1)
        loop = model.generate(ids, max_new_tokens=12, eos_token_id=eos, pad_token_id=1,
                              return_dict_in_generate=True, output_scores=True)
    assert torch.equal(fast, loop.sequences)
    stop0 = 6 + int(first_eos[0][0])
    assert int(fast[0, stop0]) == eos and (fast[0, stop0 + 1:] == 1).all()
    if len(first_eos[1]) == 0:  # row 1 never stops: full length, unchanged
        assert torch.equal(fast[1], free[1])
    # one row only: generation ends at its eos
    with autocast(device):
        alone = model.generate(ids[:1], max_new_tokens=12, eos_token_id=eos)
    assert alone.shape[1] == stop0 + 1 and int(alone[0, -1]) == eos


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_is_reproducible_under_a_seed(device):
    model = tiny_model(device, model_dtype(device))
    ids = prompt(3, 5, device)
    settings = dict(do_sample=True, max_new_tokens=16, temperature=0.9, top_k=20, top_p=0.95,
                    eos_token_id=None)

    def draw(seed, **extra):
        torch.manual_seed(seed)
        with autocast(device):
            out = model.generate(ids, **settings, **extra)
        return out.sequences if extra else out

    first, again, other = draw(1), draw(1), draw(2)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(first[:, :5], ids) and first.shape == (3, 21)
    loop = draw(3, return_dict_in_generate=True, output_scores=True)
    assert torch.equal(loop, draw(3, return_dict_in_generate=True, output_scores=True))
    if device == "cpu":  # top_k=1 is greedy, whatever the seed (float64: no tied logits)
        greedy = model.generate(ids, max_new_tokens=16, eos_token_id=None)
        torch.manual_seed(5)
        assert torch.equal(model.generate(ids, do_sample=True, top_k=1, max_new_tokens=16,
                                          eos_token_id=None), greedy)


class _Collect(transformers.generation.BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("device", DEVICES)
def test_streaming(device):
    model = tiny_model(device, model_dtype(device))
    ids = prompt(1, 6, device)
    with autocast(device):
        expected = model.generate(ids, max_new_tokens=8, eos_token_id=None)
        collect = _Collect()
        streamed = model.generate(ids, max_new_tokens=8, eos_token_id=None, streamer=collect)
    assert torch.equal(streamed, expected) and collect.ended
    assert torch.equal(collect.puts[0], ids.cpu()) and len(collect.puts) == 9
    assert torch.equal(torch.cat(collect.puts[1:]), expected[0, 6:].cpu())
    tokenizer = tiny_tokenizer()
    text = io.StringIO()
    with contextlib.redirect_stdout(text), autocast(device):
        model.generate(ids, max_new_tokens=8, eos_token_id=None,
                       streamer=transformers.TextStreamer(tokenizer, skip_prompt=True))
    assert text.getvalue().strip() == tokenizer.decode(expected[0, 6:]).strip()


class _StopAfter(transformers.StoppingCriteria):
    """Stops a row once it has produced `token` (or every row at `length`)."""

    def __init__(self, token, length=None):
        self.token, self.length = token, length

    def __call__(self, input_ids, scores, **kwargs):
        done = input_ids[:, -1] == self.token
        if self.length is not None and input_ids.shape[1] >= self.length:
            done = torch.ones_like(done)
        return done


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("eos", [False, True])
def test_stopping_criteria_match_transformers_loop(device, eos):
    """Our stepwise generation with stopping criteria against transformers' own loop (forced by
    return_dict_in_generate): same sequences, rows stopped by a criterion padded only when there
    are stop tokens, as transformers does."""
    model = tiny_model(device, model_dtype(device))
    ids = prompt(3, 5, device)
    with autocast(device):
        free = model.generate(ids, max_new_tokens=12, eos_token_id=None)
    stop_token = int(free[1, 7])  # row 1 produces it at its third step
    settings = dict(max_new_tokens=12, pad_token_id=1,
                    eos_token_id=int(free[2, 10]) if eos else None)
    for criteria in ([_StopAfter(stop_token)], [_StopAfter(-5, length=9)]):
        criteria = transformers.StoppingCriteriaList(criteria)
        with autocast(device):
            ours = model.generate(ids, stopping_criteria=criteria, **settings)
            theirs = model.generate(ids, stopping_criteria=criteria, return_dict_in_generate=True,
                                    **settings).sequences
        assert torch.equal(ours, theirs)
    assert ours.shape[1] == 9  # the second criterion ends every row at 9 tokens


def test_generate_other_routes_agree():
    """Chunked prefill (both paths), embeddings as input and returned hidden states (transformers'
    loop on the growing cache), several sequences per prompt (static cache of B x n rows)."""
    model = tiny_model()
    ids = prompt(2, 7)
    greedy = model.generate(ids, max_new_tokens=5, eos_token_id=None)
    assert torch.equal(model.generate(ids, max_new_tokens=5, eos_token_id=None,
                                      prefill_chunk_size=3), greedy)
    chunked = model.generate(ids, max_new_tokens=5, eos_token_id=None, prefill_chunk_size=3,
                             return_dict_in_generate=True)
    assert torch.equal(chunked.sequences, greedy)
    embeds = model.get_input_embeddings()(ids)
    assert torch.equal(model.generate(inputs_embeds=embeds, max_new_tokens=5, eos_token_id=None),
                       greedy[:, 7:])
    hidden = model.generate(ids, max_new_tokens=5, eos_token_id=None, output_hidden_states=True,
                            return_dict_in_generate=True)
    assert torch.equal(hidden.sequences, greedy) and len(hidden.hidden_states) == 5
    several = model.generate(ids, max_new_tokens=5, eos_token_id=None, num_return_sequences=3,
                             do_sample=True, top_k=1)  # top_k=1: greedy, 3 times
    assert torch.equal(several, greedy.repeat_interleave(3, 0))


def test_beam_search_runs_on_the_growing_cache():
    model = tiny_model()
    ids = prompt(2, 5)
    out = model.generate(ids, num_beams=3, max_new_tokens=6, eos_token_id=None,
                         return_dict_in_generate=True)
    assert out.sequences.shape == (2, 11) and torch.equal(out.sequences[:, :5], ids)
    # the best beam scores at least as well as greedy (by its own sequence log-probability)
    greedy = model.generate(ids, max_new_tokens=6, eos_token_id=None)

    def logprob(seq):
        with torch.no_grad():
            lp = model(input_ids=seq[:, :-1]).logits.log_softmax(-1)
        return lp[:, 4:].gather(-1, seq[:, 5:, None]).sum((1, 2))

    assert (logprob(out.sequences) >= logprob(greedy) - 1e-9).all()


# ---- checkpoints --------------------------------------------------------------------------------

def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_save_and_load_round_trip(tmp_path):
    model = tiny_model(dtype=torch.float32)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "forgetting_transformer-project_fox"
    assert saved["architectures"] == ["ForgettingTransformerForCausalLM"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is fm.ForgettingTransformerForCausalLM and not loaded.training
    ids = prompt(2, 9)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))
    # the decoder alone (AutoModel), and our nn loader on the same directory
    decoder = AutoModel.from_pretrained(tmp_path)
    assert type(decoder) is fm.ForgettingTransformerModel
    torch.testing.assert_close(decoder(input_ids=ids).last_hidden_state,
                               model.model(input_ids=ids).last_hidden_state, rtol=0, atol=0)
    nn_model = fnn.ForgettingTransformerForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(nn_model(ids), _logits(model, ids))


@pytest.mark.parametrize("device", DEVICES)
def test_from_pretrained_onto_a_device_and_dtype(device, tmp_path):
    model = tiny_model(dtype=torch.float32)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, device_map=device,
                                                  dtype=torch.bfloat16)
    for name, p in loaded.state_dict().items():
        assert p.device.type == device and p.dtype == torch.bfloat16, name
        assert torch.equal(p.cpu(), model.state_dict()[name].to(torch.bfloat16)), name
    ids = prompt(2, 9, device)
    expected = model.to(device=device, dtype=torch.bfloat16)(input_ids=ids).logits
    assert torch.equal(loaded(input_ids=ids).logits, expected)
    assert torch.equal(loaded.generate(ids, max_new_tokens=4),
                       model.generate(ids, max_new_tokens=4))


@pytest.mark.parametrize("fgate_type", ["fixed", "bias_only", "none"])
def test_other_gate_types_round_trip(fgate_type, tmp_path):
    """Fixed gates are a buffer (model.layers.i.attn.fgate_bias) that the loader must set too."""
    fixed = dict(fgate_bias_init=True, decay_time_min=2.0, decay_time_max=100.0)
    model = tiny_model(dtype=torch.float32, fgate_type=fgate_type,
                       **(fixed if fgate_type == "fixed" else {}))
    assert any("fgate" in k for k in model.state_dict()) == (fgate_type != "none")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    ids = prompt(2, 9)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


def test_sharded_checkpoint_loads(tmp_path):
    model = tiny_model(dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    shards = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = prompt(2, 9)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


def test_bf16_checkpoint_loads(tmp_path):
    model = tiny_model(dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in loaded.fox_model.parameters())
    as_fp32 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for name, p in as_fp32.state_dict().items():
        assert p.dtype == torch.float32
        assert torch.equal(p, model.state_dict()[name].float()), name
    ids = prompt(2, 9)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


def test_authors_checkpoint_layout_loads(tmp_path):
    """A directory as the authors publish it: their config.json (their model_type, the fields our
    modules ignore) and bf16 tensors in model.safetensors."""
    from safetensors.torch import save_file
    reference = tiny_model(dtype=torch.float32)
    config = reference.config.to_dict()
    config.update(model_type="forgetting_transformer-project_fox", torch_dtype="bfloat16",
                  fuse_norm=True, fuse_cross_entropy=True, transformers_version="4.44.0",
                  architectures=["ForgettingTransformerForCausalLM"])
    config.pop("dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in reference.state_dict().items()},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    nn_model = fnn.ForgettingTransformerForCausalLM.from_pretrained(tmp_path)
    ids = prompt(2, 9)
    assert torch.equal(_logits(model, ids), nn_model(ids))


def test_nn_checkpoints_load_through_auto_classes(tmp_path):
    nn_model = fnn.ForgettingTransformerForCausalLM(
        fnn.ForgettingTransformerConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                        num_heads=4).preset("fox_pro"))
    nn_model.save_pretrained(str(tmp_path))  # model_type "forgetting_transformer" (fox train)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(model, fm.ForgettingTransformerForCausalLM)
    ids = prompt(2, 9)
    assert torch.equal(_logits(model, ids), nn_model(ids))


# ---- the authors' README, verbatim (sizes, device and paths changed) ---------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_readme_layer_snippet(device):
    import torch
    from forgetting_transformer.model import ForgettingAttentionLayer

    batch_size = 4
    seq_len = 64
    hidden_size = 96
    dtype = torch.float32
    x = torch.randn((batch_size, seq_len, hidden_size), dtype=dtype, device=device,
                    requires_grad=True)

    # Configuration for the 760M FoX (Pro) model
    layer = ForgettingAttentionLayer(
        hidden_size=hidden_size,
        num_heads=6,
        use_output_gate=True,
        use_output_norm=True,
        qk_norm=True,
        use_k_shift=True,
        use_v_shift=True,
    ).to(device)

    out, *rest = layer(x)
    assert out.size() == (batch_size, seq_len, hidden_size)
    print(layer)
    # ours: the printed tree is the authors'; the same layer as nn's, with gradients
    for line in ("(q_proj): Linear(in_features=96, out_features=96, bias=False)",
                 "(k_proj): ShiftLinear(96, 96)", "(fgate_proj): Linear(in_features=96, "
                 "out_features=6, bias=True)", "(output_norm): GroupRMSNorm(96)"):
        assert line in repr(layer), repr(layer)
    out.sum().backward()
    assert x.grad.shape == x.shape
    torch.testing.assert_close(out, layer.cpp_module.forward(x))


def test_attention_layer_with_mask_and_cache():
    """The layer alone: left padding by attention_mask, and a cache (layer_idx) fed in pieces
    giving the full call's output."""
    torch.manual_seed(0)
    layer = fm.ForgettingAttentionLayer(hidden_size=32, num_heads=4, qk_norm=True,
                                        use_k_shift=True, use_v_shift=True, use_output_gate=True,
                                        layer_idx=1).double()
    randomized(layer)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    full, attentions, cache = layer(x)
    assert attentions is None and cache is None
    cache = fm.ForgettingTransformerCache(2)
    parts = [layer(x[:, :5], past_key_values=cache, use_cache=True)[0]]
    parts += [layer(x[:, t:t + 1], past_key_values=cache, use_cache=True)[0] for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-9, atol=1e-9)
    assert len(cache.layer(1)) == 9 and len(cache.layer(0)) == 0
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    padded = layer(x, attention_mask=mask)[0]
    torch.testing.assert_close(padded[1:, 3:], layer(x[1:, 3:])[0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(padded[:1], full[:1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="window_size"):
        fm.ForgettingAttentionLayer(hidden_size=32, num_heads=4, window_size=64)


@pytest.mark.parametrize("device", DEVICES)
def test_readme_model_snippet(device):
    import torch
    from forgetting_transformer.model import (ForgettingTransformerConfig,
                                              ForgettingTransformerForCausalLM)

    batch_size = 4
    seq_len = 64
    hidden_size = 96
    vocab_size = 512
    bos_token_id = 0

    # Configuration for the 760M FoX (Pro) model
    config = ForgettingTransformerConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_heads=6,
        use_output_gate=True,
        use_output_norm=True,
        qk_norm=True,
        use_k_shift=True,
        use_v_shift=True,
        hidden_ratio=3.5  # output gates introduce extra params so we reduce MLP hidden size
    )
    model = ForgettingTransformerForCausalLM(config).to(device)

    labels = torch.randint(0, vocab_size, size=(batch_size, seq_len), device=device)
    input_ids = torch.roll(labels, shifts=1, dims=-1)
    input_ids[:, 0] = bos_token_id
    out = model(input_ids=input_ids, labels=labels)
    assert out.loss.size() == (batch_size, seq_len)
    # Logits are not returned (to save memory) if labels are given
    assert out.logits is None
    # To get logits don't provide labels
    out = model(input_ids=input_ids)
    assert out.logits.size() == (batch_size, seq_len, vocab_size)
    print(model)
    for line in ("(embeddings): Embedding(512, 96)", "(0-1): 2 x ForgettingTransformerBlock(",
                 "(down_proj): Linear(in_features=256, out_features=96, bias=False)",
                 "(lm_head): Linear(in_features=96, out_features=512, bias=False)"):
        assert line in repr(model), repr(model)


def authors_tokenizer_files(path):
    """A small GPT-2 BPE (trained here) in the layout of the authors' checkpoints: vocab.json,
    merges.txt and a tokenizer_config.json that names JSONGPT2Tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    bpe = ByteLevelBPETokenizer()
    text = ["The best thing to do in San Francisco is to walk up a hill.",
            'He said "hello"\nand left.', "the end of the text"] * 10
    bpe.train_from_iterator(text, vocab_size=320, min_frequency=1,
                            special_tokens=["<|endoftext|>"])
    os.makedirs(path, exist_ok=True)
    bpe.save_model(str(path))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "JSONGPT2Tokenizer", "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "add_bos_token": False,
        "add_prefix_space": False, "model_max_length": 16384}))
    return bpe.get_vocab_size()


def test_authors_tokenizer_escapes_text_as_json(tmp_path):
    authors_tokenizer_files(tmp_path)
    import forgetting_transformer.tokenizer  # noqa: F401  (registers JSONGPT2Tokenizer)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert type(tokenizer).__name__ == "JSONGPT2Tokenizer"
    text = 'He said "hello"\nand left. \u00e9\t\\'
    ids = tokenizer(text).input_ids
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert "n" in tokens and "\\" in "".join(tokens)  # the newline went in as backslash, n
    assert tokenizer.decode(ids) == text
    assert tokenizer.batch_decode(tokenizer([text, "the end"]).input_ids) == [text, "the end"]


def _authors_checkpoint(path):
    """Our checkpoint of a tiny FoX (Pro) with the authors' tokenizer files beside it."""
    vocab = authors_tokenizer_files(path)
    model = randomized(fm.ForgettingTransformerForCausalLM(tiny_config(
        vocab_size=vocab, bos_token_id=0, eos_token_id=0, pad_token_id=None)))
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("device", DEVICES)
def test_readme_loading_and_generation_snippet(device, tmp_path):
    checkpoint = _authors_checkpoint(tmp_path / "fox-pro-tiny")  # for the Hub repository

    import forgetting_transformer.model  # Needed to register the model classes
    import forgetting_transformer.tokenizer  # Needed to register the tokenizer class
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import torch

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, add_bos_token=True,
                                              clean_up_tokenization_spaces=False)

    # Generation using HF api
    prompt = "The best thing to do in San Francisco is"
    model = model.to(device)
    encoded = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        output = model.generate(
            encoded,
            max_new_tokens=30,
        )[0]
    pred = tokenizer.decode(output, skip_special_tokens=True)
    print(pred)

    # Of course you can also compute the logits or loss given proper inputs
    batch_size, seq_len = encoded.shape
    labels = encoded
    input_ids = torch.roll(labels, shifts=1, dims=-1)
    input_ids[:, 0] = tokenizer.bos_token_id  # 50256
    out = model(input_ids=input_ids, labels=labels)
    assert out.loss.size() == (batch_size, seq_len)
    # Logits are not returned (to save memory) if labels are given
    assert out.logits is None
    # To get logits don't provide labels
    out = model(input_ids=input_ids)
    assert out.logits.size() == (batch_size, seq_len, tokenizer.vocab_size)

    # ours: the prompt starts with BOS, and generation matches the nn model's (same autocast)
    assert int(encoded[0, 0]) == tokenizer.bos_token_id and pred.startswith(prompt)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        expected = model.fox_model.generate(encoded, max_new_tokens=30)[0]
    assert torch.equal(output, expected)


# ---- errors -------------------------------------------------------------------------------------

def test_bad_input_raises_errors_that_name_the_argument():
    model = tiny_model()
    ids = prompt(2, 6)
    right = torch.ones(2, 6, dtype=torch.long)
    right[0, -2:] = 0
    with pytest.raises(ValueError, match="attention_mask must be left padding"):
        model(input_ids=ids, attention_mask=right)
    with pytest.raises(ValueError, match="attention_mask must be left padding"):
        model.generate(ids, attention_mask=right, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"attention_mask must be \(batch, seqlen\)"):
        model(input_ids=ids, attention_mask=right[:, :4])
    with pytest.raises(ValueError, match="labels must be"):
        model(input_ids=ids, labels=ids[:, :3])
    with pytest.raises(ValueError, match="exactly one of input_ids"):
        model()
    with pytest.raises(ValueError, match="input_ids must have 2 dimensions"):
        model(input_ids=ids[0])
    with pytest.raises(TypeError, match="past_key_values must be"):
        model(input_ids=ids, past_key_values=((ids, ids),), use_cache=True)
    with pytest.raises(ValueError, match="output_attentions"):
        model(input_ids=ids, output_attentions=True)


def test_core_package_imports_without_transformers():
    """The hf extra is optional: without transformers the core package and nn import, and
    forgetting_transformer.model says what to install."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('transformers', 'safetensors'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import forgetting_transformer, forgetting_transformer.nn\n"
        "for name in ('model', 'tokenizer'):\n"
        "    try:\n"
        "        __import__('forgetting_transformer.' + name)\n"
        "    except ImportError as e:\n"
        "        print('ImportError:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("pip install 'forgetting_transformer[hf]'") == 2, out.stdout
