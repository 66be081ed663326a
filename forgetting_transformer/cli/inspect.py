"""`fox inspect`: what the forget gates learned.

For one sequence: the forget-gate matrix F (F_ij = prod_{l=j+1..i} f_l) of every FoX head and the
attention maps of a few heads (FoX and Transformer). Over many validation windows: per-head gate
statistics and each head's class, local or global, by its effective decay length
1 / mean(-log f) (the distance over which F falls by a factor e). Also the parameter counts.
Outputs go to <run>/inspect/: gate_stats.json, params.json and PNG heatmaps.

The internals (q, k, log f, attention probabilities) come from forgetting_transformer.reference, the
model written out in plain PyTorch from its state_dict; its logits are checked against the C++ model's.
"""
import json
import os
from typing import Dict, Optional

import torch

from . import config as cfgmod
from . import plots
from .data import ByteCorpus, crop, decode, encode, make_corpus
from .train import count_parameters, load_checkpoint, models_from_checkpoint
from .. import reference


@torch.no_grad()
def internals(model, c, ids):
    """(logits, [per layer {"log_fgate": (B,T,H), "attn": (B,H,T,T)}]) in float32 on the CPU."""
    sd = {k: v.float().cpu() for k, v in model.state_dict().items()}
    keep = []
    return reference.causal_lm(c, sd, ids, keep), keep


# ---- statistics --------------------------------------------------------------------------------

def head_stats(log_f: torch.Tensor, train_len: int, local_fraction: float = 0.25) -> Dict:
    """log_f: (N, H) gate values of one layer over many positions."""
    f = log_f.exp()
    out = []
    threshold = local_fraction * train_len
    for h in range(log_f.shape[1]):
        mean_neg_log = float(-log_f[:, h].mean())
        decay = 1.0 / max(mean_neg_log, 1e-12)
        out.append({"head": h, "mean_f": float(f[:, h].mean()), "std_f": float(f[:, h].std()),
                    "min_f": float(f[:, h].min()), "max_f": float(f[:, h].max()),
                    "frac_f_below_0.5": float((f[:, h] < 0.5).float().mean()),
                    "mean_log_f": -mean_neg_log, "decay_length": decay,
                    "class": "local" if decay < threshold else "global"})
    return {"heads": out, "local_threshold_tokens": threshold}


def _grid(plt, n):
    cols = min(n, 4)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    return fig, list(axes.flat)


