"""CPU benchmark of Forgetting Attention: fox vs the naive formula vs torch SDPA (no gate).

Times forward and forward+backward (median of a few runs after a warm-up) and measures the peak
resident memory of forward+backward in a fresh subprocess per case. Causal, B=1, H=8.

    python bench/bench_cpu.py                    # full grid, markdown table on stdout
    python bench/bench_cpu.py --seqlens 512 1024 --head-dims 64 --dtypes float32
"""
import argparse
import json
import math
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import forgetting_transformer as fox

IMPLS = ("fox", "naive", "sdpa")


def naive(q, k, v, log_fgate):
    T, D = q.shape[1], q.shape[-1]
    c = log_fgate.float().cumsum(1).transpose(1, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, k).float() / math.sqrt(D) + c[..., :, None] - c[..., None, :]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    p = s.masked_fill(~mask, float("-inf")).softmax(-1).to(q.dtype)
    return torch.einsum("bhij,bjhd->bihd", p, v)


def make_inputs(impl, B, T, H, D, dtype):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, dtype=dtype) for _ in range(3))
    g = F.logsigmoid(torch.randn(B, T, H) + 3)
    if impl == "sdpa":  # SDPA wants (B, H, T, D)
        q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    return [x.requires_grad_() for x in (q, k, v, g)]


def run(impl, q, k, v, g):
    if impl == "fox":
        return fox.forgetting_attention(q, k, v, g)
    if impl == "naive":
        return naive(q, k, v, g)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def timed(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_memory_mib(impl, B, T, H, D, dtype):
    """Peak RSS growth of one forward+backward, measured in a fresh process (Linux: the peak is
    reset through /proc/self/clear_refs after the inputs exist)."""
    code = (
        "import sys, torch; sys.path.insert(0, 'bench'); import bench_cpu as b;"
        f"x = b.make_inputs('{impl}', {B}, {T}, {H}, {D}, torch.{dtype});"
        "hwm = lambda: int([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]);"
        "rss = lambda: int([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1]);"
        "open('/proc/self/clear_refs', 'w').write('5'); base = rss();"
        f"b.run('{impl}', *x).float().sum().backward();"
        "print((hwm() - base) / 1024)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()

    rows = []
    print(f"threads: {torch.get_num_threads()}, B={args.batch}, H={args.heads}, causal")
    print("| dtype | D | N | fox fwd ms | naive fwd ms | sdpa fwd ms | fox f+b ms | naive f+b ms | "
          "sdpa f+b ms | fox/sdpa f+b | naive/fox f+b | peak MiB fox / naive / sdpa |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for D in args.head_dims:
            for T in args.seqlens:
                row = {"dtype": dtype_name, "D": D, "N": T}
                for impl in IMPLS:
                    x = make_inputs(impl, args.batch, T, args.heads, D, dtype)
                    with torch.no_grad():
                        row[f"{impl}_fwd"] = timed(lambda: run(impl, *x), args.repeats) * 1e3

                    def step():
                        for t in x:
                            t.grad = None
                        run(impl, *x).float().sum().backward()

                    row[f"{impl}_fwdbwd"] = timed(step, args.repeats) * 1e3
                    if not args.no_memory:
                        row[f"{impl}_mem"] = peak_memory_mib(impl, args.batch, T, args.heads, D, dtype_name)
                rows.append(row)
                mem = ("-" if args.no_memory else
                       " / ".join(f"{row[f'{i}_mem']:.0f}" for i in IMPLS))
                print(f"| {dtype_name} | {D} | {T} | {row['fox_fwd']:.1f} | {row['naive_fwd']:.1f} | "
                      f"{row['sdpa_fwd']:.1f} | {row['fox_fwdbwd']:.1f} | {row['naive_fwdbwd']:.1f} | "
                      f"{row['sdpa_fwdbwd']:.1f} | {row['fox_fwdbwd'] / row['sdpa_fwdbwd']:.2f} | "
                      f"{row['naive_fwdbwd'] / row['fox_fwdbwd']:.1f} | {mem} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
