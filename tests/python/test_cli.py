"""The `fox` command line (forgetting_transformer.cli): data pipeline, config, training with
kill-and-resume, evaluation, inspection, generation and plots, on a micro config (seconds)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from forgetting_transformer import cli
from forgetting_transformer.cli import config as cfgmod
from torchrun import torchrun_train
from forgetting_transformer.cli import data, plots
from forgetting_transformer.cli.train import latest_checkpoint, load_checkpoint, lr_at, train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MICRO = ["--preset", "micro", "--threads", "1"]


def micro_cfg(out_dir, **kw):
    return cfgmod.build("micro", overrides={"out_dir": str(out_dir), "threads": 1, **kw})


def state(path):
    """A checkpoint directory, or a run directory's latest checkpoint, as one dict."""
    return load_checkpoint(str(path))


def assert_same_checkpoint(a, b):
    assert a["step"] == b["step"]
    for arch in a["models"]:
        sa, sb = a["models"][arch]["state_dict"], b["models"][arch]["state_dict"]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), f"{arch} {k} differs"
        oa, ob = a["models"][arch]["optimizer"]["state"], b["models"][arch]["optimizer"]["state"]
        for i in oa:
            for k in oa[i]:
                assert torch.equal(torch.as_tensor(oa[i][k]), torch.as_tensor(ob[i][k]))


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory):
    """One uninterrupted micro run (20 steps, checkpoints at 10 and 20)."""
    out = tmp_path_factory.mktemp("micro") / "run"
    assert cli.main(["train", *MICRO, "--out-dir", str(out)]) == 0
    return out


# ---- data ----------------------------------------------------------------------------------------

def make_tree(root, n=30):
    for i in range(n):
        sub = root / f"pkg{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"mod{i}.py").write_text(f"# file {i}\n" + f"x_{i} = {i}\n" * (5 + 7 * i))
    (root / "site-packages").mkdir()
    (root / "site-packages" / "thirdparty.py").write_text("nope\n")
    (root / "pkg0" / "__pycache__").mkdir()
    (root / "pkg0" / "__pycache__" / "cached.py").write_text("nope\n")
    (root / "pkg0" / "notes.txt").write_text("not python\n")


def test_file_listing_and_split_by_file(tmp_path):
    make_tree(tmp_path)
    files = data.list_source_files(str(tmp_path))
    assert len(files) == 30 and files == sorted(files)
    assert not any("site-packages" in f or "__pycache__" in f for f in files)
    train, val = data.split_files(files, 0.3)
    assert train and val and not set(train) & set(val) and sorted(train + val) == files
    # the split depends on the path only: stable across calls, listings and subsets
    assert data.split_files(files[::-1], 0.3)[1] == val[::-1]
    assert all(data.is_validation(f, 0.3) for f in val)
    corpus = data.ByteCorpus(root=str(tmp_path), val_fraction=0.3)
    assert corpus.train.names == train and corpus.val.names == val
    # the real standard library: split on both sides, no third-party code
    real = data.list_source_files()
    assert len(real) > 500 and not any("site-packages" in f for f in real)
    rtrain, rval = data.split_files(real, 0.05)
    assert 0.02 < len(rval) / len(real) < 0.1


def test_tokenization_and_cropping(tmp_path):
    text = "café = 'λ'\n"
    ids = data.encode(text)
    assert ids[0] == data.BOS and max(ids[1:]) < 256 and data.decode(ids) == text
    docs = data.Documents.from_texts(["a", "b"], [b"abcdef", b"xy"])
    assert docs.doc(0).tolist() == [data.BOS, *b"abcdef", data.EOS]
    assert docs.num_tokens == 8 + 4
    x, y = data.crop(docs.doc(0), 4, 1)         # authors' convention: labels[t] = next token
    assert x.tolist() == list(b"abcd") and y.tolist() == list(b"bcde")
    x, y = data.crop(docs.doc(1), 6, 0)         # short document: padded, padding ignored
    assert x.tolist() == [data.BOS, *b"xy", data.PAD, data.PAD, data.PAD]
    assert y.tolist() == [*b"xy", data.EOS, -100, -100, -100]