def inspect(checkpoint: str, out_dir: Optional[str] = None, seq_len: int = 128,
            text_file: Optional[str] = None, heads: int = 4, num_stat_windows: int = 16,
            corpus: Optional[ByteCorpus] = None, quiet: bool = False) -> Dict:
    ckpt = load_checkpoint(checkpoint)
    cfg = ckpt["config"]
    out_dir = out_dir or os.path.join(cfg["out_dir"], "inspect")
    os.makedirs(out_dir, exist_ok=True)
    models = models_from_checkpoint(ckpt, "cpu")
    corpus = corpus or make_corpus(cfg)

    if text_file:
        with open(text_file, encoding="utf-8", errors="replace") as fh:
            ids = torch.tensor(encode(fh.read())[:seq_len])[None]
        source = text_file
    else:  # the start of the first validation file long enough
        d = next((i for i in range(len(corpus.val)) if corpus.val.lengths[i] > seq_len), 0)
        ids = crop(corpus.val.doc(d), seq_len, 0)[0][None]
        source = corpus.val.names[d]
    T = ids.shape[1]
    stat_ids = corpus.eval_windows(cfg["seq_len"], num_stat_windows, seed=99)[0]

    plt = plots.pyplot()
    result = {"checkpoint": ckpt["path"], "step": ckpt["step"], "sequence_source": source,
              "sequence_text": decode(ids[0]), "params": {}, "models": {}, "files": []}
    for arch, model in models.items():
        c = cfgmod.model_config(cfg, arch)
        result["params"][arch] = count_parameters(model)
        logits, layers = internals(model, c, ids)
        with torch.no_grad():
            ref = model(ids).float()
        entry = {"logits_max_abs_diff_vs_model": float((logits - ref).abs().max())}
        if c.fgate_type == "full":
            _, stat_layers = internals(model, c, stat_ids)
            entry["layers"] = [head_stats(L["log_fgate"].reshape(-1, c.num_heads), cfg["seq_len"])
                               for L in stat_layers]
            for li, L in enumerate(entry["layers"]):
                for hs in L["heads"]:
                    hs["layer"] = li
        result["models"][arch] = entry

        if plt is None:
            continue
        for li, L in enumerate(layers):
            if c.fgate_type == "full":  # F matrix of every head
                cs = L["log_fgate"][0].cumsum(0)            # (T, H)
                fig, axes = _grid(plt, c.num_heads)
                for h in range(c.num_heads):
                    Fm = (cs[:, None, h] - cs[None, :, h]).exp().tril()
                    im = axes[h].imshow(Fm.numpy(), cmap="viridis", vmin=0, vmax=1)
                    hs = entry["layers"][li]["heads"][h]
                    axes[h].set_title(f"head {h}: {hs['class']}, decay {hs['decay_length']:.0f}",
                                      fontsize=8)
                    axes[h].set_xlabel("key j", fontsize=7)
                    axes[h].set_ylabel("query i", fontsize=7)
                fig.colorbar(im, ax=axes[:c.num_heads], shrink=0.8)
                fig.suptitle(f"{arch} layer {li}: forget-gate matrix F_ij = prod f_l (l=j+1..i)")
                path = os.path.join(out_dir, f"fgate_matrix_{arch}_layer{li}.png")
                fig.savefig(path, dpi=110)
                plt.close(fig)
                result["files"].append(path)
            n = min(heads, c.num_heads)
            fig, axes = _grid(plt, n)
            for h in range(n):
                A = L["attn"][0, h].clamp(min=1e-4).log10()
                im = axes[h].imshow(A.numpy(), cmap="magma", vmin=-4, vmax=0)
                axes[h].set_title(f"head {h}", fontsize=8)
            fig.colorbar(im, ax=axes[:n], shrink=0.8, label="log10 attention")
            fig.suptitle(f"{arch} layer {li}: attention maps (one sequence, {T} tokens)")
            path = os.path.join(out_dir, f"attention_{arch}_layer{li}.png")
            fig.savefig(path, dpi=110)
            plt.close(fig)
            result["files"].append(path)

    fox = {a: e for a, e in result["models"].items() if "layers" in e}
    if plt is not None and fox:
        for arch, e in fox.items():
            import numpy as np
            grid = np.array([[hs["decay_length"] for hs in L["heads"]] for L in e["layers"]])
            fig, ax = plt.subplots(figsize=(1.0 + 0.6 * grid.shape[1], 1.0 + 0.5 * grid.shape[0]))
            im = ax.imshow(np.log10(grid), cmap="coolwarm", aspect="auto")
            for (i, j), v in np.ndenumerate(grid):
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7)
            ax.set_xlabel("head")
            ax.set_ylabel("layer")
            ax.set_title(f"{arch}: effective decay length (tokens)", fontsize=9)
            fig.colorbar(im, ax=ax, label="log10 tokens")
            fig.tight_layout()
            path = os.path.join(out_dir, f"decay_lengths_{arch}.png")
            fig.savefig(path, dpi=110)
            plt.close(fig)
            result["files"].append(path)

    path = os.path.join(out_dir, "inspect.json")
    with open(path, "w") as fh:
        json.dump(result, fh, indent=2)
    result["files"].insert(0, path)
    if not quiet:
        for a, p in result["params"].items():
            print(f"{a}: {p['total']:,} parameters ({p['non_embedding']:,} non-embedding, "
                  f"{p['forget_gate']:,} forget gate)")
        for a, e in fox.items():
            print(f"{a} heads (decay length in tokens; local < {e['layers'][0]['local_threshold_tokens']:.0f}):")
            for li, L in enumerate(e["layers"]):
                print(f"  layer {li}: " + "  ".join(
                    f"h{hs['head']} {hs['decay_length']:.0f} {hs['class']}" for hs in L["heads"]))
        print(f"inspect: wrote {len(result['files'])} files to {out_dir}")
    return result
