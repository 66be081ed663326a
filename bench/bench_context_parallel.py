"""Context parallelism of a whole model, measured: a 125M-class FoX (Pro) training step (forward +
backward, bf16 autocast, batch 1) on one sequence split over the processes of torchrun, against
one process. Per sequence length: k tokens/s of the whole sequence, the model FLOP utilization
of each GPU, the peak memory of a rank, and the device time of the collectives in a step: all of
it, and the part no other kernel overlaps (exposed).

    torchrun --nproc_per_node 1 bench/bench_context_parallel.py --seqlen 32768 65536
    torchrun --nproc_per_node 2 bench/bench_context_parallel.py --seqlen 65536 131072 262144
    torchrun --nproc_per_node 2 bench/bench_context_parallel.py --ab FOX_CP_OVERLAP=0
    torchrun --nproc_per_node 2 bench/bench_context_parallel.py --longest   # longest that fits
    torchrun --nproc_per_node 2 bench/bench_context_parallel.py --device cpu --tiny --seqlen 64
    torchrun --nproc_per_node 2 bench/bench_context_parallel.py --forget -0.05 --ab FOX_CP_PRUNE=0

`--forget LOGF` measures pruning across ranks: every head forgets at the constant rate log f = LOGF
per token (the forget gate projections' weights zeroed, their biases set to match) and the model
prunes (log_pruning_tolerance -10), so a rank receives only the pieces its queries can reach
(`--ab FOX_CP_PRUNE=0`: the all-gather of the whole prefix, side by side). `--global-heads N`
keeps N heads a layer global (log f = -1e-5), as trained FoX models have them beside local ones:
with `--ab FOX_CP_PRUNE_HEADS=1` only those heads' K, V and gates travel past the neighbouring
piece (head by head, side by side with the default, where every head travels with them).

`--ab VAR=VALUE` times the steps with that environment switch against the default, interleaved
step by step in the same processes (FOX_CP_OVERLAP=0: no backward prefetch, an all-reduce in
place of the reduce-scatter). Every rank runs the same steps; rank 0 prints a markdown table row
per length and variant. A length that runs out of memory ends the list (every rank must run out
in the same step, or the others wait in a collective: the zigzag layout gives every rank the same
work, so they do).
"""
import argparse
import contextlib
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from forgetting_transformer import nn as fnn
from forgetting_transformer.distributed import set_context_parallel, shard_sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import switches  # noqa: E402
from bench_model import mfu, training_flops_per_token  # noqa: E402


def build(args, device):
    torch.manual_seed(0)
    hidden, layers, heads, vocab = (64, 2, 4, 256) if args.tiny else (768, 12, 12, 32768)
    c = fnn.ForgettingTransformerConfig(vocab_size=vocab, hidden_size=hidden,
                                        num_hidden_layers=layers, num_heads=heads).preset("fox_pro")
    if args.forget is not None:
        c.log_pruning_tolerance = -10.0
    model = fnn.ForgettingTransformerForCausalLM(c).to(device)
    if args.forget is not None:
        set_forget_rate(model, args.forget, args.global_heads)
    return model, vocab


def set_forget_rate(model, log_f, global_heads=0):
    """Every head of every layer forgets at log f = log_f per token, whatever the input, but the
    first `global_heads` of each layer at log f = -1e-5 (they reach the whole sequence): the
    forget gate projections' weights zeroed, their biases b with logsigmoid(b) = log f."""
    if not log_f < 0:
        raise SystemExit(f"--forget must be a negative log f, got {log_f}")
    logit = lambda lf: lf - math.log(-math.expm1(lf))  # noqa: E731  (logit of f = exp(lf))
    gates = [(n, p) for n, p in model.named_parameters() if "fgate_proj" in n]
    if not gates:
        raise SystemExit("--forget: the model has no fgate_proj")
    with torch.no_grad():
        for name, p in gates:
            if not name.endswith("bias"):
                p.zero_()
                continue
            p.fill_(logit(log_f))
            p[:global_heads] = logit(-1e-5)


def step_fn(model, ids, device):
    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(ids, labels=ids).float().sum()
        loss.backward()
    return step


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def timed_once(step, device):
    sync(device)
    t0 = time.perf_counter()
    step()
    sync(device)
    return time.perf_counter() - t0


def _merged(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def communication_ms(step, device, steps):
    """(all, exposed) device ms of the collectives (nccl kernels) a step, averaged over `steps`
    profiled steps, from the profiler's trace: exposed is the time when a collective runs and no
    other kernel, copy or fill does."""
    if device.type != "cuda":
        return float("nan"), float("nan")
    import json
    import tempfile
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    comm, work = [], []
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            (comm if "nccl" in e.get("name", "").lower() else work).append(span)
    total, exposed = exposed_time(comm, work)
    return total / 1e3 / steps, exposed / 1e3 / steps


def exposed_time(comm, work):
    """(time covered by the `comm` spans, the part of it that no `work` span covers); spans are
    (start, end) pairs and may overlap among themselves."""
    comm, work = _merged(comm), _merged(work)
    total = sum(b - a for a, b in comm)
    covered, i = 0.0, 0
    for a, b in comm:  # the part of each collective that some other work overlaps
        while i < len(work) and work[i][1] <= a:
            i += 1
        j = i
        while j < len(work) and work[j][0] < b:
            covered += min(b, work[j][1]) - max(a, work[j][0])
            j += 1
    return total, total - covered


def part_of(T, vocab, device, rank, world):
    """This rank's part (zigzag) of the sequence of T random tokens every rank draws alike."""
    ids = torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(T)).to(device)
    return shard_sequence(ids, rank, world, "zigzag") if world > 1 else ids


