"""CUDA benchmark of Forgetting Attention: ours vs FlexAttention (FoX score_mod) vs SDPA (no gate).

Side by side in one run on one GPU: CUDA events after warm-up, median. Each sample times calls
launched back to back behind an untimed one, so that the host's launch work runs under the GPU's, as
in training; ours and SDPA alternate sample by sample, their ratio the median of the pairs' ratios
(time_pair_ms; --per-call: each call timed alone on an idle GPU, ours and SDPA in blocks of their own,
the method before). bf16, causal, half of the
heads "global" (log f ~ U(-1e-3, 0)) and half "local" (log f ~ -1). Throughput in TFLOP/s with
causal forward = 2*B*H*N^2*D FLOPs and backward = 2.5x forward. FlexAttention's forward+backward
computes the gate's gradient too, as ours does (make_flex); the "q,k,v" column leaves it out.

    python3 bench/bench_cuda.py            # the table (markdown)
    python3 bench/bench_cuda.py --check    # first a few large fp64-reference checks of the kernels
    python3 bench/bench_cuda.py --only-check
    python3 bench/bench_cuda.py --quick    # one size per head dim
    python3 bench/bench_cuda.py --kernels  # each kernel's time per call, ours and SDPA's (--quick sizes)
    python3 bench/bench_cuda.py --per-call # each call timed alone (host overheads counted), as before
"""
import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

import forgetting_transformer  # noqa: F401  (loads torch.ops.fox)
from flex_fox import fox_score_mod
from profiling import profiled

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))

op_fwd = torch.ops.fox.forgetting_attention_fwd
op = torch.ops.fox.forgetting_attention


PER_CALL = False  # --per-call


