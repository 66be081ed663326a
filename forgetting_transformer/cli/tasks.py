"""Synthetic long-context tasks, generated on the fly (a pure function of the seed).

* Needle in a haystack: ``The secret number of <key> is <value>.`` hidden at a chosen depth
  (0 = start, 1 = just before the question) inside haystack text taken from the validation files,
  then the question ``What is the secret number of <key>? The secret number of <key> is``; the
  model must produce ``<value>``. Scored by exact match of the greedy answer (computed with one
  teacher-forced forward: greedy decoding reproduces the value iff the argmax is right at every
  answer position). Byte-level data only.
* Multi-query associative recall (MQAR, Arora et al. 2023, "Zoology"): ``k1 v1 k2 v2 ... kn vn``
  then queries ``q1 a1 q2 a2 ...`` where every q is one of the keys and a its value; keys and values
  come from two disjoint token ranges. Scored by accuracy at the answer positions (argmax) and by
  the exact match of whole sequences.

``fox eval CKPT --needle`` writes needle.json and needle.png (accuracy heatmap, context length x
depth); ``fox eval CKPT --mqar`` writes mqar.json.
"""
import json
import os
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .data import BOS, EOS, IGNORE_INDEX, ByteCorpus, make_corpus

NEEDLE = " The secret number of {key} is {value}. "
QUESTION = "\nWhat is the secret number of {key}? The secret number of {key} is "
VALUE_DIGITS = 5
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _key_value(rng) -> Tuple[str, str]:
    key = "".join(chr(c) for c in rng.integers(ord("a"), ord("z") + 1, size=6))
    value = str(int(rng.integers(10 ** (VALUE_DIGITS - 1), 10 ** VALUE_DIGITS)))
    return key, value


def min_needle_length() -> int:
    k, v = "x" * 6, "9" * VALUE_DIGITS
    return 1 + len(NEEDLE.format(key=k, value=v)) + len(QUESTION.format(key=k)) + 16


def haystack_text(corpus: ByteCorpus) -> np.ndarray:
    """The validation files back to back (bytes, BOS/EOS dropped, files separated by a newline)."""
    if not getattr(corpus, "byte_level", True):
        raise SystemExit("the needle task needs byte-level text data (not --tokens)")
    t = corpus.val.tokens.numpy()
    t = t[(t >= 0) & (t < 256) | (t == EOS)].copy()
    t[t == EOS] = ord("\n")
    return t.astype(np.int64)


