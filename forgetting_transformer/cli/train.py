"""`fox train`: train FoX and the Transformer side by side on the same batches.

Each step draws one batch (a pure function of seed and step) and takes one optimizer step of
every model on it: AdamW (betas 0.9/0.95, weight decay on matrices only), gradient clipping,
linear warmup then cosine decay. Checkpoints (models, optimizers, data state) are written
atomically; ``--resume`` continues bitwise-identically on CPU.
"""
import contextlib
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional

import torch

from . import config as cfgmod
from .data import ByteCorpus

CHECKPOINT_FORMAT = "fox_torch.cli/1"
# Keys that define the models and the data stream: a resumed run must agree on them.
STRUCTURAL_KEYS = ("models", "vocab_size", "hidden_size", "num_hidden_layers", "num_heads",
                   "hidden_ratio", "rope_base", "seq_len", "batch_size", "seed", "val_fraction",
                   "max_files")


def resolve_device(cfg) -> torch.device:
    if cfg["device"] == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg["device"])


def autocast_for(cfg, device: torch.device):
    use_bf16 = cfg["dtype"] == "bf16" or (cfg["dtype"] == "auto" and device.type == "cuda")
    if use_bf16:
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def build_model(cfg, arch: str, index: int, device):
    from ..nn import ForgettingTransformerForCausalLM
    torch.manual_seed(cfg["seed"] * 1000 + index)
    return ForgettingTransformerForCausalLM(cfgmod.model_config(cfg, arch)).to(device)


def count_parameters(model) -> Dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    emb = sum(p.numel() for n, p in model.named_parameters()
              if n.endswith("embeddings.weight") or n.startswith("lm_head"))
    fgate = sum(p.numel() for n, p in model.named_parameters() if "fgate" in n)
    return {"total": total, "non_embedding": total - emb, "forget_gate": fgate}


def make_optimizer(cfg, arch, model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    lr = float(cfgmod.per_model(cfg["lr"], arch))
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg["weight_decay"]},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=tuple(cfg["betas"]))


def lr_at(step: int, peak: float, cfg) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup from 0, then cosine to
    peak * min_lr_ratio at the last step."""
    warm, total = cfg["warmup_steps"], cfg["steps"]
    if warm > 0 and step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    floor = peak * cfg["min_lr_ratio"]
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def atomic_save(obj, path: str):
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def checkpoint_dir(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoints")


def latest_checkpoint(out_dir: str) -> Optional[str]:
    p = os.path.join(checkpoint_dir(out_dir), "last.pt")
    return p if os.path.exists(p) else None


def load_checkpoint(path: str, map_location="cpu"):
    if os.path.isdir(path):
        found = latest_checkpoint(path)
        if not found:
            raise SystemExit(f"{path}: no checkpoints/last.pt")
        path = found
    ckpt = torch.load(path, map_location=map_location, weights_only=False)
    if ckpt.get("format") != CHECKPOINT_FORMAT:
        raise SystemExit(f"{path}: not a fox checkpoint (format {ckpt.get('format')!r})")
    ckpt["path"] = path
    return ckpt


def models_from_checkpoint(ckpt, device="cpu", archs: Optional[List[str]] = None):
    """{arch: model in eval mode} from a checkpoint."""
    from ..nn import ForgettingTransformerForCausalLM
    out = {}
    for arch, entry in ckpt["models"].items():
        if archs and arch not in archs:
            continue
        model = ForgettingTransformerForCausalLM(cfgmod.model_config(ckpt["config"], arch))
        model.load_state_dict(entry["state_dict"])
        out[arch] = model.to(device).eval()
    return out


class Progress:
    """One progress line: tqdm when installed and on a terminal, else plain prints."""

    def __init__(self, total: int, initial: int, quiet: bool = False):
        self.total, self.quiet, self.bar = total, quiet, None
        if not quiet and sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step: int, text: str, log: bool):
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix_str(text, refresh=False)
        elif log:
            print(f"step {step}/{self.total} {text}", flush=True)

    def write(self, text: str):
        if self.quiet:
            return
        (self.bar.write if self.bar is not None else print)(text)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _fmt_time(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _truncate_metrics(path: str, step: int):
    """Drop metric records past the resumed step, so a resumed log has no duplicates."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as fh:
        for line in fh:
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except json.JSONDecodeError:
                pass  # a line cut by a kill
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.writelines(keep)
    os.replace(tmp, path)