def _sampler(fn, batch_ms):
    """A function k -> ms per call of fn over k calls launched back to back, behind one untimed call
    that keeps the GPU busy while the timed ones are launched (so that launch overheads on the host
    are not counted as GPU time unless they exceed it); and the k that fills batch_ms."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def sample(k):
        fn()
        start.record()
        for _ in range(k):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / k
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    return sample, max(1, int(batch_ms / max(sample(1), 1e-3)))


def time_pair_ms(fn_a, fn_b, min_reps=10, budget_ms=3000.0, batch_ms=8.0):
    """(median ms per call of a, of b, median of the samples' ratios b / a): samples of a and of b
    alternate (a then b, b then a, ...), so that both see the same clocks and temperature; timed in
    blocks of their own, two kernels drift apart by several percent (bench/NOTES.md, CUDA version 95)."""
    if PER_CALL:
        a, b = time_ms(fn_a), time_ms(fn_b)
        return a, b, b / a
    sample_a, k_a = _sampler(fn_a, batch_ms)
    sample_b, k_b = _sampler(fn_b, batch_ms)
    reps = int(max(min_reps, min(100, budget_ms / (2 * batch_ms))))
    a, b, ratio = [], [], []
    for r in range(reps):
        if r % 2 == 0:
            ta = sample_a(k_a)
            tb = sample_b(k_b)
        else:
            tb = sample_b(k_b)
            ta = sample_a(k_a)
        a.append(ta)
        b.append(tb)
        ratio.append(tb / ta)
    return statistics.median(a), statistics.median(b), statistics.median(ratio)


def time_ms(fn, min_reps=5, budget_ms=1500.0):
    """Median of CUDA-event timings after warm-up; the repetitions fit a time budget. Calls back to
    back (_sampler), or with --per-call each call alone after a synchronisation."""
    if not PER_CALL:
        sample, k = _sampler(fn, 8.0)
        return statistics.median(sample(k) for _ in range(int(max(min_reps, min(100, budget_ms / 8.0)))))
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    reps = int(max(min_reps, min(100, budget_ms / once)))
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gates(B, N, H, device):
    """Half the heads global (log f in [-1e-3, 0]), half local (log f ~ -1)."""
    glob = -1e-3 * torch.rand(B, N, H, device=device)
    local = F.logsigmoid(torch.randn(B, N, H, device=device) * 0.5 - 0.5)
    return torch.where(torch.arange(H, device=device) % 2 == 0, glob, local).float()


def make_flex(B, H, N):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    torch._dynamo.reset()  # one compile per shape; avoids hitting the recompile limit
    mask = create_block_mask(causal, B, None, N, N, device="cuda")
    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v, c_q, c_k):  # q/k/v (B, H, N, D); c_q, c_k (B, H, N) fp32 cumulative log f
        return compiled(q, k, v, score_mod=fox_score_mod(c_q, c_k), block_mask=mask)
    return run


def flex_gate_check(flex_grads, ours_dlogf, D, N):
    """FlexAttention's gate gradient, turned into d log f (a reverse cumulative sum of dc over the
    positions), against ours: both must be training the same model. Prints the relative gap."""
    dc = (flex_grads[3] + flex_grads[4]).transpose(1, 2)  # (B, N, H)
    dlogf = dc.flip(1).cumsum(1).flip(1)
    gap = (dlogf - ours_dlogf).abs().max() / ours_dlogf.abs().max()
    print(f"# D={D} N={N}: flex d log f against ours: max |diff| / max |ours| = {gap:.1e}",
          file=sys.stderr)
    if not gap < 0.05:
        raise RuntimeError(f"flex gate gradient disagrees with ours ({gap:.2e})")


def prefill_inputs(D, H, N):
    """The prefill benchmarks' inputs: B = 16384 / N sequences of bf16 q, k, v (B, N, H, D), the
    gates, an output gradient, and q, k, v and the gradient head-first (B, H, N, D) for SDPA."""
    B = 16384 // N
    q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    g = gates(B, N, H, "cuda")
    do = torch.randn_like(q)
    qh, kh, vh, doh = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))
    return B, (q, k, v, g, do), (qh, kh, vh, doh)


def bench_prefill(D, H, N, thr=None, with_flex=True, with_sdpa=True):
    B, (q, k, v, g, do), (qh, kh, vh, doh) = prefill_inputs(D, H, N)
    flops_fwd = 2.0 * B * H * N * N * D
    row = {"D": D, "H": H, "N": N, "B": B}

    def ours_fwd():
        op_fwd(q, k, v, g, None, None, None, thr)

    qg, kg, vg, gg = (x.detach().clone().requires_grad_(True) for x in (q, k, v, g))

    def ours_fb():
        out = op(qg, kg, vg, gg, None, None, None, thr)
        return torch.autograd.grad(out, (qg, kg, vg, gg), do)

    from torch.nn.attention import SDPBackend, sdpa_kernel
    qs, ks, vs = (x.detach().clone().requires_grad_(True) for x in (qh, kh, vh))

    def sdpa_fwd():
        F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)

    def sdpa_fb():
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        torch.autograd.grad(out, (qs, ks, vs), doh)

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        for key, ours, sdpa in (("fwd", ours_fwd, sdpa_fwd), ("fb", ours_fb, sdpa_fb)):
            if with_sdpa:
                row["ours_" + key], row["sdpa_" + key], row["sdpa_over_ours_" + key] = time_pair_ms(ours, sdpa)
            else:
                row["ours_" + key] = time_ms(ours)

    if with_flex:
        try:
            flex = make_flex(B, H, N)
            c = g.cumsum(1).transpose(1, 2).contiguous()
            row["flex_fwd"] = time_ms(lambda: flex(qh, kh, vh, c, c))
            qf, kf, vf = (x.detach().clone().requires_grad_(True) for x in (qh, kh, vh))

            def flex_fb_qkv():  # without the gate's gradient: not a trainable FoX, for reference
                out = flex(qf, kf, vf, c, c)
                return torch.autograd.grad(out, (qf, kf, vf), doh)
            row["flex_fb_qkv"] = time_ms(flex_fb_qkv)
            cq, ck = (c.clone().requires_grad_(True) for _ in range(2))

            def flex_fb():  # FoX's full backward: q, k, v and the gate
                out = flex(qf, kf, vf, cq, ck)
                return torch.autograd.grad(out, (qf, kf, vf, cq, ck), doh)
            try:
                flex_gate_check(flex_fb(), ours_fb()[3], D, N)
                row["flex_fb"] = time_ms(flex_fb)
            except Exception as e:
                print(f"# flex backward with the gate gradient failed: {type(e).__name__}: {e}",
                      file=sys.stderr)
        except Exception as e:
            print(f"# flex failed: {type(e).__name__}: {e}", file=sys.stderr)
    tflops = lambda ms, mult: mult * flops_fwd / (ms * 1e-3) / 1e12
    for key in list(row):
        if key.endswith("_fwd"):
            row[key + "_tf"] = tflops(row[key], 1.0)
        elif key.endswith("_fb") or key.endswith("_fb_qkv"):
            row[key + "_tf"] = tflops(row[key], 3.5)
    return row


def kernel_times(fn, reps=10):
    """{kernel name: time per call in us} of fn's CUDA kernels (torch profiler, after warm-up)."""
    prof = profiled(fn, reps, warmup=3)
    times = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name] = times.get(e.name, 0.0) + e.device_time / reps
    return times


