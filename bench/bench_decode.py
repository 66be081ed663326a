"""Decoding kernel against SDPA without a gate: one (or a few) query tokens against a long cache.

For every shape of the grid (B, H / Hkv, D, Tk) both run on the same tensors in one process, with
CUDA events, after warm-up, L2 flushed before every call (decoding reads the cache from HBM in a
real model: the previous layers evicted it), the two sides interleaved call by call, median of the
repetitions. Next to each time:
the floor, the bytes that must be read (K, V, and for ours log f) over the measured copy bandwidth.
With --f16-gates a third column times ours on float16 gates (half the gate bytes; the compact
cache of GQA models at head dim 64), interleaved with the other two.

    python3 bench/bench_decode.py                 # the full grid (B 1/8/64, five head layouts, D
                                                  # 64/128, Tk 2k-128k), bf16, Tq = 1
    python3 bench/bench_decode.py --quick --tq 1 4 16 --out DIR
    python3 bench/bench_decode.py --profile 1,32,4,64,2048 8,16,16,128,32768   # B,H,Hkv,D,Tk:
                                                  # the kernels of each side, with their times
    python3 bench/bench_decode.py --ab FOX_DECODE_SPLITS=2   # a last column: ours with that
                                                  # switch set (the op reads it per call)
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F

import forgetting_transformer  # noqa: F401  (loads the ops)
import switches

GRID_B = (1, 8, 64)
GRID_HEADS = ((16, 16), (32, 32), (32, 8), (32, 4), (12, 12))
GRID_D = (64, 128)
GRID_TK = (2048, 8192, 32768, 131072)


def timed_us(fn, flush, reps):
    return timed_side_by_side([fn], flush, reps)[0]


def timed_side_by_side(fns, flush, reps):
    """Median us of each function, the functions interleaved within every repetition (so that a
    drift of the clocks or of the memory system during the run hits both sides alike), and the
    order rotated from one repetition to the next: a call's time depends on its place in the
    sequence (the same SDPA call measured 3-6% slower last than first on a 13 us cell), so no
    side keeps one place."""
    for fn in fns:
        for _ in range(3):
            fn()
    times = [[] for _ in fns]
    for rep in range(reps):
        for i in range(len(fns)):
            j = (i + rep) % len(fns)
            fn, t = fns[j], times[j]
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            t.append(start.elapsed_time(end) * 1e3)
    return [sorted(t)[len(t) // 2] for t in times]


def with_env(fn, name, value):
    """fn run with the environment variable set."""
    def run():
        with switches.environment(name, value):
            return fn()
    return run


def copy_bandwidth(flush):
    """HBM bandwidth of a large device copy (bytes read + written per second)."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    us = timed_us(lambda: y.copy_(x), flush, 10)
    return 2 * x.numel() / (us * 1e-6)


def causal_mask(tq, tk, device):
    """The last tq of tk positions, causal (SDPA's is_causal aligns to the top-left)."""
    return torch.ones(tq, tk, dtype=torch.bool, device=device).tril(tk - tq)


def decode_inputs(B, tq, H, Hkv, D, Tk, dtype, f16_gates=False):
    """q, k, v, log f of ours and the (B, H, T, D) views and mask of SDPA's call, as closures
    (ours, SDPA[, ours on float16 gates])."""
    q = torch.randn(B, tq, H, D, device="cuda", dtype=dtype)
    k = torch.randn(B, Tk, Hkv, D, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    g = F.logsigmoid(torch.randn(B, Tk, H, device="cuda") + 3.0)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    mask = None if tq == 1 else causal_mask(tq, Tk, "cuda")
    ours = lambda: torch.ops.fox.forgetting_attention_fwd(q, k, v, g)  # noqa: E731
    sdpa = lambda: F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask,  # noqa: E731
                                                  enable_gqa=Hkv < H)
    if not f16_gates:
        return ours, sdpa
    g16 = g.half()
    ours16 = lambda: torch.ops.fox.forgetting_attention_fwd(q, k, v, g16)  # noqa: E731
    return ours, sdpa, ours16