def needle_sample(hay: np.ndarray, ctx_len: int, depth: float, rng):
    """(ids (L,), labels (L,), value) of one needle sample whose prompt (BOS ... "is ") is exactly
    ``ctx_len`` tokens; ids/labels follow the training convention (labels[t] = ids[t+1]) and only the
    answer positions carry labels. L = ctx_len + len(value) - 1."""
    key, value = _key_value(rng)
    needle = np.frombuffer(NEEDLE.format(key=key, value=value).encode(), np.uint8).astype(np.int64)
    question = np.frombuffer(QUESTION.format(key=key).encode(), np.uint8).astype(np.int64)
    ans = np.frombuffer(value.encode(), np.uint8).astype(np.int64)
    n_hay = ctx_len - 1 - len(needle) - len(question)
    if n_hay < 16:
        raise ValueError(f"context length {ctx_len} is too short for the needle task "
                         f"(at least {min_needle_length()})")
    reps = -(-(n_hay + 1) // max(1, len(hay)))
    src = np.tile(hay, reps) if reps > 1 else hay
    start = int(rng.integers(0, len(src) - n_hay + 1))
    h = src[start:start + n_hay]
    at = int(round(float(depth) * n_hay))
    seq = np.concatenate([[BOS], h[:at], needle, h[at:], question, ans])
    assert len(seq) == ctx_len + len(ans)
    ids = torch.from_numpy(seq[:-1].copy())
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[ctx_len - 1:] = torch.from_numpy(ans)
    return ids, labels, value


def mqar_batch(num: int, num_pairs: int, num_queries: Optional[int] = None, seed: int = 0,
               token_range: Tuple[int, int] = (33, 127)):
    """(ids, labels) of ``num`` MQAR sequences, (num, 2 * (pairs + queries)) each: BOS, the pairs,
    then the queries; labels only at the query positions (the value). Keys come from the lower
    half of ``token_range`` and values from the upper half (default: printable ASCII)."""
    lo, hi = token_range
    half = (hi - lo) // 2
    keys_vocab, vals_vocab = np.arange(lo, lo + half), np.arange(lo + half, lo + 2 * half)
    q = num_pairs if num_queries is None else num_queries
    if num_pairs > half or q > num_pairs:
        raise ValueError(f"MQAR: {num_pairs} pairs / {q} queries with {half} distinct keys")
    rng = np.random.default_rng([seed, num_pairs, q])
    L = 1 + 2 * num_pairs + 2 * q
    ids = torch.empty(num, L - 1, dtype=torch.long)
    labels = torch.full((num, L - 1), IGNORE_INDEX, dtype=torch.long)
    for b in range(num):
        keys = rng.choice(keys_vocab, num_pairs, replace=False)
        vals = rng.choice(vals_vocab, num_pairs, replace=True)
        order = rng.choice(num_pairs, q, replace=False)
        seq = np.empty(L, np.int64)
        seq[0] = BOS
        seq[1:1 + 2 * num_pairs:2], seq[2:2 + 2 * num_pairs:2] = keys, vals
        base = 1 + 2 * num_pairs
        seq[base::2], seq[base + 1::2] = keys[order], vals[order]
        ids[b] = torch.from_numpy(seq[:-1])
        lab = torch.full((L - 1,), IGNORE_INDEX, dtype=torch.long)
        lab[base::2] = torch.from_numpy(vals[order])       # position of q_j predicts a_j
        labels[b] = lab
    return ids, labels


@torch.no_grad()
def answer_scores(model, ids, labels, device, autocast, batch_size: int = 8):
    """Per sequence: (all answer positions right (exact match), fraction right, mean answer loss)."""
    exact, frac, loss = [], [], []
    for i in range(0, ids.shape[0], batch_size):
        x, y = ids[i:i + batch_size].to(device), labels[i:i + batch_size].to(device)
        with autocast():
            logits = model(x).float()
        mask = y != IGNORE_INDEX
        right = (logits.argmax(-1) == y) & mask
        n = mask.sum(1).clamp(min=1)
        lp = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y.clamp(min=0),
                                               reduction="none")
        exact += (right.sum(1) == mask.sum(1)).cpu().tolist()
        frac += (right.sum(1).float() / n).cpu().tolist()
        loss += ((lp * mask).sum(1) / n).cpu().tolist()
    return exact, frac, loss


def needle_grid(models: Dict[str, torch.nn.Module], corpus: ByteCorpus, lengths: Sequence[int],
                depths: Sequence[float] = DEFAULT_DEPTHS, num: int = 8, seed: int = 0,
                device="cpu", autocast=None) -> Dict:
    """{"lengths", "depths", "models": {label: {"exact_match": [[acc per depth] per length],
    "answer_loss": ...}}}. The same samples (keys, values, haystack offsets) for every model."""
    import contextlib
    autocast = autocast or contextlib.nullcontext
    hay = haystack_text(corpus)
    cells = {}
    for li, L in enumerate(lengths):
        for di, d in enumerate(depths):
            rng = np.random.default_rng([seed, int(L), di])
            s = [needle_sample(hay, int(L), d, rng) for _ in range(num)]
            cells[(li, di)] = (torch.stack([a for a, _, _ in s]), torch.stack([b for _, b, _ in s]))
    out = {}
    for label, model in models.items():
        em = [[0.0] * len(depths) for _ in lengths]
        al = [[0.0] * len(depths) for _ in lengths]
        for (li, di), (ids, labels) in cells.items():
            exact, _, loss = answer_scores(model, ids, labels, device, autocast)
            em[li][di] = float(np.mean(exact))
            al[li][di] = float(np.mean(loss))
        out[label] = {"exact_match": em, "answer_loss": al}
    return {"lengths": [int(l) for l in lengths], "depths": [float(d) for d in depths],
            "samples_per_cell": num, "models": out,
            "note": "exact_match[i][j]: fraction of samples of context length lengths[i] (prompt "
                    "tokens) with the needle at depths[j] whose greedy answer equals the value"}


