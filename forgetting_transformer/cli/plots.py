"""Plots (matplotlib, Agg backend). Without matplotlib every function warns once and returns None."""
import json
import os
import sys
from typing import Dict, List, Optional, Sequence

import numpy as np

_warned = False


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with one warning) when it is missing."""
    global _warned
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        if not _warned:
            print("warning: matplotlib is not installed: writing JSON only, no PNG plots "
                  "(pip install matplotlib)", file=sys.stderr)
            _warned = True
        return None


COLORS = {"fox_pro": "tab:red", "fox_llama": "tab:orange", "transformer_pro": "tab:blue",
          "transformer_llama": "tab:cyan"}
LINESTYLES = ["-", "--", ":", "-."]


def smooth(y: Sequence[float], window: int) -> np.ndarray:
    y = np.asarray(y, dtype=np.float64)
    if window <= 1 or len(y) < window:
        return y
    c = np.cumsum(np.insert(y, 0, 0.0))
    out = (c[window:] - c[:-window]) / window            # centered-ish moving average
    pad = window // 2
    return np.concatenate([y[:pad], out, np.full(len(y) - len(out) - pad, out[-1])])  # raw head: L(i) at small i matters


def _style(curve, idx_by_ckpt):
    return dict(color=COLORS.get(curve["arch"]),
                linestyle=LINESTYLES[idx_by_ckpt.setdefault(curve["checkpoint"], len(idx_by_ckpt))
                                     % len(LINESTYLES)])


def _finish(plt, fig, ax, path: str) -> str:
    """The common end of the line plots: grid, legend, layout, write, close."""
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_per_token(curves: List[Dict], path: str, window: Optional[int] = None) -> Optional[str]:
    """L(i) by token position i, one line per (checkpoint, model); dashed line at training length."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    idx = {}
    for c in curves:
        y = c["per_token_loss"]
        w = window or max(1, len(y) // 64)
        ax.plot(np.arange(1, len(y) + 1), smooth(y, w), label=c["label"], linewidth=1.6,
                **_style(c, idx))
    for T in sorted({c["train_seq_len"] for c in curves}):
        ax.axvline(T, color="gray", linestyle="--", linewidth=1)
        ax.text(T, ax.get_ylim()[1], " training length", va="top", fontsize=8, color="gray")
    ax.set_xlabel("token position i")
    ax.set_ylabel("per-token loss L(i) (nats)")
    ax.set_title("Per-token validation loss by position (moving average)")
    return _finish(plt, fig, ax, path)


def plot_by_length(curves: List[Dict], path: str) -> Optional[str]:
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    idx = {}
    for c in curves:
        ls = sorted(int(k) for k in c["loss_by_length"])
        ax.plot(ls, [c["loss_by_length"][str(l)] for l in ls], marker="o", label=c["label"],
                **_style(c, idx))
    for T in sorted({c["train_seq_len"] for c in curves}):
        ax.axvline(T, color="gray", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("evaluation context length l (tokens)")
    ax.set_ylabel("mean loss over the l tokens (nats)")
    ax.set_title("Validation loss by context length (dashed: training length)")
    return _finish(plt, fig, ax, path)


def read_metrics(path: str):
    train, evals = [], []
    with open(path) as fh:
        for line in fh:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            (evals if r.get("eval") else train).append(r)
    return train, evals


def plot_training(metrics_path: str, archs: Sequence[str], path: str) -> Optional[str]:
    plt = pyplot()
    if plt is None or not os.path.exists(metrics_path):
        return None
    train, evals = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for a in archs:
        pts = [(r["step"], r[a]["loss"]) for r in train if a in r]
        if pts:
            ax.plot(*zip(*pts), label=f"{a} train", color=COLORS.get(a), alpha=0.6)
        pts = [(r["step"], r[a]["val_loss"]) for r in evals if a in r]
        if pts:
            ax.plot(*zip(*pts), "o--", label=f"{a} validation", color=COLORS.get(a))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title("Training")
    return _finish(plt, fig, ax, path)


def plot_needle(grid: Dict, path: str) -> Optional[str]:
    """Needle-in-a-haystack heatmaps: exact match by context length (x) and needle depth (y), one
    panel per model."""
    plt = pyplot()
    if plt is None:
        return None
    labels = list(grid["models"])
    lens, depths = grid["lengths"], grid["depths"]
    fig, axes = plt.subplots(1, len(labels), figsize=(1.2 + 0.9 * max(3, len(lens)) * len(labels), 3.8),
                             squeeze=False)
    im = None
    for k, (ax, label) in enumerate(zip(axes[0], labels)):
        acc = np.asarray(grid["models"][label]["exact_match"], dtype=np.float64).T   # depth x length
        im = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
        ax.set_xticks(range(len(lens)), [str(l) for l in lens], fontsize=8)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=8)
        for i in range(acc.shape[0]):
            for j in range(acc.shape[1]):
                ax.text(j, i, f"{acc[i, j]:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xlabel("context length (tokens)")
        if k == 0:
            ax.set_ylabel("needle depth")
        ax.set_title(label, fontsize=9)
    fig.colorbar(im, ax=list(axes[0]), label="exact match")
    fig.suptitle("Needle in a haystack", fontsize=10)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
