"""`fox eval`: the per-token validation loss L(i) by position (the paper's key plot) and the loss by
evaluation context length, including lengths beyond the training length, for one or more
checkpoints (every model in each). Writes eval.json, per_token_loss.png and loss_by_length.png."""
import json
import os
import time
from typing import Dict, List, Optional, Sequence

import torch

from . import plots
from .data import IGNORE_INDEX, ByteCorpus, make_corpus
from .train import autocast_for, load_checkpoint, models_from_checkpoint, resolve_device


@torch.no_grad()
def per_position_loss(model, ids, labels, device, autocast, batch_size: int = 8):
    """Sum and count of the loss at each position over the windows: (T,), (T,)."""
    T = ids.shape[1]
    total = torch.zeros(T, dtype=torch.float64)
    count = torch.zeros(T, dtype=torch.float64)
    for i in range(0, ids.shape[0], batch_size):
        x, y = ids[i:i + batch_size].to(device), labels[i:i + batch_size].to(device)
        with autocast():
            loss = model(x, labels=y).float()
        mask = (y != IGNORE_INDEX)
        total += (loss * mask).sum(0).double().cpu()
        count += mask.sum(0).double().cpu()
    return total, count


def _run_name(ckpt) -> str:
    path = ckpt["path"]
    run = os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(path))))
    return f"{run}@{ckpt['step']}"


def evaluate(checkpoints: Sequence[str], out_dir: Optional[str] = None,
             lengths: Optional[str] = None, num: int = 32, device: str = "auto",
             smooth: Optional[int] = None, corpus: Optional[ByteCorpus] = None,
             quiet: bool = False, data_overrides: Optional[Dict] = None) -> Dict:
    ckpts = [load_checkpoint(p) for p in checkpoints]
    cfg0 = dict(ckpts[0]["config"])
    cfg0.update({k: v for k, v in (data_overrides or {}).items() if v is not None})
    if out_dir is None:
        out_dir = os.path.join(cfg0["out_dir"], "eval")
    os.makedirs(out_dir, exist_ok=True)
    dev = resolve_device({"device": device})
    autocast = autocast_for({"dtype": "auto"}, dev)
    if corpus is None:
        corpus = make_corpus(cfg0)
    T0 = cfg0["seq_len"]
    if lengths:
        lens = sorted({int(x) for x in str(lengths).split(",") if x.strip()})
    else:
        lens = sorted({max(8, T0 // 4), max(8, T0 // 2), T0, 2 * T0})
    longest = lens[-1]
    windows = {l: corpus.eval_windows(l, num) for l in lens}
    multi = len(ckpts) > 1
    curves: List[Dict] = []
    t0 = time.perf_counter()
    for ckpt in ckpts:
        models = models_from_checkpoint(ckpt, dev)
        for arch, model in models.items():
            by_len = {}
            per_tok = None
            for l in lens:
                ids, labels = windows[l]
                total, count = per_position_loss(model, ids, labels, dev, autocast)
                by_len[str(l)] = float(total.sum() / count.sum())
                if l == longest:
                    per_tok = (total / count.clamp(min=1)).tolist()
            label = f"{arch} ({_run_name(ckpt)})" if multi else arch
            curves.append({"label": label, "arch": arch, "checkpoint": ckpt["path"],
                           "step": ckpt["step"], "train_seq_len": ckpt["config"]["seq_len"],
                           "num_windows": int(windows[longest][0].shape[0]),
                           "loss_by_length": by_len, "per_token_loss": per_tok})
            if not quiet:
                print(f"{label}: " + ", ".join(f"l={k}: {v:.4f}" for k, v in by_len.items()),
                      flush=True)
        del models
    result = {"lengths": lens, "eval_seq_len": longest, "windows_per_length": num,
              "eval_time_s": round(time.perf_counter() - t0, 2), "curves": curves,
              "note": "L(i): mean loss (nats/byte) at position i over validation windows of "
                      "eval_seq_len tokens, each inside one file at a random offset; "
                      "loss_by_length[l]: mean over all positions of windows of l tokens."}
    json_path = os.path.join(out_dir, "eval.json")
    tmp = json_path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh)
    os.replace(tmp, json_path)
    pngs = [plots.plot_per_token(curves, os.path.join(out_dir, "per_token_loss.png"), smooth),
            plots.plot_by_length(curves, os.path.join(out_dir, "loss_by_length.png"))]
    result["files"] = [json_path] + [p for p in pngs if p]
    if not quiet:
        print(f"eval: wrote {', '.join(result['files'])}", flush=True)
    return result
