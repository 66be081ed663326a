"""The training step of our model against the authors' implementation (their
ForgettingTransformerForCausalLM with its Triton kernels and fused norm / loss), the same 125M-class
configuration, side by side in one process: tokens/s, model FLOP utilization, peak memory.

    python3 bench/bench_authors.py --authors-src PATH/forgetting-transformer/src \\
        --archs fox_pro,fox_llama --shapes 4x4096 1x16384

--authors-src is the `src` folder of the authors' repository (github.com/zhixuan-lin/
forgetting-transformer; it needs triton and einops). Their package has our package's name: it is
imported from there first, its modules are then taken out of sys.modules, and ours stays what
`forgetting_transformer` means.

Both run forward + backward of the mean token loss under bf16 autocast with float32 parameters and
the same weights (the losses agree), the same random tokens, the gradients set to None before each
step as a training loop does, the steps interleaved (median of each side's steps), each step
timed from an idle GPU (the host's launches before the GPU has work count) and, in a second
column, four steps back to back per timing (a loop that reads its loss back only at logged steps,
as `fox train` does: the host queues the next step while the GPU runs), and in a third, each
model's step captured as a CUDA graph and replayed (the GPU's work alone: a step whose host
launches more slowly than its GPU runs is timed at the GPU's speed; the losses of the replays are
the eager steps'). Peak memory:
the largest allocation during a step with the gradients of the step before still held, and from
zero gradients (optimizer state aside).

Their eager step's speed depends on the process: at B=4, T=4096 their FoX (Pro) ran at 134-212k
tokens/s over a dozen processes, ours within 3%; graphed, theirs runs at 253-255k in every
process: their eager step waits on its host. The graphed column is the comparison of the two
GPUs' work (bench/NOTES.md, "Against the authors' implementation").
"""
import argparse
import importlib
import inspect
import math
import sys

import torch

from bench_model import interleaved_ms, mfu, model_125m, training_flops_per_token
from forgetting_transformer.cli.train import capture_training_step

# The configuration fields both implementations name alike (ours copies the authors' names).
SHARED_FIELDS = ("vocab_size", "hidden_size", "hidden_ratio", "intermediate_size",
                 "num_hidden_layers", "num_heads", "num_kv_heads", "hidden_act",
                 "initializer_range", "norm_eps", "tie_word_embeddings", "rope_base", "use_rope",
                 "use_output_gate", "ogate_act", "fgate_type", "fgate_bias_init", "decay_time_min",
                 "decay_time_max", "use_output_norm", "qk_norm", "qk_norm_share_param_across_head",
                 "use_k_shift", "use_v_shift", "log_pruning_tolerance")


def load_authors(src):
    """(config class, model class) of the authors' package at src, imported under its own name
    and then removed from sys.modules, so that our package keeps the name."""
    def ours_or_theirs():
        return [k for k in sys.modules
                if k == "forgetting_transformer" or k.startswith("forgetting_transformer.")]
    saved = {k: sys.modules.pop(k) for k in ours_or_theirs()}
    sys.path.insert(0, src)
    try:
        module = importlib.import_module("forgetting_transformer.model.forgetting_transformer")
        return module.ForgettingTransformerConfig, module.ForgettingTransformerForCausalLM
    finally:
        sys.path.remove(src)
        for k in ours_or_theirs():
            del sys.modules[k]
        sys.modules.update(saved)


def authors_model(classes, ours):
    """Their model with our configuration's values and our model's weights (their fast paths on:
    fused norm and loss)."""
    config_class, model_class = classes
    accepted = inspect.signature(config_class.__init__).parameters
    values = {f: getattr(ours.config, f) for f in SHARED_FIELDS if f in accepted}
    config = config_class(**values, fuse_norm=True, fuse_cross_entropy=True, use_cache=False)
    model = model_class(config).cuda()
    # The parameters have the same names and shapes: the same weights, so the losses must agree.
    model.load_state_dict(ours.state_dict())
    return model


def training_step(model, ids, labels, authors, fresh_gradients=True, per_token=False):
    """forward + backward of the mean token loss under bf16 autocast, as a closure. With
    fresh_gradients the gradients are set to None first, as a training loop's zero_grad() does
    (else the backward adds into the gradients of the step before: a float32 add per parameter,
    ~3 ms a step for either model). Their model gives the per-token loss, whose mean is taken
    outside; ours takes the mean in the loss (reduction="mean", the LM head's gradients made with
    the forward, as `fox train` does), or with per_token as theirs."""
    def step():
        if fresh_gradients:
            model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if authors:
                loss = model(input_ids=ids, labels=labels, use_cache=False).loss.float().mean()
            elif per_token:
                loss = model(ids, labels=labels).float().mean()
            else:
                loss = model(ids, labels=labels, reduction="mean")
        loss.backward()
        return loss
    return step