def print_top_kernels(step, n, rank):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    if rank == 0:
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=n,
                                        max_name_column_width=90), flush=True)


def measure(model, vocab, T, args, device, rank, world, switch):
    """{variant: (k tokens/s, step ms, (all, exposed) collective ms)} and the peak GiB of this
    rank for one sequence of T tokens (the variants timed step by step, interleaved), or None
    when it does not fit."""
    step = step_fn(model, part_of(T, vocab, device, rank, world), device)
    variants = {"default": contextlib.nullcontext}
    if switch:
        variants[switch] = lambda: switches.environment(*switches.parse(switch))
    try:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        times = {name: [] for name in variants}
        for rep in range(args.reps + 2):
            for name, context in variants.items():
                with context():
                    seconds = timed_once(step, device)
                if rep >= 2:  # two warm-up steps of each
                    times[name].append(seconds)
        result = {}
        for name, context in variants.items():
            with context():
                comm = communication_ms(step, device, args.comm_steps) if world > 1 \
                    else (0.0, 0.0)
            seconds = statistics.median(times[name])
            result[name] = (T / seconds / 1e3, seconds * 1e3, comm)
        model.zero_grad(set_to_none=True)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    except torch.cuda.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        return None
    return result, peak


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[65536, 131072])
    ap.add_argument("--longest", action="store_true",
                    help="double the length from 16k until a step no longer fits")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy model (smoke test)")
    ap.add_argument("--comm-steps", type=int, default=2, metavar="N",
                    help="profiled steps the collective times are averaged over")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after each length, rank 0 prints the N kernels of one step that take "
                         "the most device time")
    ap.add_argument("--forget", type=float, default=None, metavar="LOGF",
                    help="every head forgets at log f = LOGF per token and the model prunes "
                         "(for pruning across ranks)")
    ap.add_argument("--global-heads", type=int, default=0, metavar="N",
                    help="with --forget, the first N heads of each layer forget at log f = -1e-5 "
                         "(global heads beside local ones)")
    ap.add_argument("--ab", metavar="VAR=VALUE", default=None,
                    help="also time the steps with this environment switch (side by side)")
    args = ap.parse_args()
    if args.ab:
        switches.parse(args.ab)  # a malformed switch fails before any process group exists
    if args.global_heads and args.forget is None:
        raise SystemExit("--global-heads needs --forget (the rate of the other heads)")
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, vocab = build(args, device)
    if world > 1:
        set_context_parallel(model, layout="zigzag")
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        precision = "bf16 autocast" if device.type == "cuda" else "float32"
        kept = f" but {args.global_heads} a layer at -1e-5" if args.global_heads else ""
        gates = "" if args.forget is None else \
            f", every head at log f = {args.forget}{kept}, pruning (tolerance -10; MFU counts " \
            f"unpruned attention: effective)"
        print(f"# {name} x {world}; FoX (Pro) {'toy' if args.tiny else '125M-class'}, B=1, "
              f"{precision}, fwd+bwd, zigzag layout{gates}")
        print("| processes | T | variant | k tokens/s | MFU per GPU | step ms | peak GiB per rank "
              "| collectives ms per step (exposed) |")
        print("|---|---|---|---|---|---|---|---|", flush=True)
    lengths = args.seqlen if not args.longest else [16384 * 2**i for i in range(8)]
    last = None  # (T, peak GiB) of the last length that fitted
    for T in lengths:
        if world > 1 and device.type == "cuda" and last is not None:
            # Over several ranks an out-of-memory error may strike one rank inside a collective
            # while the others wait in it for ever: skip a length whose peak, scaled from the
            # last one (memory grows linearly with T), would come near the GPU's memory.
            predicted = last[1] * T / last[0]
            capacity = torch.cuda.get_device_properties(device).total_memory / 2**30
            fits = torch.tensor([1 if predicted < 0.95 * capacity else 0], device=device)
            dist.all_reduce(fits, op=dist.ReduceOp.MIN)
            if fits.item() == 0:
                if rank == 0:
                    print(f"| {world} | {T} | | does not fit (predicted peak {predicted:.0f} of "
                          f"{capacity:.0f} GiB) | | | | |", flush=True)
                break
        result = measure(model, vocab, T, args, device, rank, world, args.ab)
        # Every rank must agree to stop: one that ran out of memory stops them all.
        fits = torch.tensor([0 if result is None else 1], device=device)
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)
        if rank == 0:
            if fits.item() == 0:
                print(f"| {world} | {T} | | does not fit | | | | |", flush=True)
            else:
                variants, peak = result
                flops = training_flops_per_token(model, T)
                for variant, (tps, ms, (comm, exposed)) in variants.items():
                    use = mfu(tps * 1e3 / world, flops) if device.type == "cuda" else float("nan")
                    use = f"{use:.1%}" if use == use else "-"
                    print(f"| {world} | {T} | {variant} | {tps:,.1f} | {use} | {ms:,.0f} | "
                          f"{peak:.2f} | {comm:.1f} ({exposed:.1f}) |", flush=True)
        if fits.item() == 0:
            break
        last = (T, result[1])
        if args.profile and device.type == "cuda":
            print_top_kernels(step_fn(model, part_of(T, vocab, device, rank, world), device),
                              args.profile, rank)
            model.zero_grad(set_to_none=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