def mqar_eval(models: Dict[str, torch.nn.Module], pairs: Sequence[int], num: int = 32,
              seed: int = 0, device="cpu", autocast=None) -> Dict:
    import contextlib
    autocast = autocast or contextlib.nullcontext
    data = {n: mqar_batch(num, n, seed=seed) for n in pairs}
    out = {}
    for label, model in models.items():
        res = {}
        for n, (ids, labels) in data.items():
            exact, frac, loss = answer_scores(model, ids, labels, device, autocast)
            res[str(n)] = {"accuracy": float(np.mean(frac)), "exact_match": float(np.mean(exact)),
                           "answer_loss": float(np.mean(loss)), "seq_len": int(ids.shape[1])}
        out[label] = res
    return {"pairs": [int(n) for n in pairs], "sequences": num, "models": out,
            "note": "accuracy: fraction of queries answered right (argmax); exact_match: fraction "
                    "of sequences with every query right"}


def _write_json(obj, path):
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)


def run_tasks(checkpoints: Sequence[str], out_dir: Optional[str] = None, needle: bool = False,
              mqar: bool = False, lengths: Optional[str] = None, depths: Optional[str] = None,
              pairs: Optional[str] = None, num: int = 8, device: str = "auto",
              data_overrides: Optional[Dict] = None, quiet: bool = False) -> Dict:
    """`fox eval --needle/--mqar`: every model of every checkpoint; returns {"files": [...], ...}."""
    from . import plots
    from .train import autocast_for, load_checkpoint, models_from_checkpoint, resolve_device
    ckpts = [load_checkpoint(p) for p in checkpoints]
    cfg0 = dict(ckpts[0]["config"])
    cfg0.update({k: v for k, v in (data_overrides or {}).items() if v is not None})
    out_dir = out_dir or os.path.join(cfg0["out_dir"], "eval")
    os.makedirs(out_dir, exist_ok=True)
    dev = resolve_device({"device": device})
    autocast = autocast_for({"dtype": "auto"}, dev)
    models = {}
    for ck in ckpts:
        run = os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(ck["path"]))))
        for arch, m in models_from_checkpoint(ck, dev).items():
            models[f"{arch} ({run}@{ck['step']})" if len(ckpts) > 1 else arch] = m
    result, files = {}, []
    t0 = time.perf_counter()
    if needle:
        T0 = cfg0["seq_len"]
        if lengths:
            lens = sorted({int(x) for x in str(lengths).split(",") if x.strip()})
        else:
            lens = sorted({max(min_needle_length(), l) for l in (T0 // 2, T0, 2 * T0)})
        ds = [float(x) for x in depths.split(",")] if depths else list(DEFAULT_DEPTHS)
        grid = needle_grid(models, make_corpus(cfg0), lens, ds, num, device=dev, autocast=autocast)
        grid["train_seq_len"] = T0
        result["needle"] = grid
        path = os.path.join(out_dir, "needle.json")
        _write_json(grid, path)
        files.append(path)
        png = plots.plot_needle(grid, os.path.join(out_dir, "needle.png"))
        if png:
            files.append(png)
        if not quiet:
            for label, r in grid["models"].items():
                print(f"needle {label}: " + ", ".join(
                    f"L={l}: {np.mean(row):.2f}" for l, row in zip(lens, r["exact_match"])), flush=True)
    if mqar:
        ps = [int(x) for x in pairs.split(",")] if pairs else [4, 8, 16, 32]
        res = mqar_eval(models, ps, num, device=dev, autocast=autocast)
        result["mqar"] = res
        path = os.path.join(out_dir, "mqar.json")
        _write_json(res, path)
        files.append(path)
        if not quiet:
            for label, r in res["models"].items():
                print(f"mqar {label}: " + ", ".join(f"{n} pairs: {v['accuracy']:.2f}"
                                                   for n, v in r.items()), flush=True)
    result["files"] = files
    result["eval_time_s"] = round(time.perf_counter() - t0, 2)
    if not quiet:
        print(f"eval: wrote {', '.join(files)}", flush=True)
    return result