def graphed_step(model, ids, labels, authors):
    """The training step (the gradients written, not added) captured once as a CUDA graph, as a
    closure that replays it: the GPU's own time for the step, without the host's launches. The
    gradients live in the graph's memory from then on (the capture starts from none, so its
    backward writes them), and the loss is the graph's output."""
    step = training_step(model, ids, labels, authors, fresh_gradients=False)
    graph, loss = capture_training_step(model, step, warmups=3)

    def replay():
        graph.replay()
        return loss
    return replay


def peaks_gib(model, step, other):
    """(peak with the previous step's gradients held, peak from zero gradients), GiB, of model's
    step (fresh_gradients=False), without the other model's parameters (its gradients are
    dropped first): both models live on the GPU, and the allocator counts both."""
    other.zero_grad(set_to_none=True)
    other_bytes = sum(p.numel() * p.element_size() for p in other.parameters())
    out = []
    for held in (True, False):
        step()
        if not held:
            model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        out.append((torch.cuda.max_memory_allocated() - other_bytes) / 2**30)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--authors-src", required=True, help="the authors' repository's src folder")
    ap.add_argument("--archs", default="fox_pro,fox_llama")
    ap.add_argument("--shapes", nargs="+", default=["4x4096", "1x16384"], metavar="BxT")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    classes = load_authors(args.authors_src)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; 125M-class: hidden 768, "
          f"{args.layers} layers, 12 heads, vocab {args.vocab}, bf16 autocast, fwd+bwd")
    print("| model | B x T | ours k tokens/s (MFU) | authors' k tokens/s (MFU) | ratio | ours with "
          "the per-token loss: k tokens/s, ratio | 4 steps a sync: ours / authors' k tokens/s, "
          "ratio | graphed: ours / authors' k tokens/s, ratio | ours peak GiB (held / from zero) "
          "| authors' peak GiB | peak ratio | loss (ours / authors') |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for arch in args.archs.split(","):
        for shape in args.shapes:
            B, T = (int(x) for x in shape.split("x"))
            _, ours = model_125m(arch, args)
            theirs = authors_model(classes, ours)
            ids = torch.randint(0, args.vocab, (B, T), device="cuda")
            labels = torch.randint(0, args.vocab, (B, T), device="cuda")
            our_step = training_step(ours, ids, labels, authors=False)
            their_step = training_step(theirs, ids, labels, authors=True)
            losses = our_step().item(), their_step().item()
            ours_peak = peaks_gib(ours, training_step(ours, ids, labels, False, False), theirs)
            theirs_peak = peaks_gib(theirs, training_step(theirs, ids, labels, True, False), ours)
            per_token_step = training_step(ours, ids, labels, authors=False, per_token=True)
            t_ours, t_theirs, t_per_token = interleaved_ms([our_step, their_step, per_token_step],
                                                           args.reps)
            t_ours_run, t_theirs_run = interleaved_ms([our_step, their_step], args.reps, run=4)
            graphs = [graphed_step(ours, ids, labels, False), graphed_step(theirs, ids, labels, True)]
            graphed_losses = [g().item() for g in graphs]
            assert all(math.isclose(g, e, rel_tol=1e-5) for g, e in zip(graphed_losses, losses)), \
                (graphed_losses, losses)
            t_ours_graph, t_theirs_graph = interleaved_ms(graphs, args.reps)
            flops = training_flops_per_token(ours, T)
            tok = B * T / 1e3
            print(f"| {arch} | {B} x {T} | {tok / t_ours * 1e3:,.0f} "
                  f"({mfu(tok / t_ours * 1e6, flops):.1%}) | {tok / t_theirs * 1e3:,.0f} "
                  f"({mfu(tok / t_theirs * 1e6, flops):.1%}) | {t_theirs / t_ours:.2f} | "
                  f"{tok / t_per_token * 1e3:,.0f}, {t_theirs / t_per_token:.2f} | "
                  f"{tok / t_ours_run * 1e3:,.0f} / {tok / t_theirs_run * 1e3:,.0f}, "
                  f"{t_theirs_run / t_ours_run:.2f} | {tok / t_ours_graph * 1e3:,.0f} / "
                  f"{tok / t_theirs_graph * 1e3:,.0f}, {t_theirs_graph / t_ours_graph:.2f} | "
                  f"{ours_peak[0]:.2f} / {ours_peak[1]:.2f} | {theirs_peak[0]:.2f} / "
                  f"{theirs_peak[1]:.2f} | {ours_peak[0] / theirs_peak[0]:.2f} | "
                  f"{losses[0]:.4f} / {losses[1]:.4f} |", flush=True)
            del ours, theirs, our_step, their_step, per_token_step, graphs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
