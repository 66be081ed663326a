"""Context parallelism of a whole model, measured: a 125M-class FoX (Pro) training step (forward +
backward, bf16 autocast, batch 1) on one sequence split over the processes of torchrun, against
the same per-process tokens on one process. Per sequence length: k tokens/s of the whole sequence,
the peak memory of a rank, and the time of the collectives in a step (the all-gather form does not
overlap them with compute: all of it is exposed).

    torchrun --nproc_per_node 1 bench/bench_context_parallel.py --seqlen 32768 65536
    torchrun --nproc_per_node 2 bench/bench_context_parallel.py --seqlen 65536 131072 262144
    torchrun --nproc_per_node 2 bench/bench_context_parallel.py --longest   # longest that fits
    torchrun --nproc_per_node 2 bench/bench_context_parallel.py --device cpu --tiny --seqlen 64

Every rank runs the same steps; rank 0 prints a markdown table row per length. A length that
runs out of memory ends the list (every rank must run out in the same step, or the others wait in
a collective: the zigzag layout gives every rank the same work, so they do).
"""
import argparse
import os
import statistics

import torch
import torch.distributed as dist

from forgetting_transformer import nn as fnn
from forgetting_transformer.distributed import set_context_parallel, shard_sequence


def build(args, device):
    torch.manual_seed(0)
    hidden, layers, heads, vocab = (64, 2, 4, 256) if args.tiny else (768, 12, 12, 32768)
    c = fnn.ForgettingTransformerConfig(vocab_size=vocab, hidden_size=hidden,
                                        num_hidden_layers=layers, num_heads=heads).preset("fox_pro")
    return fnn.ForgettingTransformerForCausalLM(c).to(device), vocab


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


def timed(step, device, reps):
    import time
    for _ in range(2):
        step()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def collective_ms(step, device):
    """Device time of the communication kernels in one step (nccl), from the profiler."""
    if device.type != "cuda":
        return float("nan")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages()
               if "nccl" in e.key.lower()) / 1e3


def measure(model, vocab, T, args, device, rank, world):
    """(k tokens/s, peak GiB of this rank, collective ms) for one sequence of T tokens, or None
    when it does not fit."""
    ids = torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(T)).to(device)
    ids = shard_sequence(ids, rank, world, "zigzag") if world > 1 else ids
    step = step_fn(model, ids, device)
    try:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        seconds = timed(step, device, args.reps)
        comm = collective_ms(step, device) if world > 1 else 0.0
        model.zero_grad(set_to_none=True)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    except torch.cuda.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        return None
    return T / seconds / 1e3, peak, comm


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[65536, 131072])
    ap.add_argument("--longest", action="store_true",
                    help="double the length from 16k until a step no longer fits")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy model (smoke test)")
    args = ap.parse_args()
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
        print(f"# {name} x {world}; FoX (Pro) {'toy' if args.tiny else '125M-class'}, B=1, "
              f"{precision}, fwd+bwd, zigzag layout")
        print("| processes | T | k tokens/s | peak GiB per rank | collectives ms per step |")
        print("|---|---|---|---|---|", flush=True)
    lengths = args.seqlen if not args.longest else [16384 * 2**i for i in range(8)]
    for T in lengths:
        result = measure(model, vocab, T, args, device, rank, world)
        # Every rank must agree to stop: one that ran out of memory stops them all.
        fits = torch.tensor([0 if result is None else 1], device=device)
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)
        if rank == 0:
            if fits.item() == 0:
                print(f"| {world} | {T} | does not fit | | |", flush=True)
            else:
                tps, peak, comm = result
                print(f"| {world} | {T} | {tps:,.1f} | {peak:.2f} | {comm:.1f} |", flush=True)
        if fits.item() == 0:
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
