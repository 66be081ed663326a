"""Corrupted checkpoints: a valid tiny checkpoint (model.safetensors + config.json) corrupted many
ways (truncation, byte flips, header length fields, JSON mutations of the safetensors header and
of config.json) must load or raise RuntimeError naming the file; never crash or hang. Seeded, a
few seconds."""
import json
import random
import struct

import pytest
import torch

from forgetting_transformer import nn as fnn

Model = fnn.ForgettingTransformerForCausalLM


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, model.safetensors bytes, config.json text) of a tiny fox_pro model."""
    c = fnn.ForgettingTransformerConfig(vocab_size=11, hidden_size=8, num_hidden_layers=1,
                                        num_heads=2).preset("fox_pro")
    c.intermediate_size = 8
    d = tmp_path_factory.mktemp("fuzz_ckpt")
    Model(c).save_pretrained(d)
    return d, (d / "model.safetensors").read_bytes(), (d / "config.json").read_text()


def split(raw):
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8:8 + n], raw[8 + n:]


def join(header, data):
    return struct.pack("<Q", len(header)) + header + data


def loads_or_fails_cleanly(path, load):
    """True when `load` succeeds, False on a RuntimeError that names the file; anything else
    (another exception type, a message without the file) fails the test."""
    try:
        load()
        return True
    except RuntimeError as e:
        assert path.name in str(e), str(e)
        return False


def check_weights(d, raw, load=None):
    p = d / "model.safetensors"
    p.write_bytes(raw)
    return loads_or_fails_cleanly(p, load or (lambda: fnn.load_safetensors(str(p))))


def mutate_value(rng, v):
    """A random replacement of a JSON value: another type, a boundary number or a changed one."""
    choices = [None, True, False, -1, 0, 1, 3, 2**63, 2**64, -(2**63) - 1, 1.5, -0.0, 1e300, "",
               "F32", "x" * 40, [], [0], [1, 2, 3], [-1, 8], [8, 0], [0, 2**64], {}, {"a": 1}]
    if isinstance(v, list) and v and rng.random() < 0.5:
        v = list(v)
        i = rng.randrange(len(v))
        v[i] = mutate_value(rng, v[i])
        return v
    if isinstance(v, int) and not isinstance(v, bool) and rng.random() < 0.5:
        return v + rng.choice([-8, -4, -1, 1, 2, 4, 8])
    return rng.choice(choices)


def mutate_object(rng, obj):
    """Changes, deletes, adds or renames one member somewhere in a JSON object tree."""
    obj = json.loads(json.dumps(obj))
    node = obj
    while isinstance(node, dict) and node and rng.random() < 0.6:
        k = rng.choice(list(node))
        if not isinstance(node[k], dict):
            break
        node = node[k]
    if not isinstance(node, dict) or not node:
        return mutate_value(rng, node)
    k = rng.choice(list(node))
    action = rng.randrange(4)
    if action == 0:
        node[k] = mutate_value(rng, node[k])
    elif action == 1:
        del node[k]
    elif action == 2:
        node[k + "_"] = mutate_value(rng, node[k])
    else:
        node[rng.choice(["__metadata__", "dtype", "shape", "data_offsets", ""])] = node.pop(k)
    return obj


def test_truncated_weights(checkpoint):
    d, raw, _ = checkpoint
    header, _ = split(raw)
    # every length through the header and a little beyond, then a stride through the data
    lengths = list(range(0, 8 + len(header) + 64)) + list(range(8 + len(header) + 64, len(raw), 97))
    assert not any(check_weights(d, raw[:n]) for n in lengths)
    assert check_weights(d, raw)


def test_byte_flips(checkpoint):
    d, raw, _ = checkpoint
    rng = random.Random(1)
    header, _ = split(raw)
    for t in range(600):
        b = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            # mostly in the length field and the header, where the structure is
            i = rng.randrange(len(b) if t % 4 == 0 else 8 + len(header))
            b[i] = rng.randrange(256) if rng.random() < 0.5 else b[i] ^ (1 << rng.randrange(8))
        check_weights(d, bytes(b))


def test_header_length_field(checkpoint):
    d, raw, _ = checkpoint
    header, _ = split(raw)
    n = len(header)
    for value in [2**64 - 1, 2**63, 2**40, 100_000_001, len(raw), len(raw) - 7, n + 1, n - 1,
                  n + 8, n - 8, 0, 1, 2]:
        assert not check_weights(d, struct.pack("<Q", value) + raw[8:]), value
    assert not check_weights(d, raw[:8])  # a length and nothing else


def test_header_json_mutations(checkpoint):
    d, raw, _ = checkpoint
    header, data = split(raw)
    parsed = json.loads(header)
    rng = random.Random(2)
    loaded = 0
    for t in range(500):
        h = json.dumps(mutate_object(rng, parsed), separators=(",", ":")).encode()
        h += b" " * (-len(h) % 8)
        loaded += check_weights(d, join(h, data))
    # text-level damage the structural mutations cannot make
    text = header.decode()
    for t in range(300):
        i, j = rng.randrange(len(text)), rng.randrange(len(text))
        edits = [text[:i] + text[i + 1:], text[:i] + text[j] + text[i:],
                 text[:i] + rng.choice('{}[]",:-0e.\\') + text[i + 1:],
                 text[:i] + "[" * 300 + text[i:],
                 text[:1] + text[1:j] + "," + text[1:j] + text[j:]]  # repeated keys
        check_weights(d, join(rng.choice(edits).encode(), data))
    assert loaded < 500  # the mutations do break files


def test_overlapping_and_out_of_range_offsets(checkpoint):
    d, raw, _ = checkpoint
    header, data = split(raw)
    parsed = json.loads(header)
    names = [k for k in parsed if k != "__metadata__"]
    for name in names:
        b, e = parsed[name]["data_offsets"]
        for offsets in ([b + 1, e + 1], [b - 1, e - 1] if b else [0, 0], [b, e + len(data)],
                        [e, b], [0, e - b], [2**64 - 1, 2**64 - 1 + e - b]):
            h = dict(parsed, **{name: dict(parsed[name], data_offsets=offsets)})
            text = json.dumps(h, separators=(",", ":")).encode()
            if offsets == [b, e]:
                continue
            assert not check_weights(d, join(text, data)), (name, offsets)


def test_corrupted_config(checkpoint):
    """config.json truncated at every length, byte flips, JSON mutations: from_pretrained loads
    or raises RuntimeError naming config.json (or a model error for an odd but valid config)."""
    d, raw, text = checkpoint
    (d / "model.safetensors").write_bytes(raw)
    cfg_path = d / "config.json"
    cfg = json.loads(text)
    rng = random.Random(3)

    def attempt(new_text):
        cfg_path.write_text(new_text, errors="surrogateescape")
        try:
            Model.from_pretrained(d)
        except RuntimeError:
            pass

    for n in range(len(text.rstrip())):  # cut before the closing brace
        cfg_path.write_text(text[:n])
        with pytest.raises(RuntimeError, match="config.json"):
            Model.from_pretrained(d)
    for _ in range(300):
        b = bytearray(text.encode())
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        attempt(b.decode(errors="surrogateescape"))
    small = [-1, 0, 1, 2, 3, 4, 1.5, 1e-6, True, None, "x", [], {}, [1, 2]]
    for _ in range(300):
        c = dict(cfg)
        k = rng.choice(list(c))
        if rng.random() < 0.2:
            del c[k]
        else:
            c[k] = rng.choice(small)
        attempt(json.dumps(c, indent=2))
    cfg_path.write_text(text)
    Model.from_pretrained(d)


def test_invalid_utf8_in_header(checkpoint):
    """The parser's message quotes the bytes around the error: still a RuntimeError (the message
    is escaped to valid UTF-8), not a UnicodeDecodeError."""
    d, raw, _ = checkpoint
    header, data = split(raw)
    i = header.index(b'"dtype"') + 2
    for bad in (b"\xc7", b"\xff\xfe", b"\xe2\x82", b"\x00", b"\x1f"):
        p = d / "model.safetensors"
        p.write_bytes(join(header[:i] + bad + header[i + len(bad):], data))
        with pytest.raises(RuntimeError, match="model.safetensors.*invalid JSON"):
            fnn.load_safetensors(str(p))
