"""The `fox` command line (forgetting_transformer.cli): data pipeline, config, training with
kill-and-resume, evaluation, inspection, generation and plots, on a micro config (seconds)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from forgetting_transformer import cli
from forgetting_transformer.cli import config as cfgmod
from forgetting_transformer.cli import data, plots
from forgetting_transformer.cli.train import lr_at, train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MICRO = ["--preset", "micro", "--threads", "1"]


def micro_cfg(out_dir, **kw):
    return cfgmod.build("micro", overrides={"out_dir": str(out_dir), "threads": 1, **kw})


def state(path):
    ckpt = torch.load(path, weights_only=False)
    return ckpt


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
    assert {"last.pt", "step_0000010.pt", "step_0000020.pt"} <= set(os.listdir(ck))
    assert not [f for f in os.listdir(ck) if ".tmp" in f]
    rows = [json.loads(l) for l in open(micro_run / "metrics.jsonl")]
    train_rows = [r for r in rows if not r.get("eval")]
    assert train_rows[-1]["step"] == 20 and train_rows[-1]["tokens_per_s"] > 0
    assert train_rows[-1]["fox_pro"]["loss"] < train_rows[0]["fox_pro"]["loss"]
    assert any(r.get("eval") and "val_loss" in r["transformer_pro"] for r in rows)
    ckpt = state(ck / "last.pt")
    assert ckpt["step"] == 20 and set(ckpt["models"]) == {"fox_pro", "transformer_pro"}
    assert ckpt["data_state"]["next_step"] == 20 and "optimizer" in ckpt["models"]["fox_pro"]
    # a second run into the same directory must not silently overwrite it
    with pytest.raises(SystemExit, match="--resume"):
        cli.main(["train", *MICRO, "--out-dir", str(micro_run)])


def test_stop_and_resume_is_bitwise_identical(micro_run, tmp_path):
    cfg = micro_cfg(tmp_path / "r")
    assert train(cfg, quiet=True, stop_at=13) == {"stopped_at": 13}   # dies after step 13
    assert state(tmp_path / "r" / "checkpoints" / "last.pt")["step"] == 10
    train(cfg, resume=True, quiet=True)
    assert_same_checkpoint(state(micro_run / "checkpoints" / "last.pt"),
                           state(tmp_path / "r" / "checkpoints" / "last.pt"))
    steps = [json.loads(l)["step"] for l in open(tmp_path / "r" / "metrics.jsonl")
             if not json.loads(l).get("eval")]
    assert steps == sorted(set(steps))                                  # no duplicated records


def test_sigkill_and_resume_is_bitwise_identical(tmp_path):
    """A real kill -9 in the middle of training (maybe during a checkpoint write), then --resume."""
    args = [sys.executable, "-m", "forgetting_transformer", "train", *MICRO, "--steps", "40",
            "--checkpoint-interval", "3", "--eval-interval", "0"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    full = subprocess.Popen(args + ["--out-dir", str(ref)], stdout=subprocess.DEVNULL)
    proc = subprocess.Popen(args + ["--out-dir", str(run)], stdout=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not (run / "checkpoints" / "step_0000009.pt").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = state(run / "checkpoints" / "last.pt")["step"]
    assert 6 <= killed_at < 40          # last.pt lags step_N.pt by one write at most
    subprocess.run(args + ["--out-dir", str(run), "--resume"], check=True, stdout=subprocess.DEVNULL)
    assert full.wait() == 0
    assert_same_checkpoint(state(ref / "checkpoints" / "last.pt"),
                           state(run / "checkpoints" / "last.pt"))


# ---- eval, inspect, generate, plots ----------------------------------------------------------------

def test_eval_several_checkpoints(micro_run, tmp_path):
    out = tmp_path / "eval"
    assert cli.main(["eval", str(micro_run), str(micro_run / "checkpoints" / "step_0000010.pt"),
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