def test_windows_stay_inside_single_files(tmp_path):
    make_tree(tmp_path)
    corpus = data.ByteCorpus(root=str(tmp_path), val_fraction=0.3)

    def inside_one(doc_set, row_ids, row_labels):
        n = int((row_labels != -100).sum())
        seq = torch.cat([row_ids[:n], row_labels[n - 1:n]])
        hits = [d for d in range(len(doc_set))
                if any(torch.equal(doc_set.doc(d)[o:o + n + 1].long(), seq)
                       for o in range(int(doc_set.lengths[d]) - n))]
        return len(hits) >= 1

    ids, labels = corpus.train_batch(seed=3, step=7, batch_size=6, seq_len=48)
    assert ids.shape == labels.shape == (6, 48)
    assert torch.equal(labels[:, :-1][labels[:, :-1] != -100], ids[:, 1:][labels[:, :-1] != -100])
    for r in range(6):
        assert inside_one(corpus.train, ids[r], labels[r])
    again = corpus.train_batch(seed=3, step=7, batch_size=6, seq_len=48)
    assert torch.equal(again[0], ids)                                # a function of (seed, step)
    assert not torch.equal(corpus.train_batch(seed=3, step=8, batch_size=6, seq_len=48)[0], ids)
    vids, vlabels = corpus.eval_windows(64, 5)
    assert vids.shape == (5, 64) and bool((vlabels != -100).all())  # full windows, no padding
    for r in range(5):
        assert inside_one(corpus.val, vids[r], vlabels[r])


# ---- config and schedule ---------------------------------------------------------------------------

def test_config_layers(tmp_path):
    assert cfgmod.build()["preset"] == "tiny"
    y = tmp_path / "c.yaml"
    y.write_text("preset: micro\nhidden_size: 48\nlr: {fox_pro: 0.01, transformer_pro: 0.02}\n")
    c = cfgmod.build(file=str(y), overrides={"steps": 7, "seed": None})
    assert (c["preset"], c["hidden_size"], c["steps"], c["num_hidden_layers"]) == ("micro", 48, 7, 1)
    assert cfgmod.per_model(c["lr"], "transformer_pro") == 0.02
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"steps": 3}))
    assert cfgmod.build("micro", str(j))["steps"] == 3
    with pytest.raises(SystemExit, match="unknown config keys"):
        cfgmod.build(overrides={"hiden_size": 3})
    with pytest.raises(SystemExit, match="unknown preset"):
        cfgmod.build("1b")


@pytest.mark.parametrize("preset,hidden,layers,heads", [("125m", 768, 12, 12), ("360m", 1024, 24, 16),
                                                        ("760m", 1536, 24, 24)])
def test_paper_presets_construct(preset, hidden, layers, heads):
    from forgetting_transformer.nn import ForgettingTransformerForCausalLM
    c = cfgmod.build(preset)
    assert c["seq_len"] == 16384 and c["batch_size"] * c["seq_len"] == 2 ** 19
    assert c["warmup_steps"] * 2 ** 19 == 256 * 2 ** 20
    fox = cfgmod.model_config(c, "fox_pro")
    trf = cfgmod.model_config(c, "transformer_pro")
    assert (fox.hidden_size, fox.num_hidden_layers, fox.num_heads) == (hidden, layers, heads)
    assert trf.use_rope and trf.fgate_type == "none" and not fox.use_rope
    if preset == "760m":
        assert trf.num_heads == 12 and cfgmod.per_model(c["lr"], "transformer_pro") == 1e-3
    fox.num_hidden_layers = 1            # one layer is enough to check the shapes
    sd = ForgettingTransformerForCausalLM(fox).state_dict()
    assert sd["model.layers.0.attn.fgate_proj.weight"].shape == (heads, hidden)


