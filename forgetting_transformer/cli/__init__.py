"""The `fox` command line (also `python -m forgetting_transformer`).

    fox run                         train the tiny FoX and Transformer, evaluate, write a report
    fox train [--preset tiny] [--config cfg.yaml] [--resume] [--set key=value ...]
    fox eval CHECKPOINT [CHECKPOINT ...]      per-token loss L(i) and loss by context length
    fox eval CHECKPOINT --needle [--mqar]     needle-in-a-haystack grid, associative recall
    torchrun --nproc_per_node N -m forgetting_transformer train ...   data-parallel (DDP)
    torchrun --nproc_per_node N -m forgetting_transformer train --fsdp ...   sharded (FSDP2)
    torchrun --nproc_per_node N -m forgetting_transformer train --context-parallel P ...
                                    every sequence split over P ranks
    fox inspect CHECKPOINT          forget-gate heatmaps, attention maps, per-head statistics
    fox generate CHECKPOINT --prompt "def "
    fox demo                        the Forgetting Attention op against the plain formula
"""
import argparse
import json
import os
import sys

from . import config as cfgmod

TRAIN_FLAGS = {  # flag -> (config key, type, help)
    "--models": ("models", str, "comma-separated architectures (fox_pro,transformer_pro,...)"),
    "--hidden-size": ("hidden_size", int, None),
    "--layers": ("num_hidden_layers", int, None),
    "--heads": ("num_heads", int, None),
    "--seq-len": ("seq_len", int, "training context length"),
    "--batch-size": ("batch_size", int, "sequences per optimizer step"),
    "--micro-batch-size": ("micro_batch_size", int, "sequences per forward (grad accumulation)"),
    "--steps": ("steps", int, None),
    "--warmup-steps": ("warmup_steps", int, None),
    "--lr": ("lr", float, "peak learning rate of every model (default: per architecture)"),
    "--seed": ("seed", int, None),
    "--device": ("device", str, "auto | cpu | cuda"),
    "--dtype": ("dtype", str, "auto | fp32 | bf16"),
    "--threads": ("threads", int, "torch threads"),
    "--out-dir": ("out_dir", str, "run directory (metrics.jsonl, checkpoints/)"),
    "--log-interval": ("log_interval", int, None),
    "--eval-interval": ("eval_interval", int, None),
    "--checkpoint-interval": ("checkpoint_interval", int, None),
    "--max-files": ("max_files", int, "use at most this many train files"),
    "--data-dir": ("data_dir", str, "train on a directory of text files (split by file)"),
    "--tokens": ("tokens", str, "train on pre-tokenized ids: FILE.npy, or raw with --token-dtype"),
    "--token-dtype": ("token_dtype", str, "uint16 | uint32 (raw --tokens files)"),
    "--context-parallel": ("context_parallel", int,
                           "under torchrun: split every sequence over this many ranks (data "
                           "parallel, or FSDP2, over the rest)"),
    "--context-parallel-layout": ("context_parallel_layout", str,
                                  "zigzag (balanced causal work; default) | contiguous"),
}


def _add_train_flags(p):
    p.add_argument("--preset", choices=list(cfgmod.PRESETS), default=None,
                   help="tiny (default; a 2-core CPU), micro (seconds), 125m, 360m, 760m (paper)")
    p.add_argument("--config", help="YAML or JSON file of config keys")
    for flag, (key, typ, hlp) in TRAIN_FLAGS.items():
        p.add_argument(flag, dest=key, type=typ, default=None, help=hlp)
    p.add_argument("--fsdp", action="store_true", default=None,
                   help="under torchrun: shard parameters, gradients and optimizer state with "
                        "FSDP2 (fully_shard per block) instead of replicating them (DDP)")
    p.add_argument("--checkpoint-activations", action="store_true", default=None,
                   dest="checkpoint_activations",
                   help="keep only each block's input in training and recompute the rest in the "
                        "backward pass (less memory, one more forward of every block)")
    p.add_argument("--cuda-graph", action="store_true", default=None, dest="cuda_graph",
                   help="capture each model's forward + backward of a micro-batch as a CUDA graph "
                        "and replay it (one process on a GPU; the same losses bit for bit)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key; VALUE is parsed as JSON when it can be")


def _config_from(args):
    overrides = {key: getattr(args, key) for _, (key, _, _) in TRAIN_FLAGS.items()}
    overrides["fsdp"] = getattr(args, "fsdp", None)
    overrides["checkpoint_activations"] = getattr(args, "checkpoint_activations", None)
    overrides["cuda_graph"] = getattr(args, "cuda_graph", None)
    for item in args.set:
        if "=" not in item:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        overrides[k] = cfgmod.parse_value(v)
    return cfgmod.build(args.preset, args.config, overrides)


def cmd_train(args):
    from .train import train
    cfg = _config_from(args)
    if args.print_config:
        print(json.dumps(cfg, indent=2))
        return
    if args.dry_run:
        from .train import build_model, count_parameters
        for i, arch in enumerate(cfg["models"]):
            m = build_model(cfg, arch, i, "cpu")
            p = count_parameters(m)
            print(f"{arch}: {p['total'] / 1e6:.1f}M parameters, {p['non_embedding'] / 1e6:.1f}M "
                  f"non-embedding, {p['forget_gate']} in forget gates")
            del m
        return
    train(cfg, resume=args.resume, stop_at=args.stop_at)