def profile(shapes, dtype, tq):
    """Kernel names and device times of ours and SDPA for a few shapes (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    for shape in shapes:
        B, H, Hkv, D, Tk = (int(x) for x in shape.split(","))
        ours, sdpa = decode_inputs(B, tq, H, Hkv, D, Tk, dtype)
        sides = {"ours": ours, "SDPA": sdpa}
        for name, fn in sides.items():
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
            print(f"--- {name} B={B} H={H}/{Hkv} D={D} Tk={Tk} Tq={tq} (20 calls)")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6,
                                            max_name_column_width=70))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a subset: B 1/8, Tk 8k/32k")
    ap.add_argument("--tq", type=int, nargs="+", default=[1])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--f16-gates", action="store_true",
                    help="also time ours on float16 gates (a third column)")
    ap.add_argument("--max-gib", type=float, default=40.0, help="skip shapes whose cache is larger")
    ap.add_argument("--out", default=None, help="write decode.json and decode.md here")
    ap.add_argument("--shapes", nargs="+", metavar="B,H,HKV,D,TK",
                    help="time these shapes instead of the grid")
    ap.add_argument("--ab", metavar="VAR=VALUE", default=None,
                    help="also time ours with this environment switch set (a last column)")
    ap.add_argument("--profile", nargs="+", metavar="B,H,HKV,D,TK",
                    help="only list the kernels of these shapes with their times")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.profile:
        return profile(args.profile, dtype, args.tq[0])
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    bandwidth = copy_bandwidth(flush)
    device = torch.cuda.get_device_name()
    print(f"{device}: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    grid_b = (1, 8) if args.quick else GRID_B
    grid_tk = (8192, 32768) if args.quick else GRID_TK
    rows = []
    header = ("| Tq | B | H / Hkv | D | Tk | floor us (ours / SDPA) | ours us | SDPA us | ours/SDPA "
              "| ours % of bw |")
    columns = 10
    if args.f16_gates:
        header += " floor f16 us | ours f16 us | f16/SDPA | f16 % of bw |"
        columns += 4
    if args.ab:
        ab_name, ab_value = switches.parse(args.ab)
        header += f" ours, {args.ab} us | that/ours |"
        columns += 2
    print(header + "\n" + "|---" * columns + "|")
    shapes = ([tuple(int(x) for x in sh.split(",")) for sh in args.shapes] if args.shapes else
              [(B, H, Hkv, D, Tk) for B in grid_b for H, Hkv in GRID_HEADS for D in GRID_D
               for Tk in grid_tk])
    for tq in args.tq:
        for B, H, Hkv, D, Tk in shapes:
            kv_bytes = 2 * B * Tk * Hkv * D * dtype.itemsize
            gate_bytes = 4 * B * Tk * H
            if (kv_bytes + gate_bytes) / 2**30 > args.max_gib:
                continue
            fns = list(decode_inputs(B, tq, H, Hkv, D, Tk, dtype, args.f16_gates))
            if args.ab:
                fns.append(with_env(fns[0], ab_name, ab_value))
            times = timed_side_by_side(fns, flush, args.reps)
            ours, sdpa = times[:2]
            floor_ours = (kv_bytes + gate_bytes) / bandwidth * 1e6
            floor_sdpa = kv_bytes / bandwidth * 1e6
            row = dict(tq=tq, B=B, H=H, Hkv=Hkv, D=D, Tk=Tk, ours_us=ours,
                       sdpa_us=sdpa, ratio=ours / sdpa, floor_ours_us=floor_ours,
                       floor_sdpa_us=floor_sdpa, bw_fraction=floor_ours / ours)
            line = (f"| {tq} | {B} | {H}/{Hkv} | {D} | {Tk} | {floor_ours:.1f} / "
                    f"{floor_sdpa:.1f} | {ours:.1f} | {sdpa:.1f} | {ours / sdpa:.2f} | "
                    f"{100 * floor_ours / ours:.0f}% |")
            if args.f16_gates:
                ours16 = times[2]
                floor16 = (kv_bytes + gate_bytes / 2) / bandwidth * 1e6
                row.update(f16_us=ours16, f16_ratio=ours16 / sdpa, floor_f16_us=floor16,
                           f16_bw_fraction=floor16 / ours16)
                line += (f" {floor16:.1f} | {ours16:.1f} | {ours16 / sdpa:.2f} | "
                         f"{100 * floor16 / ours16:.0f}% |")
            if args.ab:
                row.update(ab_us=times[-1], ab_ratio=times[-1] / ours)
                line += f" {times[-1]:.1f} | {times[-1] / ours:.2f} |"
            rows.append(row)
            print(line, flush=True)
            torch.cuda.empty_cache()
    worst = max(rows, key=lambda r: r["ratio"])
    within = sum(r["ratio"] <= 1.1 for r in rows)
    print(f"{within}/{len(rows)} shapes within 1.1x of SDPA; worst {worst['ratio']:.2f}x at "
          f"B={worst['B']} H={worst['H']}/{worst['Hkv']} D={worst['D']} Tk={worst['Tk']}")
    if args.ab:
        ab = sorted(r["ab_ratio"] for r in rows)
        print(f"{args.ab} against the default: median {ab[len(ab) // 2]:.3f}x, "
              f"{ab[0]:.2f}-{ab[-1]:.2f}x; within 1.1x of SDPA with it: "
              f"{sum(r['ab_us'] / r['sdpa_us'] <= 1.1 for r in rows)}/{len(rows)}")
    if args.f16_gates:
        best = [min(r["ratio"], r["f16_ratio"]) for r in rows]
        print(f"float16 gates: {sum(r['f16_ratio'] <= 1.1 for r in rows)}/{len(rows)} within 1.1x; "
              f"the better of the two gate dtypes: {sum(b <= 1.1 for b in best)}/{len(rows)}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode.json"), "w") as f:
            json.dump(dict(device=device, bandwidth=bandwidth, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