def test_lr_schedule():
    cfg = {"warmup_steps": 10, "steps": 110, "min_lr_ratio": 0.0}
    lrs = [lr_at(s, 1.0, cfg) for s in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[60] == pytest.approx(0.5, abs=0.02) and lrs[-1] < 1e-3


# ---- training, resume ---------------------------------------------------------------------------

def test_train_writes_metrics_and_checkpoints(micro_run):
    ck = micro_run / "checkpoints"
    assert set(os.listdir(ck)) == {"last", "step_0000010", "step_0000020"}
    assert (ck / "last").read_text().strip() == "step_0000020"
    rows = [json.loads(l) for l in open(micro_run / "metrics.jsonl")]
    train_rows = [r for r in rows if not r.get("eval")]
    assert train_rows[-1]["step"] == 20 and train_rows[-1]["tokens_per_s"] > 0
    assert train_rows[-1]["fox_pro"]["loss"] < train_rows[0]["fox_pro"]["loss"]
    assert any(r.get("eval") and "val_loss" in r["transformer_pro"] for r in rows)
    ckpt = state(micro_run)
    assert ckpt["path"] == str(ck / "step_0000020") and state(ck / "step_0000010")["step"] == 10
    assert ckpt["step"] == 20 and set(ckpt["models"]) == {"fox_pro", "transformer_pro"}
    assert ckpt["data_state"]["next_step"] == 20 and "optimizer" in ckpt["models"]["fox_pro"]
    # a second run into the same directory must not silently overwrite it
    with pytest.raises(SystemExit, match="--resume"):
        cli.main(["train", *MICRO, "--out-dir", str(micro_run)])


def test_checkpoint_directory_is_hugging_face_format(micro_run):
    """Each step directory: <arch>/config.json + <arch>/model.safetensors that from_pretrained
    loads, and trainer_state.pt with everything but the weights."""
    from forgetting_transformer.nn import ForgettingTransformerForCausalLM
    step = micro_run / "checkpoints" / "step_0000020"
    assert sorted(os.listdir(step)) == ["fox_pro", "trainer_state.pt", "transformer_pro"]
    ckpt = state(step)
    rest = torch.load(step / "trainer_state.pt", weights_only=False)
    assert rest["step"] == 20 and rest["data_state"]["next_step"] == 20
    for arch in ("fox_pro", "transformer_pro"):
        assert sorted(os.listdir(step / arch)) == ["config.json", "model.safetensors"]
        assert "state_dict" not in rest["models"][arch]          # weights stored once
        assert rest["models"][arch]["optimizer"]["state"]
        model = ForgettingTransformerForCausalLM.from_pretrained(step / arch, strict=True)
        assert cfgmod.describe(model.config) == ckpt["models"][arch]["model_config"]
        sd = ckpt["models"][arch]["state_dict"]
        assert model.state_dict().keys() == sd.keys()
        assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())


def test_older_single_file_checkpoints_load(micro_run, tmp_path):
    ckpt = state(micro_run)
    (tmp_path / "old" / "checkpoints").mkdir(parents=True)
    torch.save(dict(ckpt, format="fox_torch.cli/1"), tmp_path / "old" / "checkpoints" / "last.pt")
    old = state(tmp_path / "old")
    assert old["path"] == str(tmp_path / "old" / "checkpoints" / "last.pt")
    assert_same_checkpoint(old, ckpt)


def test_stop_and_resume_is_bitwise_identical(micro_run, tmp_path):
    cfg = micro_cfg(tmp_path / "r")
    assert train(cfg, quiet=True, stop_at=13) == {"stopped_at": 13}   # dies after step 13
    assert state(tmp_path / "r")["step"] == 10
    # as if killed while writing step 12's checkpoint and the pointer: half-written temporaries
    ck = tmp_path / "r" / "checkpoints"
    stale = ck / ".tmp-step_0000012.4242"
    (stale / "fox_pro").mkdir(parents=True)
    (stale / "fox_pro" / "model.safetensors").write_bytes(b"\x10\x00\x00")
    (stale / "trainer_state.pt").write_bytes(b"PK\x03")
    (ck / "last.tmp.4242").write_text("step_00")
    assert latest_checkpoint(str(tmp_path / "r")) == str(ck / "step_0000010")
    # killed between the first directory's rename and its pointer: the newest complete directory
    os.rename(ck / "last", ck / "pointer")
    assert latest_checkpoint(str(tmp_path / "r")) == str(ck / "step_0000010")
    os.rename(ck / "pointer", ck / "last")
    train(cfg, resume=True, quiet=True)
    assert set(os.listdir(ck)) == {"last", "step_0000010", "step_0000020"}   # temporaries gone
    assert_same_checkpoint(state(micro_run), state(tmp_path / "r"))
    steps = [json.loads(l)["step"] for l in open(tmp_path / "r" / "metrics.jsonl")
             if not json.loads(l).get("eval")]
    assert steps == sorted(set(steps))                                  # no duplicated records


def test_checkpoint_activations_trains_the_same(micro_run, tmp_path):
    # Recomputing every block in the backward pass changes no bit of the run.
    out = tmp_path / "ck"
    assert cli.main(["train", *MICRO, "--checkpoint-activations", "--out-dir", str(out)]) == 0
    assert state(out)["config"]["checkpoint_activations"] is True
    assert_same_checkpoint(state(micro_run), state(out))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is on a machine without CUDA")