def cmd_eval(args):
    if args.needle or args.mqar:
        from .tasks import run_tasks
        run_tasks(args.checkpoints, out_dir=args.out_dir, needle=args.needle, mqar=args.mqar,
                  lengths=args.lengths, depths=args.depths, pairs=args.pairs,
                  num=args.num if args.num is not None else 8, device=args.device,
                  data_overrides=_data_overrides(args))
        return
    from .evaluate import evaluate
    evaluate(args.checkpoints, out_dir=args.out_dir, lengths=args.lengths,
             num=args.num if args.num is not None else 32, device=args.device, smooth=args.smooth,
             data_overrides=_data_overrides(args))


def _data_overrides(args):
    return {"data_dir": args.data_dir, "tokens": args.tokens, "token_dtype": args.token_dtype}


def cmd_inspect(args):
    from .inspect import inspect
    inspect(args.checkpoint, out_dir=args.out_dir, seq_len=args.seq_len, text_file=args.text_file,
            heads=args.heads)


def cmd_generate(args):
    from .generate import generate
    generate(args.checkpoint, args.prompt, max_new_tokens=args.max_new_tokens,
             temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
             greedy=args.greedy, seed=args.seed, models=args.models, device=args.device)


def cmd_run(args):
    from .report import run
    run(args)


def cmd_demo(args):  # reached only through make_parser() users; main() short-cuts "demo"
    from .demo import main as demo_main
    demo_main(args.rest)


def make_parser():
    parser = argparse.ArgumentParser(prog="fox", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")

    p = sub.add_parser("run", help="train both tiny models, evaluate, inspect, write a report")
    _add_train_flags(p)
    p.add_argument("--report-dir", default=None, help="default: <out-dir>/report")
    p.add_argument("--resume", action="store_true", help="continue a previous run in out-dir")
    p.add_argument("--eval-num", type=int, default=None, help="validation windows per length")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("train", help="train FoX and the Transformer side by side")
    _add_train_flags(p)
    p.add_argument("--resume", action="store_true", help="continue from out-dir's last checkpoint")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--dry-run", action="store_true", help="build the models, print sizes, exit")
    p.add_argument("--stop-at", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="per-token loss L(i) and loss by context length")
    p.add_argument("checkpoints", nargs="+", help="checkpoint files or run directories")
    p.add_argument("--out-dir", default=None, help="default: eval/ beside the first checkpoint's run")
    p.add_argument("--lengths", default=None,
                   help="comma-separated context lengths (default: T/4,T/2,T,2T of training T)")
    p.add_argument("--num", type=int, default=None,
                   help="validation windows per length (32); samples per needle cell / MQAR size (8)")
    p.add_argument("--device", default="auto")
    p.add_argument("--needle", action="store_true",
                   help="needle-in-a-haystack grid (context length x depth): needle.json, needle.png")
    p.add_argument("--depths", default=None, help="needle depths in [0, 1] (default 0,.25,.5,.75,1)")
    p.add_argument("--mqar", action="store_true", help="multi-query associative recall: mqar.json")
    p.add_argument("--pairs", default=None, help="MQAR key-value pair counts (default 4,8,16,32)")
    p.add_argument("--data-dir", default=None, help="evaluate on this directory of text files")
    p.add_argument("--tokens", default=None, help="evaluate on these pre-tokenized ids")
    p.add_argument("--token-dtype", default=None, help="uint16 | uint32 (raw --tokens files)")
    p.add_argument("--smooth", type=int, default=None, help="moving-average window of the L(i) plot")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("inspect", help="forget gates: heatmaps, attention maps, head classes")
    p.add_argument("checkpoint")
    p.add_argument("--out-dir", default=None, help="default: inspect/ in the run directory")
    p.add_argument("--seq-len", type=int, default=128, help="length of the inspected sequence")
    p.add_argument("--text-file", default=None, help="inspect this file (default: a validation file)")
    p.add_argument("--heads", type=int, default=4, help="attention maps of this many heads")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("generate", help="continue a prompt with a trained model")
    p.add_argument("checkpoint")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--models", default=None, help="comma-separated subset of the checkpoint's models")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="the Forgetting Attention op against the plain formula")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="demo flags (--batch, --seqlen, ...)")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:  # the demo parses its own flags
        from .demo import main as demo_main
        demo_main(argv[1:])
        return 0
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def console_main():
    """The `fox` and `python -m forgetting_transformer` entry point: main(), then the exit code.

    A rank of a torchrun job (WORLD_SIZE > 1) leaves through os._exit once main() has returned,
    its process group destroyed and its files closed. Interpreter finalization would race gloo's
    worker threads, which can still be releasing tensors that own Python objects; a thread that
    needs the GIL while the interpreter finalizes aborts the process ("terminate called without
    an active exception", SIGABRT) after a run that succeeded."""
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


__all__ = ["console_main", "main", "make_parser"]
