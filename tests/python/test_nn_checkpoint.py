"""Hugging Face-format checkpoints (config.json + model.safetensors): save_pretrained /
from_pretrained from Python, checkpoints written by a plain-Python writer of the format (as the
`safetensors` package and transformers write them, with an authors'-style config.json), our files
read back by a plain-Python reader, the safetensors package when installed, and errors."""
import json
import struct

import pytest
import torch

from forgetting_transformer import nn as fnn

ARCHS = ["fox_llama", "fox_pro", "transformer_llama", "transformer_pro"]

# ---- a plain-Python safetensors writer/reader (the format as the safetensors package has it) -----

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
           torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
           torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_FROM_NAME = {v: k for k, v in _DTYPES.items()}
# the safetensors package's Dtype enum order: its writer puts later dtypes first
_RANK = {n: i for i, n in enumerate(["BOOL", "U8", "I8", "I16", "F16", "BF16", "I32", "F32", "F64",
                                     "I64"])}


def _raw(t):
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def write_safetensors(path, tensors, metadata=None):
    """As safetensors.torch.save_file: data ordered by dtype (the package's enum order,
    descending) then name, compact JSON header, "__metadata__" first, padded with spaces to a
    multiple of 8 bytes."""
    items = sorted(tensors.items(), key=lambda kv: (-_RANK[_DTYPES[kv[1].dtype]], kv[0]))
    header, chunks, offset = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, t in items:
        raw = _raw(t)
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for c in chunks:
            f.write(c)