def print_kernel_breakdown(D, H, N):
    """Where a call's time goes, kernel by kernel: ours (forward; forward+backward with the gate's
    gradient) against SDPA without a gate, bench_prefill's inputs."""
    B, (q, k, v, g, do), (qh, kh, vh, doh) = prefill_inputs(D, H, N)
    qg, kg, vg, gg = (x.detach().clone().requires_grad_(True) for x in (q, k, v, g))
    qs, ks, vs = (x.detach().clone().requires_grad_(True) for x in (qh, kh, vh))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(*x):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(*x, is_causal=True)
    passes = {
        "ours forward": lambda: op_fwd(q, k, v, g, None, None, None, None),
        "SDPA forward": lambda: sdpa(qh, kh, vh),
        "ours forward+backward": lambda: torch.autograd.grad(op(qg, kg, vg, gg, None, None, None, None),
                                                             (qg, kg, vg, gg), do),
        "SDPA forward+backward": lambda: torch.autograd.grad(sdpa(qs, ks, vs), (qs, ks, vs), doh),
    }
    print(f"\nD={D} H={H} N={N} B={B} (us per call)", flush=True)
    for name, fn in passes.items():
        times = kernel_times(fn)
        print(f"  {name}: {sum(times.values()):.1f}", flush=True)
        for kernel, t in sorted(times.items(), key=lambda x: -x[1]):
            if t >= 0.5:
                print(f"    {t:9.1f}  {kernel[:100]}", flush=True)


def bench_decode(B=1, H=16, D=128, Tk=32768, Tq=1):
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, Tq, H, D, device=dev, dtype=dt)
    k = torch.randn(B, Tk, H, D, device=dev, dtype=dt)
    v = torch.randn(B, Tk, H, D, device=dev, dtype=dt)
    g = gates(B, Tk, H, dev)
    ours = time_ms(lambda: op_fwd(q, k, v, g))
    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    sdpa = time_ms(lambda: F.scaled_dot_product_attention(qh, kh, vh))
    kv_bytes = 2 * k.numel() * k.element_size()
    return {"ours_ms": ours, "sdpa_ms": sdpa, "ours_gbs": kv_bytes / ours / 1e6,
            "sdpa_gbs": kv_bytes / sdpa / 1e6}