def test_cuda_graph_needs_cuda(tmp_path):
    with pytest.raises(SystemExit, match="--cuda-graph needs a CUDA device"):
        cli.main(["train", *MICRO, "--steps", "1", "--cuda-graph", "--out-dir",
                  str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()  # refused before anything is written


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("micro_batch", [2, 1])
def test_cuda_graph_trains_the_same(tmp_path, micro_batch):
    """--cuda-graph (one graph per micro-batch replayed, the gradients written by the first
    micro-batch's graph and added by the others') against the eager loop: the same run bit for
    bit, with and without gradient accumulation, both models, bf16 autocast."""
    flags = [*MICRO, "--device", "cuda", "--steps", "6", "--batch-size", "2",
             "--micro-batch-size", str(micro_batch), "--log-interval", "1", "--eval-interval", "3",
             "--checkpoint-interval", "3"]
    assert cli.main(["train", *flags, "--out-dir", str(tmp_path / "eager")]) == 0
    assert cli.main(["train", *flags, "--cuda-graph", "--out-dir", str(tmp_path / "graph")]) == 0
    assert state(tmp_path / "graph")["config"]["cuda_graph"] is True
    assert_same_checkpoint(state(tmp_path / "eager"), state(tmp_path / "graph"))
    eager, graph = _losses(tmp_path / "eager"), _losses(tmp_path / "graph")
    assert len(eager) == 6 and eager == graph


def test_sigkill_and_resume_is_bitwise_identical(tmp_path):
    """A real kill -9 in the middle of training (maybe during a checkpoint write), then --resume."""
    args = [sys.executable, "-m", "forgetting_transformer", "train", *MICRO, "--steps", "40",
            "--checkpoint-interval", "3", "--eval-interval", "0"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    full = subprocess.Popen(args + ["--out-dir", str(ref)], stdout=subprocess.DEVNULL)
    proc = subprocess.Popen(args + ["--out-dir", str(run)], stdout=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not (run / "checkpoints" / "step_0000009").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = state(run)["step"]
    assert 6 <= killed_at < 40          # the pointer lags step_N/ by one rename at most
    subprocess.run(args + ["--out-dir", str(run), "--resume"], check=True, stdout=subprocess.DEVNULL)
    assert full.wait() == 0
    assert_same_checkpoint(state(ref), state(run))


# ---- eval, inspect, generate, plots ----------------------------------------------------------------

def test_eval_several_checkpoints(micro_run, tmp_path):
    out = tmp_path / "eval"
    assert cli.main(["eval", str(micro_run), str(micro_run / "checkpoints" / "step_0000010"),
                     "--out-dir", str(out), "--num", "4"]) == 0
    res = json.load(open(out / "eval.json"))
    assert res["lengths"] == [16, 32, 64, 128] and res["eval_seq_len"] == 128   # up to 2x training
    assert len(res["curves"]) == 4                       # 2 checkpoints x 2 models
    c = res["curves"][0]
    assert len(c["per_token_loss"]) == 128 and all(v > 0 for v in c["per_token_loss"])
    assert set(c["loss_by_length"]) == {"16", "32", "64", "128"}
    if plots.pyplot() is not None:
        assert os.path.getsize(out / "per_token_loss.png") > 1000
        assert os.path.getsize(out / "loss_by_length.png") > 1000


def test_eval_without_matplotlib_writes_json(micro_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(plots, "_warned", False)
    from forgetting_transformer.cli.evaluate import evaluate
    res = evaluate([str(micro_run)], out_dir=str(tmp_path), num=2, lengths="16,32", quiet=True)
    assert res["files"] == [str(tmp_path / "eval.json")]
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_inspect_and_generate(micro_run, tmp_path, capsys):
    out = tmp_path / "inspect"
    assert cli.main(["inspect", str(micro_run), "--out-dir", str(out), "--seq-len", "32"]) == 0
    res = json.load(open(out / "inspect.json"))
    fox, trf = res["models"]["fox_pro"], res["models"]["transformer_pro"]
    assert fox["logits_max_abs_diff_vs_model"] < 1e-4 and trf["logits_max_abs_diff_vs_model"] < 1e-4
    heads = fox["layers"][0]["heads"]
    assert len(heads) == 2 and all(h["class"] in ("local", "global") for h in heads)
    assert all(0 < h["mean_f"] < 1 and h["decay_length"] > 0 for h in heads)
    assert "layers" not in trf
    p = res["params"]
    assert p["fox_pro"]["forget_gate"] == 2 * 32 + 2 and p["transformer_pro"]["forget_gate"] == 0
    assert p["fox_pro"]["total"] - p["transformer_pro"]["total"] == 66
    if plots.pyplot() is not None:
        assert (out / "fgate_matrix_fox_pro_layer0.png").exists()
        assert (out / "attention_transformer_pro_layer0.png").exists()
    capsys.readouterr()
    assert cli.main(["generate", str(micro_run), "--prompt", "import ", "--max-new-tokens", "8",
                     "--greedy"]) == 0
    text = capsys.readouterr().out
    assert "===== fox_pro" in text and "===== transformer_pro" in text and "import " in text


def test_run_writes_report(tmp_path):
    out = tmp_path / "run"
    assert cli.main(["run", *MICRO, "--steps", "6", "--out-dir", str(out), "--eval-num", "2"]) == 0
    report = (out / "report" / "report.md").read_text()
    assert "Per-token loss" in report and "fox_pro" in report and "transformer_pro" in report
    assert (out / "report" / "eval.json").exists() and (out / "report" / "inspect.json").exists()
    if plots.pyplot() is not None:
        assert (out / "report" / "per_token_loss.png").exists()
        assert (out / "report" / "training.png").exists()


def test_python_m_dispatch():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-m", "forgetting_transformer", "train", "--print-config",
                        "--steps", "5"], capture_output=True, text=True, env=env, check=True)
    cfg = json.loads(r.stdout)
    assert cfg["preset"] == "tiny" and cfg["steps"] == 5 and cfg["models"] == ["fox_pro", "transformer_pro"]
    r = subprocess.run([sys.executable, "-m", "forgetting_transformer", "demo", "--seqlen", "64",
                        "--batch", "1", "--heads", "2", "--head-dim", "16"],
                       capture_output=True, text=True, env=env, check=True)
    assert "max |error|" in r.stdout


# ---- other data: --data-dir, --tokens ----------------------------------------------------------------

def test_data_dir_and_token_files(tmp_path):
    import numpy as np
    make_tree(tmp_path / "texts")
    cfg = micro_cfg(tmp_path / "r1", data_dir=str(tmp_path / "texts"), max_files=None)
    corpus = data.make_corpus(cfg)
    names = corpus.train.names + corpus.val.names
    assert "pkg0/notes.txt" in names and len(names) == 31            # every file, not only *.py
    assert not set(corpus.train.names) & set(corpus.val.names) and corpus.val.names
    assert not any("site-packages" in n or "__pycache__" in n for n in names)
    train(dict(cfg, steps=2, eval_interval=0), quiet=True)
    assert state(tmp_path / "r1")["config"]["data_dir"] == cfg["data_dir"]

    ids = np.random.default_rng(0).integers(0, 1000, size=30000)
    np.save(tmp_path / "ids.npy", ids.astype(np.int64))
    ids.astype("<u2").tofile(tmp_path / "ids.bin")
    a = data.make_corpus(dict(cfg, data_dir=None, tokens=str(tmp_path / "ids.npy")))
    b = data.make_corpus(dict(cfg, data_dir=None, tokens=str(tmp_path / "ids.bin"),
                              token_dtype="uint16"))
    assert a.max_id == b.max_id == int(ids.max()) and a.train.names == b.train.names
    assert a.val.names and not set(a.train.names) & set(a.val.names)
    assert a.train.num_tokens + a.val.num_tokens == 30000
    assert torch.equal(a.train.tokens, b.train.tokens)
    x, y = a.train_batch(0, 0, 3, 64)
    assert x.shape == (3, 64) and torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 1000
    with pytest.raises(SystemExit, match="token-dtype"):
        data.make_corpus(dict(cfg, data_dir=None, tokens=str(tmp_path / "ids.bin")))
    out = tmp_path / "r2"
    assert cli.main(["train", *MICRO, "--steps", "2", "--eval-interval", "0", "--tokens",
                     str(tmp_path / "ids.npy"), "--out-dir", str(out)]) == 0
    ck = state(out)
    assert ck["config"]["vocab_size"] == int(ids.max()) + 1                 # widened to the ids
    from forgetting_transformer.cli.evaluate import evaluate
    res = evaluate([str(out)], out_dir=str(tmp_path / "ev"), num=2, lengths="32", quiet=True)
    assert res["curves"][0]["loss_by_length"]["32"] > 0


# ---- synthetic tasks: needle in a haystack, MQAR ----------------------------------------------------

class _Oracle(torch.nn.Module):
    """Logits that answer the needle and MQAR tasks perfectly, by reading the input."""

    def __init__(self, task):
        super().__init__()
        self.task = task

    def forward(self, x):
        import re
        logits = torch.zeros(*x.shape, data.VOCAB_SIZE)
        for b, row in enumerate(x.tolist()):
            if self.task == "mqar":
                seen = {}
                for t in range(1, len(row)):
                    if t % 2 == 1 and t + 1 < len(row) and row[t] not in seen:
                        seen[row[t]] = row[t + 1]
                    elif t % 2 == 1 and row[t] in seen:
                        logits[b, t, seen[row[t]]] = 1
                continue
            text = bytes(v for v in row[1:]).decode()
            key, value = re.search(r"The secret number of (\w+) is (\d+)\.", text).groups()
            p = text.rfind(f"The secret number of {key} is ") + len(f"The secret number of {key} is ")
            for j, ch in enumerate(value):
                logits[b, p + j, ord(ch)] = 1           # position p+j (BOS offset) predicts value[j]
        return logits


def test_needle_and_mqar_generators(tmp_path):
    from forgetting_transformer.cli import tasks
    import numpy as np
    corpus = data.ByteCorpus(val_fraction=0.05, max_files=40)
    hay = tasks.haystack_text(corpus)
    rng = np.random.default_rng(0)
    for depth in (0.0, 0.5, 1.0):
        ids, labels, value = tasks.needle_sample(hay, 256, depth, rng)
        assert ids.shape == labels.shape == (256 + len(value) - 1,) and ids[0] == data.BOS
        ans = labels[labels != -100]
        assert data.decode(ans.tolist()) == value and int((labels != -100).sum()) == len(value)
        text = data.decode(ids.tolist())
        at = text.index(" The secret number of")
        key = text[at:].split()[4]
        n_hay = 255 - len(tasks.NEEDLE.format(key=key, value=value)) - \
            len(tasks.QUESTION.format(key=key))
        assert at == round(depth * n_hay)                                  # needle at the depth
        assert text.endswith(" is " + value[:-1])
    with pytest.raises(ValueError, match="too short"):
        tasks.needle_sample(hay, 60, 0.5, rng)
    models = {"oracle": _Oracle("needle"), "blank": torch.nn.Module()}
    models["blank"].forward = lambda x: torch.zeros(*x.shape, data.VOCAB_SIZE)
    grid = tasks.needle_grid(models, corpus, [128, 200], [0, 0.5, 1], num=3)
    assert grid["models"]["oracle"]["exact_match"] == [[1.0] * 3] * 2
    assert grid["models"]["blank"]["exact_match"] == [[0.0] * 3] * 2
    if plots.pyplot() is not None:
        assert os.path.getsize(plots.plot_needle(grid, str(tmp_path / "n.png"))) > 1000

    ids, labels = tasks.mqar_batch(4, 8, seed=1)
    assert ids.shape == (4, 32) and int((labels != -100).sum()) == 4 * 8
    row, lab = ids[0].tolist(), labels[0].tolist()
    pairs = dict(zip(row[1:17:2], row[2:17:2]))
    assert len(pairs) == 8 and all(lab[t] == pairs[row[t]] for t in range(17, 32, 2))
    assert torch.equal(tasks.mqar_batch(4, 8, seed=1)[0], ids)            # deterministic
    res = tasks.mqar_eval({"oracle": _Oracle("mqar")}, [2, 8], num=3)
    assert all(v["accuracy"] == 1.0 and v["exact_match"] == 1.0
               for v in res["models"]["oracle"].values())


def test_eval_needle_and_mqar_cli(micro_run, tmp_path):
    out = tmp_path / "tasks"
    assert cli.main(["eval", str(micro_run), "--needle", "--mqar", "--lengths", "128,192",
                     "--depths", "0,0.5,1", "--pairs", "2,4", "--num", "2",
                     "--out-dir", str(out)]) == 0
    grid = json.load(open(out / "needle.json"))
    assert grid["lengths"] == [128, 192] and grid["depths"] == [0.0, 0.5, 1.0]
    for arch in ("fox_pro", "transformer_pro"):
        em = grid["models"][arch]["exact_match"]
        assert len(em) == 2 and all(len(r) == 3 and all(0 <= v <= 1 for v in r) for r in em)
    mq = json.load(open(out / "mqar.json"))
    assert set(mq["models"]["fox_pro"]) == {"2", "4"}
    if plots.pyplot() is not None:
        assert os.path.getsize(out / "needle.png") > 1000


# ---- data parallel (FSDP2: test_fsdp.py), TensorBoard --------------------------------------------

def _losses(run):
    rows = [json.loads(l) for l in open(run / "metrics.jsonl")]
    return [(r["step"], r["fox_pro"]["loss"], r["transformer_pro"]["loss"]) for r in rows
            if not r.get("eval")]


def test_torchrun_ddp_matches_single_process(tmp_path):
    """2 CPU processes (gloo) on the same global batch as 1 process: the same losses."""
    flags = [*MICRO, "--device", "cpu", "--steps", "6", "--batch-size", "4", "--micro-batch-size", "1",
             "--log-interval", "1", "--eval-interval", "0", "--checkpoint-interval", "3"]
    r = torchrun_train([*flags, "--out-dir", str(tmp_path / "ddp")], timeout=120)
    assert "data parallel over 2 processes" in r.stdout
    assert cli.main(["train", *flags, "--out-dir", str(tmp_path / "one")]) == 0
    ddp, one = _losses(tmp_path / "ddp"), _losses(tmp_path / "one")
    assert [s for s, _, _ in ddp] == list(range(1, 7))                 # rank 0 alone wrote them
    for a, b in zip(ddp, one):
        assert a[0] == b[0] and a[1] == pytest.approx(b[1], abs=2e-4) and \
            a[2] == pytest.approx(b[2], abs=2e-4)
    ca, cb = state(tmp_path / "ddp"), state(tmp_path / "one")
    assert ca["step"] == cb["step"] == 6
    for arch in ca["models"]:
        for k, v in ca["models"][arch]["state_dict"].items():
            assert torch.allclose(v, cb["models"][arch]["state_dict"][k], atol=1e-4), k
    assert json.load(open(tmp_path / "ddp" / "run_info.json"))["world_size"] == 2


@pytest.mark.parametrize("nproc,cp,layout,extra", [(2, 2, "zigzag", []),
                                                (4, 2, "contiguous", []),
                                                (4, 2, "zigzag", ["--fsdp"])])
def test_torchrun_context_parallel_matches_single_process(tmp_path, nproc, cp, layout, extra):
    """Every sequence split over `cp` CPU processes (gloo), alone or with data parallel (DDP,
    FSDP2) over the rest: the same losses and weights as one process on the same global batch, and a resumed
    run ends where an uninterrupted one does."""
    flags = [*MICRO, "--device", "cpu", "--steps", "4", "--batch-size", "2",
             "--micro-batch-size", "1", "--log-interval", "1", "--eval-interval", "2",
             "--checkpoint-interval", "2"]
    cp_flags = ["--context-parallel", str(cp), "--context-parallel-layout", layout, *extra]
    r = torchrun_train([*flags, *cp_flags, "--out-dir", str(tmp_path / "cp")], timeout=240,
                       nproc=nproc)
    assert f"every sequence split over {cp} of them ({layout})" in r.stdout
    assert cli.main(["train", *flags, "--out-dir", str(tmp_path / "one")]) == 0
    cp_losses, one = _losses(tmp_path / "cp"), _losses(tmp_path / "one")
    assert [s for s, _, _ in cp_losses] == list(range(1, 5))
    for a, b in zip(cp_losses, one):
        assert a[0] == b[0] and a[1] == pytest.approx(b[1], abs=2e-4) and \
            a[2] == pytest.approx(b[2], abs=2e-4)
    val = lambda run: [json.loads(l) for l in open(run / "metrics.jsonl") if '"eval"' in l]  # noqa: E731
    assert len(val(tmp_path / "cp")) == 2
    for a, b in zip(val(tmp_path / "cp"), val(tmp_path / "one")):
        assert a["fox_pro"]["val_loss"] == pytest.approx(b["fox_pro"]["val_loss"], abs=2e-4)
    ca, cb = state(tmp_path / "cp"), state(tmp_path / "one")
    assert ca["step"] == cb["step"] == 4
    for arch in ca["models"]:
        for k, v in ca["models"][arch]["state_dict"].items():
            assert torch.allclose(v, cb["models"][arch]["state_dict"][k], atol=1e-4), k
    info = json.load(open(tmp_path / "cp" / "run_info.json"))
    assert info["world_size"] == nproc and info["context_parallel"] == cp
    if nproc == 2:   # resume the context-parallel run from its step-2 checkpoint
        shutil.rmtree(tmp_path / "cp" / "checkpoints" / "step_0000004")
        (tmp_path / "cp" / "checkpoints" / "last").write_text("step_0000002")
        torchrun_train([*flags, *cp_flags, "--out-dir", str(tmp_path / "cp"), "--resume"],
                       timeout=240, nproc=nproc)
        cr = state(tmp_path / "cp")
        for arch in cr["models"]:
            for k, v in cr["models"][arch]["state_dict"].items():
                assert torch.allclose(v, ca["models"][arch]["state_dict"][k], atol=1e-5), k


@pytest.mark.parametrize("world", [None, "2"])
def test_console_main_skips_finalization_only_under_torchrun(monkeypatch, world):
    """A torchrun rank leaves through os._exit with main()'s code (gloo's threads must not meet a
    finalizing interpreter); a plain process returns the code to sys.exit."""
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    monkeypatch.setattr(cli, "main", lambda: 3)
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    assert cli.console_main() == 3
    assert exits == ([] if world is None else [3])


def test_tensorboard_events(tmp_path, monkeypatch):
    pytest.importorskip("torch.utils.tensorboard")
    out = tmp_path / "tb"
    assert cli.main(["train", *MICRO, "--steps", "3", "--log-interval", "1", "--out-dir", str(out)]) == 0
    events = [f for f in os.listdir(out / "tensorboard") if f.startswith("events.out.tfevents")]
    assert events and os.path.getsize(out / "tensorboard" / events[0]) > 100
    # without tensorboard: nothing written, no error
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    out2 = tmp_path / "tb2"
    assert cli.main(["train", *MICRO, "--steps", "2", "--out-dir", str(out2)]) == 0
    assert not (out2 / "tensorboard").exists()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("mode", ["ddp", "fsdp", "context_parallel"])
def test_torchrun_two_gpus(tmp_path, mode):
    """2 GPUs (nccl) under torchrun, DDP, FSDP2 or every sequence split over both (context
    parallel, zigzag), against 1 GPU on the same global batch: the same losses (float32: only
    the reduction order differs)."""
    flags = [*MICRO, "--device", "cuda", "--dtype", "fp32", "--steps", "6", "--batch-size", "4",
             "--micro-batch-size", "1", "--log-interval", "1", "--eval-interval", "0",
             "--checkpoint-interval", "3"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    extra = {"ddp": [], "fsdp": ["--fsdp"],
             "context_parallel": ["--context-parallel", "2", "--context-parallel-layout",
                                  "zigzag"]}[mode]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_addr", "127.0.0.1", "--master_port", str(port),
                        "-m", "forgetting_transformer", "train", *flags, *extra,
                        "--out-dir", str(tmp_path / mode)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert cli.main(["train", *flags, "--out-dir", str(tmp_path / "one")]) == 0
    many, one = _losses(tmp_path / mode), _losses(tmp_path / "one")
    assert [s for s, _, _ in many] == list(range(1, 7))
    for a, b in zip(many, one):
        assert a[1] == pytest.approx(b[1], abs=1e-3) and a[2] == pytest.approx(b[2], abs=1e-3)
    assert many[-1][1] < many[0][1]  # it learns
    assert json.load(open(tmp_path / mode / "run_info.json"))["world_size"] == 2


def test_context_parallel_bad_settings(tmp_path):
    """A layout that does not exist, or more context-parallel ranks than processes: clear exits."""
    with pytest.raises(SystemExit, match="context_parallel_layout must be"):
        cli.main(["train", *MICRO, "--steps", "1", "--context-parallel-layout", "ring",
                  "--out-dir", str(tmp_path / "a")])
    with pytest.raises(SystemExit, match="does not divide the number of processes 1"):
        cli.main(["train", *MICRO, "--steps", "1", "--context-parallel", "2",
                  "--out-dir", str(tmp_path / "b")])