def read_safetensors(path):
    """(tensors, metadata, header size) of a safetensors file, validated as the package does."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    metadata = header.pop("__metadata__", None)
    out, end = {}, 0
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        b, e = info["data_offsets"]
        assert b == end
        end = e
        dtype = _FROM_NAME[info["dtype"]]
        buf = bytearray(body[b:e])
        t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        out[name] = t.view(dtype).reshape(info["shape"]).clone()
    assert end == len(body)
    return out, metadata, n


def authors_config(c):
    """An authors'-style config.json (as transformers writes their ForgettingTransformerConfig):
    their model_type, keys this model ignores, sorted keys, 2-space indent."""
    d = {
        "_name_or_path": "zhixuan-lin/fox-pro-760m-longcrawl64-48b",
        "architectures": ["ForgettingTransformerForCausalLM"],
        "model_type": "forgetting_transformer-project_fox",
        "transformers_version": "4.44.0", "torch_dtype": "float32",
        "attention_bias": False, "elementwise_affine": True, "fuse_cross_entropy": True,
        "fuse_norm": True, "max_position_embeddings": 16384, "use_cache": True,
        "window_size": None, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "hidden_ratio": c.hidden_ratio,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
        "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads, "hidden_act": c.hidden_act,
        "initializer_range": c.initializer_range, "norm_eps": c.norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings, "rope_base": c.rope_base,
        "use_rope": c.use_rope, "use_output_gate": c.use_output_gate, "ogate_act": c.ogate_act,
        "fgate_type": c.fgate_type, "fgate_bias_init": c.fgate_bias_init,
        "decay_time_min": c.decay_time_min, "decay_time_max": c.decay_time_max,
        "use_output_norm": c.use_output_norm, "qk_norm": c.qk_norm,
        "use_k_shift": c.use_k_shift, "use_v_shift": c.use_v_shift,
    }
    return json.dumps(d, indent=2, sort_keys=True) + "\n"


# ---- helpers -----------------------------------------------------------------------------------

def tiny(arch, **kw):
    c = fnn.ForgettingTransformerConfig(vocab_size=53, hidden_size=32, num_hidden_layers=2,
                                        num_heads=4, **kw).preset(arch)
    c.intermediate_size = 48
    return c


def randomized(model, scale=0.3):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


def same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


# ---- round trips -------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_save_and_load_pretrained(arch, tmp_path):
    c = tiny(arch, num_kv_heads=2)
    a = randomized(fnn.ForgettingTransformerForCausalLM(c))
    a.save_pretrained(tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["model_type"] == "forgetting_transformer"
    assert cfg["architectures"] == ["ForgettingTransformerForCausalLM"]
    assert cfg["torch_dtype"] == "float32"
    assert cfg["use_rope"] == c.use_rope and cfg["qk_norm"] == c.qk_norm
    assert cfg["num_kv_heads"] == 2 and cfg["bos_token_id"] is None
    assert list(cfg) == sorted(cfg)

    # the plain-Python reader sees every parameter under its module name
    tensors, metadata, n = read_safetensors(tmp_path / "ckpt" / "model.safetensors")
    assert metadata == {"format": "pt"} and n % 8 == 0
    sd = a.state_dict()
    assert tensors.keys() == sd.keys()
    for k in sd:
        assert torch.equal(tensors[k], sd[k]), k

    b = fnn.ForgettingTransformerForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert type(b) is fnn.ForgettingTransformerForCausalLM
    assert fnn.config_to_json(b.config) == fnn.config_to_json(c)
    same_state(a, b)
    ids = torch.randint(0, 53, (2, 7))
    torch.testing.assert_close(a(ids), b(ids), rtol=0, atol=0)
    b.generate(ids[:, :3], max_new_tokens=2)  # a fully working model


def test_bf16_checkpoint(tmp_path):
    a = randomized(fnn.ForgettingTransformerForCausalLM(tiny("fox_pro"))).to(torch.bfloat16)
    a.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    tensors, _, _ = read_safetensors(tmp_path / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    b = fnn.ForgettingTransformerForCausalLM.from_pretrained(tmp_path)  # float32 by default
    assert all(p.dtype == torch.float32 for p in b.parameters())
    for k, v in a.state_dict().items():
        assert torch.equal(b.state_dict()[k], v.float())
    c = fnn.ForgettingTransformerForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    same_state(a, c)
    ids = torch.randint(0, 53, (2, 5))
    torch.testing.assert_close(a(ids), c(ids), rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_python_checkpoint_loads(arch, dtype, tmp_path):
    """A checkpoint as transformers + safetensors write the authors' models loads and gives the
    logits of the same weights loaded with load_state_dict."""
    c = tiny(arch)
    src = randomized(fnn.ForgettingTransformerForCausalLM(c))
    sd = {k: v.to(dtype) for k, v in src.state_dict().items()}
    write_safetensors(tmp_path / "model.safetensors", sd, metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(authors_config(c))

    model = fnn.ForgettingTransformerForCausalLM.from_pretrained(tmp_path)
    ref = fnn.ForgettingTransformerForCausalLM(c)
    ref.load_state_dict(sd)
    same_state(ref, model)
    ids = torch.randint(0, 53, (2, 9))
    torch.testing.assert_close(model(ids), ref(ids), rtol=0, atol=0)
    # the authors' bos/eos ids are read; their other keys are ignored
    assert model.config.bos_token_id == 1 and model.config.eos_token_id == 2


def test_from_pretrained_device_and_overrides(tmp_path, device):
    a = randomized(fnn.ForgettingTransformerForCausalLM(tiny("fox_pro")))
    a.save_pretrained(tmp_path)
    b = fnn.ForgettingTransformerForCausalLM.from_pretrained(tmp_path, device=device,
                                                             log_pruning_tolerance=-20.0)
    assert b.config.log_pruning_tolerance == -20.0
    assert all(p.device.type == device for p in b.parameters())
    for k, v in a.state_dict().items():
        assert torch.equal(b.state_dict()[k].cpu(), v), k


def test_safetensors_functions(tmp_path):
    t = {"w": torch.randn(3, 4), "h": torch.randn(5).half(), "b": torch.randn(2, 2).bfloat16(),
         "i": torch.arange(6).view(2, 3), "m": torch.tensor([True, False]),
         "s": torch.tensor(1.5, dtype=torch.float64), "e": torch.zeros(0, 2),
         "nc": torch.randn(4, 6).t()[1:5:2]}
    p = str(tmp_path / "t.safetensors")
    fnn.save_safetensors(p, t, {"format": "pt", "k": "v"})
    back = fnn.load_safetensors(p)
    assert back.keys() == t.keys()
    for k in t:
        assert back[k].dtype == t[k].dtype and torch.equal(back[k], t[k]), k
    assert fnn.load_safetensors_metadata(p) == {"format": "pt", "k": "v"}
    # byte-identical to the plain-Python writer (same order, padding and header text)
    write_safetensors(tmp_path / "py.safetensors", t, {"format": "pt", "k": "v"})
    assert (tmp_path / "py.safetensors").read_bytes() == (tmp_path / "t.safetensors").read_bytes()
    # and readable by the plain-Python reader
    ours, md, _ = read_safetensors(p)
    assert md == {"format": "pt", "k": "v"}
    for k in t:
        assert torch.equal(ours[k], t[k]), k


def test_config_json_functions(tmp_path):
    c = tiny("fox_pro", eos_token_id=5)
    text = fnn.config_to_json(c)
    d = json.loads(text)
    assert d["eos_token_id"] == 5 and d["hidden_ratio"] == 3.5 and d["norm_eps"] == 1e-6
    assert fnn.config_to_json(fnn.config_from_json(text)) == text
    c2 = fnn.config_from_json(authors_config(c))
    assert c2.qk_norm and c2.use_k_shift and c2.bos_token_id == 1
    (tmp_path / "config.json").write_text(text)
    assert fnn.config_to_json(fnn.load_config(str(tmp_path))) == text
    with pytest.raises(RuntimeError, match="'num_heads' must be an integer"):
        fnn.config_from_json('{"num_heads": "4"}')
    with pytest.raises(RuntimeError, match="window_size"):
        fnn.config_from_json('{"window_size": 128}')


# ---- errors ------------------------------------------------------------------------------------

def test_errors(tmp_path):
    with pytest.raises(RuntimeError, match="config.json"):
        fnn.ForgettingTransformerForCausalLM.from_pretrained(tmp_path / "nothing")
    c = tiny("fox_llama")
    a = fnn.ForgettingTransformerForCausalLM(c)
    a.save_pretrained(tmp_path)
    st = tmp_path / "model.safetensors"
    sd = {k: v for k, v in a.state_dict().items()}

    write_safetensors(st, {k: v for k, v in sd.items() if k != "model.norm.weight"})
    with pytest.raises(RuntimeError, match="missing tensor 'model.norm.weight'"):
        fnn.ForgettingTransformerForCausalLM.from_pretrained(tmp_path)

    write_safetensors(st, {**sd, "lm_head.weight": torch.zeros(53, 31)})
    with pytest.raises(RuntimeError, match="shape mismatch for tensor 'lm_head.weight'"):
        fnn.ForgettingTransformerForCausalLM.from_pretrained(tmp_path)

    write_safetensors(st, {**sd, "extra.weight": torch.zeros(2)})
    fnn.ForgettingTransformerForCausalLM.from_pretrained(tmp_path)  # ignored (a warning)
    with pytest.raises(RuntimeError, match="extra.weight"):
        fnn.ForgettingTransformerForCausalLM.from_pretrained(tmp_path, strict=True)

    write_safetensors(st, sd)
    raw = st.read_bytes()
    st.write_bytes(raw[:-10])
    with pytest.raises(RuntimeError, match="model.safetensors"):
        fnn.ForgettingTransformerForCausalLM.from_pretrained(tmp_path)
    st.write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])
    with pytest.raises(RuntimeError, match="header size"):
        fnn.ForgettingTransformerForCausalLM.from_pretrained(tmp_path)
    st.write_bytes(raw)
    (tmp_path / "config.json").write_text('{"hidden_size": 32, "vocab_size": }')
    with pytest.raises(RuntimeError, match="invalid JSON"):
        fnn.ForgettingTransformerForCausalLM.from_pretrained(tmp_path)


# ---- cross-check with the safetensors package (when installed) ---------------------------------

def test_safetensors_package_cross_check(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    c = tiny("fox_pro")
    a = randomized(fnn.ForgettingTransformerForCausalLM(c))
    sd = {k: v.contiguous() for k, v in a.state_dict().items()}
    st.save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(authors_config(c))
    b = fnn.ForgettingTransformerForCausalLM.from_pretrained(tmp_path)
    same_state(a, b)
    a.save_pretrained(tmp_path / "ours")
    theirs = st.load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert theirs.keys() == sd.keys()
    for k in sd:
        assert torch.equal(theirs[k], sd[k]), k
    # byte-identical files, mixed dtypes
    t = {"w": torch.randn(3, 4), "h": torch.randn(5).half(), "b": torch.randn(2, 2).bfloat16(),
         "i": torch.arange(6).view(2, 3), "m": torch.tensor([True, False]),
         "d": torch.randn(2, dtype=torch.float64), "n": torch.arange(3, dtype=torch.int32)}
    st.save_file(t, str(tmp_path / "pkg.safetensors"), metadata={"format": "pt"})
    fnn.save_safetensors(str(tmp_path / "fox.safetensors"), t, {"format": "pt"})
    assert (tmp_path / "pkg.safetensors").read_bytes() == (tmp_path / "fox.safetensors").read_bytes()


def test_safetensors_package_both_ways_bitwise(tmp_path):
    """Every dtype both libraries know: files of the C++ writer load in the package and files of
    the package load in C++ with identical bits, and the two writers' files are byte-identical
    (save_pretrained's model.safetensors too). The package orders several metadata keys as its
    hash map happens to (not reproducible), so byte identity is checked with one key."""
    st = pytest.importorskip("safetensors.torch")
    t = {"f64": torch.randn(2, 3, dtype=torch.float64), "f32": torch.randn(4),
         "f16": torch.randn(3).half(), "bf16": torch.randn(2, 2).bfloat16(),
         "f8e4m3": torch.randn(5).to(torch.float8_e4m3fn),
         "f8e5m2": torch.randn(5).to(torch.float8_e5m2),
         "i64": torch.arange(-3, 3), "i32": torch.arange(4, dtype=torch.int32),
         "i16": torch.arange(-2, 5, dtype=torch.int16), "i8": torch.arange(-4, 4, dtype=torch.int8),
         "u8": torch.arange(250, 256, dtype=torch.uint8), "bool": torch.tensor([True, False]),
         "scalar": torch.tensor(-0.0), "empty": torch.zeros(0, 3),
         "nan": torch.tensor([float("nan"), float("inf"), -float("inf")]),
         "strided": torch.randn(4, 6).t()[1:5:2]}
    md = {"format": "pt", "note": "héllo \"x\"\n", "a": ""}

    def same_bits(a, b):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))

    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    fnn.save_safetensors(str(ours), t, {"format": "pt"})
    st.save_file({k: v.contiguous() for k, v in t.items()}, str(theirs), metadata={"format": "pt"})
    assert ours.read_bytes() == theirs.read_bytes()
    fnn.save_safetensors(str(ours), t, md)
    st.save_file({k: v.contiguous() for k, v in t.items()}, str(theirs), metadata=md)
    for path in (ours, theirs):
        by_pkg, by_us = st.load_file(str(path)), fnn.load_safetensors(str(path))
        assert by_pkg.keys() == by_us.keys() == t.keys()
        for k in t:
            same_bits(by_pkg[k], t[k])
            same_bits(by_us[k], t[k])
    from safetensors import safe_open
    with safe_open(str(ours), framework="pt") as f:
        assert f.metadata() == md
    assert fnn.load_safetensors_metadata(str(theirs)) == md

    a = randomized(fnn.ForgettingTransformerForCausalLM(tiny("fox_pro"))).to(torch.bfloat16)
    a.save_pretrained(tmp_path / "ckpt")
    st.save_file(a.state_dict(), str(tmp_path / "pkg.safetensors"), metadata={"format": "pt"})
    assert ((tmp_path / "ckpt" / "model.safetensors").read_bytes() ==
            (tmp_path / "pkg.safetensors").read_bytes())