def bench_memory(N=65536, H=16, D=128):
    """Peak memory (MiB above the inputs) of one forward+backward, B=1, bf16, causal."""
    dev, dt = "cuda", torch.bfloat16

    def peak(fn):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    q, k, v = (torch.randn(1, N, H, D, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    g = gates(1, N, H, dev).requires_grad_()
    do = torch.randn_like(q)
    ours = peak(lambda: op(q, k, v, g, None, None, None, None).backward(do))
    qh, kh, vh, doh = (x.detach().transpose(1, 2).contiguous() for x in (q, k, v, do))
    for x in (qh, kh, vh):
        x.requires_grad_()
    sdpa = peak(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).backward(doh))
    return ours, sdpa


# ---- large checks against the float64 reference ---------------------------------------------------

def check_case(name, B, Tq, Tk, H, Hkv, D, dtype, regime="mixed", seq_start=None, cu_seqlens=None,
               grads=True):
    from conftest import make_inputs
    from reference import FLOORS, forward_backward, max_abs_err, naive_attention
    q, k, v, g = make_inputs(B=B, Tq=Tq, Tk=Tk, H=H, Hkv=Hkv, D=D, dtype=dtype, device="cuda",
                             regime=regime)
    ss = None if seq_start is None else torch.tensor(seq_start, device="cuda")
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device="cuda")
    do = torch.randn(q.shape, device="cuda")
    fn = lambda *x: op(*x, ss, cu, None, None)
    inputs = (q, k, v, g)
    if grads:
        got = forward_backward(fn, inputs, do.to(dtype))
        ref = forward_backward(lambda *x: naive_attention(*x, seq_start=ss, cu_seqlens=cu),
                               [x.double() for x in inputs], do.double())
        naive = forward_backward(lambda *x: naive_attention(*x, seq_start=ss, cu_seqlens=cu, dtype=dtype),
                                 inputs, do.to(dtype))
        got, ref, naive = [got[0]] + got[1], [ref[0]] + ref[1], [naive[0]] + naive[1]
    else:
        with torch.no_grad():
            got = [fn(*inputs)]
            ref = [naive_attention(*[x.double() for x in inputs], seq_start=ss, cu_seqlens=cu)]
            naive = [naive_attention(*inputs, seq_start=ss, cu_seqlens=cu, dtype=dtype)]
    ok = True
    msgs = []
    for nm, a, r, n in zip(("out", "dq", "dk", "dv", "dlogf"), got, ref, naive):
        err, nerr = max_abs_err(a, r), max_abs_err(n, r)
        bound = 2 * nerr + FLOORS[dtype] * max(1.0, r.abs().max().item())
        good = bool(torch.isfinite(a).all()) and err <= bound
        ok &= good
        msgs.append(f"{nm} {err:.2e}/{bound:.2e}{'' if good else ' FAIL'}")
    print(f"{'ok  ' if ok else 'FAIL'} {name}: " + ", ".join(msgs), flush=True)
    return ok