@torch.no_grad()
def validation_loss(model, corpus, cfg, device, autocast, num_windows: int) -> float:
    ids, labels = corpus.eval_windows(cfg["seq_len"], num_windows)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    mb = cfg["micro_batch_size"] or cfg["batch_size"]
    for i in range(0, ids.shape[0], mb):
        x, y = ids[i:i + mb].to(device), labels[i:i + mb].to(device)
        with autocast():
            loss = model(x, labels=y).float()
        mask = y != -100
        total += loss[mask].sum().item()
        count += int(mask.sum())
    model.train(was_training)
    return total / max(1, count)


def train(cfg, resume: bool = False, corpus: Optional[ByteCorpus] = None, quiet: bool = False,
          stop_at: Optional[int] = None) -> Dict:
    """Runs (or resumes) training; returns a summary dict. ``stop_at`` ends the process-like run
    after that many steps without a final checkpoint (to test kill-and-resume)."""
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))
    out_dir = cfg["out_dir"]
    os.makedirs(checkpoint_dir(out_dir), exist_ok=True)
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    device = resolve_device(cfg)
    autocast = autocast_for(cfg, device)

    ckpt = None
    if resume:
        path = latest_checkpoint(out_dir)
        if path is None:
            print(f"--resume: no checkpoint in {out_dir}, starting from scratch", file=sys.stderr)
        else:
            ckpt = load_checkpoint(path)
            old = ckpt["config"]
            diff = [k for k in STRUCTURAL_KEYS if old.get(k) != cfg.get(k)]
            if diff:
                raise SystemExit(f"--resume: the config differs from the checkpoint's in {diff}")
            # Schedule, intervals etc. may change on resume; take the rest from the new config.
    elif latest_checkpoint(out_dir) is not None:
        raise SystemExit(f"{out_dir} already holds a run: pass --resume to continue it, or "
                         f"choose another --out-dir")

    t_load = time.perf_counter()
    corpus = corpus or ByteCorpus(val_fraction=cfg["val_fraction"], max_files=cfg["max_files"])
    t_load = time.perf_counter() - t_load

    archs = list(cfg["models"])
    models = {a: build_model(cfg, a, i, device) for i, a in enumerate(archs)}
    opts = {a: make_optimizer(cfg, a, m) for a, m in models.items()}
    start_step, elapsed_before = 0, 0.0
    if ckpt is not None:
        for a in archs:
            models[a].load_state_dict(ckpt["models"][a]["state_dict"])
            opts[a].load_state_dict(ckpt["models"][a]["optimizer"])
        start_step = ckpt["step"]
        elapsed_before = ckpt.get("train_time", 0.0)
        torch.set_rng_state(ckpt["torch_rng"])
        _truncate_metrics(metrics_path, start_step)
    cfgmod.dump(cfg, os.path.join(out_dir, "config.json"))

    info = {"device": str(device), "data": corpus.summary(), "data_load_s": round(t_load, 2),
            "models": {a: {"params": count_parameters(m),
                           "config": cfgmod.describe(cfgmod.model_config(cfg, a))}
                       for a, m in models.items()}}
    with open(os.path.join(out_dir, "run_info.json"), "w") as fh:
        json.dump(info, fh, indent=2)
    if not quiet:
        d = info["data"]
        print(f"fox train: preset {cfg['preset']}, device {device}, models {', '.join(archs)}; "
              f"data {d['train_files']} train / {d['val_files']} val files "
              f"({d['train_tokens'] / 1e6:.1f}M / {d['val_tokens'] / 1e6:.1f}M bytes) from "
              f"{d['root']}; out {out_dir}", flush=True)
        for a, m in models.items():
            p = info["models"][a]["params"]
            print(f"  {a}: {p['total'] / 1e6:.2f}M parameters ({p['non_embedding'] / 1e6:.2f}M "
                  f"non-embedding)", flush=True)

    B, T, steps = cfg["batch_size"], cfg["seq_len"], cfg["steps"]
    mb = cfg["micro_batch_size"] or B
    if B % mb:
        raise SystemExit(f"batch_size {B} is not a multiple of micro_batch_size {mb}")
    for m in models.values():
        m.train()

    def save(step: int, train_time: float):
        state = {"format": CHECKPOINT_FORMAT, "step": step, "config": cfg,
                 "train_time": train_time, "torch_rng": torch.get_rng_state(),
                 "data_state": {"seed": cfg["seed"], "next_step": step,
                                "val_fraction": cfg["val_fraction"], **corpus.summary()},
                 "models": {a: {"state_dict": {k: v.cpu() for k, v in models[a].state_dict().items()},
                                "optimizer": opts[a].state_dict(),
                                "model_config": cfgmod.describe(cfgmod.model_config(cfg, a))}
                            for a in archs}}
        cdir = checkpoint_dir(out_dir)
        atomic_save(state, os.path.join(cdir, f"step_{step:07d}.pt"))
        atomic_save(state, os.path.join(cdir, "last.pt"))

    progress = Progress(steps, start_step, quiet)
    metrics = open(metrics_path, "a")
    t0 = time.perf_counter()
    tokens_this_run = 0
    last = {}
    step = start_step
    try:
        while step < steps:
            ids, labels = corpus.train_batch(cfg["seed"], step, B, T)
            n_valid = int((labels != -100).sum())
            record = {"step": step + 1, "tokens": (step + 1) * B * T}
            for a in archs:
                model, opt = models[a], opts[a]
                lr = lr_at(step, float(cfgmod.per_model(cfg["lr"], a)), cfg)
                for g in opt.param_groups:
                    g["lr"] = lr
                opt.zero_grad(set_to_none=True)
                loss_sum = 0.0
                for i in range(0, B, mb):
                    x, y = ids[i:i + mb].to(device), labels[i:i + mb].to(device)
                    with autocast():
                        per_token = model(x, labels=y)
                    loss = per_token.float().sum() / n_valid
                    loss.backward()
                    loss_sum += loss.item()
                gnorm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), cfg["grad_clip"])
                opt.step()
                last[a] = loss_sum
                record[a] = {"loss": round(loss_sum, 5), "lr": lr, "grad_norm": round(float(gnorm), 4)}
            step += 1
            tokens_this_run += B * T * len(archs)
            dt = time.perf_counter() - t0
            tps = tokens_this_run / dt
            eta = dt / (step - start_step) * (steps - step)
            record.update({"time": round(elapsed_before + dt, 3), "tokens_per_s": round(tps, 1)})
            log = step % cfg["log_interval"] == 0 or step == steps or step == start_step + 1
            if log:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            text = " ".join(f"{a} {last[a]:.3f}" for a in archs)
            progress.update(step, f"loss {text} | {tps:,.0f} tok/s | ETA {_fmt_time(eta)}", log)
            if cfg["eval_interval"] and (step % cfg["eval_interval"] == 0 or step == steps):
                ev = {"step": step, "eval": True}
                for a in archs:
                    ev[a] = {"val_loss": round(validation_loss(models[a], corpus, cfg, device,
                                                               autocast, cfg["eval_batches"] * B), 5)}
                metrics.write(json.dumps(ev) + "\n")
                metrics.flush()
                progress.write(f"step {step}: val loss " +
                               " ".join(f"{a} {ev[a]['val_loss']:.4f}" for a in archs))
            if stop_at is not None and step >= stop_at:
                return {"stopped_at": step}
            if step % cfg["checkpoint_interval"] == 0 or step == steps:
                save(step, elapsed_before + time.perf_counter() - t0)
    finally:
        metrics.close()
        progress.close()
    total_time = time.perf_counter() - t0
    summary = {"out_dir": out_dir, "steps": steps, "resumed_from": start_step,
               "train_time_s": round(total_time, 2), "final_loss": last,
               "checkpoint": latest_checkpoint(out_dir)}
    if not quiet:
        print(f"done: {steps - start_step} steps in {_fmt_time(total_time)} "
              f"({total_time:.1f} s); checkpoint {summary['checkpoint']}", flush=True)
    return summary
