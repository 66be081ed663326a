"""`fox run`: the main job end to end. Trains the tiny FoX (Pro) and Transformer (Pro) side by side
(resuming a previous run in the same directory), evaluates L(i) and the loss by context length up
to twice the training length, inspects the forget gates, samples text, and writes a report
directory (report.md, PNGs, JSON)."""
import json
import os
import time

from . import plots
from .data import ByteCorpus, make_corpus


def _table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def run(args):
    from . import _config_from
    from .evaluate import evaluate
    from .generate import generate
    from .inspect import inspect
    from .train import latest_checkpoint, load_checkpoint, train

    t_start = time.perf_counter()
    cfg = _config_from(args)
    out_dir = cfg["out_dir"]
    report_dir = args.report_dir or os.path.join(out_dir, "report")
    os.makedirs(report_dir, exist_ok=True)
    print(f"fox run: {len(cfg['models'])} models, preset {cfg['preset']}, {cfg['steps']} steps; "
          f"report -> {report_dir}", flush=True)

    corpus = make_corpus(cfg)
    timings = {}
    t = time.perf_counter()
    existing = latest_checkpoint(out_dir)
    if existing and load_checkpoint(existing)["step"] >= cfg["steps"]:
        print(f"{out_dir}: training already finished, reusing {existing}", flush=True)
    else:
        if existing:
            print(f"{out_dir}: resuming the previous run", flush=True)
        train(cfg, resume=bool(existing) or args.resume, corpus=corpus)
    timings["train_s"] = round(time.perf_counter() - t, 1)

    ckpt_path = latest_checkpoint(out_dir)
    t = time.perf_counter()
    ev = evaluate([ckpt_path], out_dir=report_dir, num=args.eval_num or 128, corpus=corpus)
    timings["eval_s"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    ins = inspect(ckpt_path, out_dir=report_dir, seq_len=min(128, cfg["seq_len"]), corpus=corpus)
    timings["inspect_s"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    samples = generate(ckpt_path, "def ", max_new_tokens=160, temperature=0.7, quiet=True)
    timings["generate_s"] = round(time.perf_counter() - t, 1)
    train_png = plots.plot_training(os.path.join(out_dir, "metrics.jsonl"), cfg["models"],
                                    os.path.join(report_dir, "training.png"))
    timings["total_s"] = round(time.perf_counter() - t_start, 1)

    # ---- report.md -------------------------------------------------------------------------
    ckpt = load_checkpoint(ckpt_path)
    with open(os.path.join(out_dir, "run_info.json")) as fh:
        info = json.load(fh)
    train_rows, evals = plots.read_metrics(os.path.join(out_dir, "metrics.jsonl"))
    last_train = train_rows[-1] if train_rows else {}
    last_eval = evals[-1] if evals else {}
    T = cfg["seq_len"]
    L = []
    lines = [f"# FoX vs Transformer: {cfg['preset']} run", "",
             f"Run directory `{os.path.abspath(out_dir)}`, checkpoint step {ckpt['step']}, "
             f"device {info['device']}. Data: byte-level Python standard library source "
             f"({info['data']['train_files']} train / {info['data']['val_files']} validation "
             f"files, split by file; {info['data']['train_tokens'] / 1e6:.1f}M / "
             f"{info['data']['val_tokens'] / 1e6:.1f}M bytes).", "",
             f"Training: {cfg['steps']} steps x {cfg['batch_size']} x {T} tokens, AdamW "
             f"(betas {tuple(cfg['betas'])}, wd {cfg['weight_decay']}), clip {cfg['grad_clip']}, "
             f"{cfg['warmup_steps']} warmup steps then cosine; lr {cfg['lr']}.", "",
             "## Models", ""]
    rows = []
    for a in cfg["models"]:
        p = ins["params"][a]
        fe = last_eval.get(a, {}).get("val_loss", float("nan"))
        rows.append([a, f"{p['total']:,}", f"{p['non_embedding']:,}", f"{p['forget_gate']:,}",
                     f"{last_train.get(a, {}).get('loss', float('nan')):.4f}", f"{fe:.4f}"])
    lines += [_table(["model", "params", "non-embedding", "forget gate", "last train loss",
                      f"val loss (T={T})"], rows), ""]
    lines += ["## Per-token loss L(i)", "",
              f"Mean loss at position i over {ev['curves'][0]['num_windows']} validation windows "
              f"of {ev['eval_seq_len']} tokens (random offsets inside single files); the training "
              f"length is {T}. A falling L(i) means the model uses context that far back; past "
              "the training length it shows length extrapolation.", "",
              "![per-token loss](per_token_loss.png)", ""]
    marks = [m for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
             if m <= ev["eval_seq_len"]]
    rows = []
    for c in ev["curves"]:
        y = c["per_token_loss"]
        w = max(1, len(y) // 64)
        rows.append([c["label"]] + [f"{sum(y[max(0, m - w):m]) / len(y[max(0, m - w):m]):.3f}"
                                    for m in marks])
    lines += [_table(["model"] + [f"i<={m}" for m in marks], rows),
              f"(each entry: mean of L over the {max(1, ev['eval_seq_len'] // 64)} positions "
              "ending at i)", ""]
    lines += ["## Loss by context length", "", "![loss by length](loss_by_length.png)", ""]
    lens = [str(l) for l in ev["lengths"]]
    lines += [_table(["model"] + [f"l={l}" + (" (train)" if int(l) == T else "") for l in lens],
                     [[c["label"]] + [f"{c['loss_by_length'][l]:.4f}" for l in lens]
                      for c in ev["curves"]]), ""]
    lines += ["## Forget gates", "",
              "Effective decay length of each FoX head = 1 / mean(-log f) tokens over validation "
              f"windows; heads under {T // 4} tokens (a quarter of the training length) are "
              "called local, the others global.", ""]
    for a, e in ins["models"].items():
        if "layers" not in e:
            continue
        rows = [[f"layer {li}"] + [f"{hs['decay_length']:.0f} ({hs['class']})" for hs in Lr["heads"]]
                for li, Lr in enumerate(e["layers"])]
        nh = len(e["layers"][0]["heads"])
        lines += [f"**{a}**", "", _table([""] + [f"head {h}" for h in range(nh)], rows), "",
                  f"![decay lengths](decay_lengths_{a}.png)", ""]
        for li in range(len(e["layers"])):
            lines += [f"![F layer {li}](fgate_matrix_{a}_layer{li}.png)"]
        lines += [""]
    lines += ["Attention maps (log10), first layers:", ""]
    for a in cfg["models"]:
        lines += [f"![{a} attention](attention_{a}_layer0.png)"]
    lines += ["", "## Samples (prompt `def `, temperature 0.7)", ""]
    for a, s in samples.items():
        lines += [f"**{a}**", "", "```", s.replace("```", "'''"), "```", ""]
    if train_png:
        lines += ["## Training curves", "", "![training](training.png)", ""]
    lines += ["## Timings", "", _table(["phase", "seconds"], [[k, v] for k, v in timings.items()]),
              "", f"Files: eval.json (L(i) and loss by length), inspect.json (gate statistics, "
              f"parameters), checkpoints in `{os.path.join(out_dir, 'checkpoints')}`.", ""]
    report = os.path.join(report_dir, "report.md")
    with open(report, "w") as fh:
        fh.write("\n".join(lines))
    with open(os.path.join(report_dir, "timings.json"), "w") as fh:
        json.dump(timings, fh, indent=2)
    print(f"\nreport: {os.path.abspath(report)} (total {timings['total_s']:.0f} s)", flush=True)
    return report