def run_checks():
    results = []
    for dt in (torch.bfloat16, torch.float16):
        for D in (64, 128):
            results.append(check_case(f"fast fwd {dt} D={D} T=1100 GQA", 2, 1100, 1100, 4, 2, D, dt))
        results.append(check_case(f"fast fwd {dt} D=128 Tq<Tk seq_start", 2, 300, 1500, 4, 4, 128, dt,
                                  seq_start=[0, 700]))
    results.append(check_case("generic fp32 D=96 varlen", 1, 1500, 1500, 4, 1, 96, torch.float32,
                              cu_seqlens=[0, 10, 700, 700, 1500]))
    for Tq in (1, 5, 16):
        results.append(check_case(f"split-KV decode Tq={Tq} bf16", 2, Tq, 9000, 8, 2, 128,
                                  torch.bfloat16, seq_start=[0, 3000], grads=(Tq == 5)))
    results.append(check_case("split-KV decode fp16 D=64 GQA", 3, 2, 4000, 8, 1, 64, torch.float16,
                              seq_start=[0, 100, 3999], grads=False))
    results.append(check_case("split-KV decode fp32 D=40 strong gates", 1, 3, 6000, 4, 4, 40,
                              torch.float32, regime="strong", grads=False))
    # determinism of the backward
    q = torch.randn(2, 777, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 777, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    g = gates(2, 777, 8, "cuda")
    out, lse = op_fwd(q, k, v, g)
    do = torch.randn_like(out)
    first = torch.ops.fox.forgetting_attention_bwd(do, q, k, v, g, out, lse)
    same = all(all(torch.equal(a, b) for a, b in zip(first, torch.ops.fox.forgetting_attention_bwd(
        do, q, k, v, g, out, lse))) for _ in range(3))
    print(f"{'ok  ' if same else 'FAIL'} backward bitwise deterministic", flush=True)
    results.append(same)
    print(f"checks: {sum(results)}/{len(results)} passed", flush=True)
    return all(results)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--only-check", action="store_true", help="the checks, no timing")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--kernels", action="store_true",
                    help="each kernel's time per call, ours and SDPA's, at the --quick sizes; no table")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--per-call", action="store_true",
                    help="each call timed alone on an idle GPU, ours and SDPA in blocks (the method before)")
    ap.add_argument("--threshold", type=float, default=-20.0, help="ACP threshold of the ACP rows")
    args = ap.parse_args()
    global PER_CALL
    PER_CALL = args.per_call
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    if args.check or args.only_check:
        ok = run_checks()
        if args.only_check:
            sys.exit(0 if ok else 1)
    if args.kernels:
        for D, H in ((64, 32), (128, 16)):
            for N in (2048, 16384):
                print_kernel_breakdown(D, H, N)
        return
    sizes = [2048, 16384] if args.quick else [2048, 4096, 8192, 16384]
    print("\n| D | H | N | B | ours fwd | ours+ACP fwd | flex fwd | sdpa fwd | ours f+b | ours+ACP f+b "
          "| flex f+b | flex f+b q,k,v | sdpa f+b | ours/flex fwd | ours/flex f+b | ours+ACP/flex f+b "
          "| ours/flex f+b q,k,v | ours/sdpa fwd | ours/sdpa f+b |")
    print("|---" * 19 + "|")
    for D, H in ((64, 32), (128, 16)):
        for N in sizes:
            torch.cuda.empty_cache()
            r = bench_prefill(D, H, N, with_flex=not args.no_flex)
            acp = bench_prefill(D, H, N, thr=args.threshold, with_flex=False, with_sdpa=False)
            r["acp_fb_tf"] = acp["ours_fb_tf"]
            f = lambda key, src=r: f"{src[key]:.0f}" if key in src else "-"
            ratio = lambda a, b: f"{r[a] / r[b]:.2f}" if a in r and b in r else "-"
            paired = lambda key: f"{r[key]:.2f}" if key in r else "-"
            print(f"| {D} | {H} | {N} | {r['B']} | {f('ours_fwd_tf')} | {f('ours_fwd_tf', acp)} | "
                  f"{f('flex_fwd_tf')} | {f('sdpa_fwd_tf')} | {f('ours_fb_tf')} | {f('acp_fb_tf')} | "
                  f"{f('flex_fb_tf')} | {f('flex_fb_qkv_tf')} | {f('sdpa_fb_tf')} | "
                  f"{ratio('ours_fwd_tf', 'flex_fwd_tf')} | {ratio('ours_fb_tf', 'flex_fb_tf')} | "
                  f"{ratio('acp_fb_tf', 'flex_fb_tf')} | {ratio('ours_fb_tf', 'flex_fb_qkv_tf')} | "
                  f"{paired('sdpa_over_ours_fwd')} | {paired('sdpa_over_ours_fb')} |", flush=True)
    print()
    for B, Tk in ((1, 32768), (8, 32768), (1, 131072)):
        d = bench_decode(B=B, Tk=Tk)
        print(f"decode B={B} H=16 D=128 Tq=1 Tk={Tk // 1024}k bf16: ours {d['ours_ms'] * 1e3:.1f} us "
              f"({d['ours_gbs']:.0f} GB/s of K+V), SDPA {d['sdpa_ms'] * 1e3:.1f} us ({d['sdpa_gbs']:.0f} GB/s), "
              f"ours/SDPA time {d['ours_ms'] / d['sdpa_ms']:.2f}", flush=True)
    if not args.quick:
        torch.cuda.empty_cache()
        ours, sdpa = bench_memory()
        print(f"\npeak memory of fwd+bwd, B=1 H=16 D=128 N=64k bf16 (MiB above the inputs): ours "
              f"{ours:.0f}, SDPA {sdpa:.0f}, ratio {ours / sdpa:.2f}", flush=True)


if __name__ == "__main__":
    main()
