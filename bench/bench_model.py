"""Model-level benchmark on a GPU: forward+backward tokens/s of a 125M-class FoX (Pro) and
Transformer (Pro) with the fox::nn C++ modules, against the same architectures in eager PyTorch
(FoX attention through FlexAttention with a FoX score_mod, Transformer attention through SDPA).
Same weights in both (the eager model reads the C++ model's state_dict); bf16 autocast; CUDA
events after warm-up, median.

    python3 bench/bench_model.py [--seqlen 4096 --batch 4 --layers 12]
    python3 bench/bench_model.py --checkpoint-activations   # the cost of per-block checkpointing
    python3 bench/bench_model.py --memory    # peak and saved tensors, memory savings off vs on
    python3 bench/bench_model.py --gaps      # how long and where the GPU waits for the host
"""
import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from forgetting_transformer import nn as fnn
from forgetting_transformer.reference import rope, shift  # the same KV-shift and RoPE math
from flex_fox import fox_score_mod
from profiling import profiled
import switches

flex = torch.compile(flex_attention, dynamic=False)


def rms(x, w, groups, eps):
    shape = x.shape
    g = x.float().reshape(*shape[:-1], groups, -1)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return (g.reshape(shape) * w).to(x.dtype)


def eager_attention(c, p, prefix, x, block_mask):
    B, T, _ = x.shape
    H, D = c.num_heads, c.hidden_size // c.num_heads
    q = F.linear(x, p[prefix + "q_proj.weight"])
    k = shift(x, p, prefix + "k_proj.", H) if c.use_k_shift else F.linear(x, p[prefix + "k_proj.weight"])
    v = shift(x, p, prefix + "v_proj.", H) if c.use_v_shift else F.linear(x, p[prefix + "v_proj.weight"])
    if c.qk_norm:
        q, k = rms(q, p[prefix + "q_norm.weight"], H, 1e-5), rms(k, p[prefix + "k_norm.weight"], H, 1e-5)
    q, k, v = (t.view(B, T, H, D).to(torch.bfloat16) for t in (q, k, v))
    if c.use_rope:
        q, k = rope(q, c.rope_base), rope(k, c.rope_base)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
    if c.fgate_type == "full":
        logf = F.logsigmoid(F.linear(x, p[prefix + "fgate_proj.weight"], p[prefix + "fgate_proj.bias"]).float())
        # Cumulative log f in (B, H, T), summed along the last dim (ATen's scan over a middle dim is
        # slow); two tensors, so that the gate gets its gradient (fox_score_mod).
        cum = logf.transpose(1, 2).cumsum(-1)
        o = flex(q, k, v, score_mod=fox_score_mod(cum, cum.clone()), block_mask=block_mask)
    else:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o = o.transpose(1, 2).reshape(B, T, H * D)
    if c.use_output_norm:
        o = rms(o, p[prefix + "output_norm.weight"], H, c.norm_eps)
    if c.use_output_gate:
        o = o * torch.sigmoid(F.linear(x, p[prefix + "ogate_proj.weight"]))
    return F.linear(o, p[prefix + "o_proj.weight"])


def eager_loss(c, p, ids, labels, block_mask):
    h = F.embedding(ids, p["model.embeddings.weight"])
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        h = h + eager_attention(c, p, pre + "attn.", rms(h, p[pre + "attn_norm.weight"], 1, c.norm_eps), block_mask)
        g, y = F.linear(rms(h, p[pre + "mlp_norm.weight"], 1, c.norm_eps), p[pre + "mlp.gate_proj.weight"]).chunk(2, -1)
        h = h + F.linear(F.silu(g) * y, p[pre + "mlp.down_proj.weight"])
    logits = F.linear(rms(h, p["model.norm.weight"], 1, c.norm_eps), p["lm_head.weight"])
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)


def interleaved_ms(steps, reps=10, run=1):
    """Median ms of each closure after 3 warm-up calls, the closures alternating call by call (a
    drift of the clocks during the run hits every side alike). Each timing starts from an idle
    GPU; with run > 1 it covers `run` calls back to back, without a synchronization between them
    (a training loop that reads its loss back only at logged steps: the host queues the next
    step while the GPU runs the last), and gives the time per call."""
    for step in steps:
        for _ in range(3):
            step()
    torch.cuda.synchronize()
    times = [[] for _ in steps]
    for _ in range(reps):
        for step, t in zip(steps, times):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(run):
                step()
            b.record()
            torch.cuda.synchronize()
            t.append(a.elapsed_time(b) / run)
    return [statistics.median(t) for t in times]


def time_step(step, reps=10):
    return interleaved_ms([step], reps)[0]


def print_profile(title, step, steps=3, top=30):
    """Kernel time per step, the busiest kernels first, and how much of the step the GPU is busy."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(steps):
            step()
        b.record()
        torch.cuda.synchronize()
    wall = a.elapsed_time(b) / steps
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0 and str(e.device_type).endswith("CUDA")]
    kernels.sort(key=lambda e: -e.device_time_total)
    busy = sum(e.device_time_total for e in kernels) / steps / 1e3
    print(f"\n## {title}: {wall:.1f} ms per step (profiled), kernels {busy:.1f} ms")
    for e in kernels[:top]:
        print(f"{e.device_time_total / steps / 1e3:8.2f} ms {e.count // steps:5d}x  {e.key[:110]}")


def idle_summary(gpu, steps, min_us=2.0):
    """Where the GPU idled over `steps` steps, from the trace's GPU events in time order (dicts
    with name, ts and dur in us): kernels a step, busy and idle ms a step (the stretches between
    the steps, the host's sync and the next step's start, left out), the idle in stretches over
    min_us, the idle us by tenth of a step's kernels (in launch order), the idle us a step by the
    kernel that waited (stretches over min_us), and the stretches largest first (us, before,
    after)."""
    n = len(gpu) // steps
    gaps = [(after["ts"] - (before["ts"] + before.get("dur", 0)), i + 1, before["name"],
             after["name"]) for i, (before, after) in enumerate(zip(gpu, gpu[1:]))]
    inside = sorted((g for g in gaps if g[1] % n), key=lambda g: -g[0])
    tenths = [0.0] * 10
    by_kernel = {}
    for idle, k, _, after in inside:
        tenths[(k % n) * 10 // n] += idle / steps
        if idle > min_us:
            by_kernel[after] = by_kernel.get(after, 0.0) + idle / steps
    return {
        "kernels": n,
        "busy_ms": sum(e.get("dur", 0) for e in gpu) / steps / 1e3,
        "idle_ms": sum(g[0] for g in inside) / steps / 1e3,
        "idle_long_ms": sum(g[0] for g in inside if g[0] > min_us) / steps / 1e3,
        "tenths_us": tenths,
        "by_kernel_us": by_kernel,
        "largest": [(idle, before, after) for idle, _, before, after in inside],
    }


def print_gaps(title, step, steps=3, top=25, min_us=2.0):
    """Where the GPU idles in a step (idle_summary), from the CUDA activity trace alone (no
    host-side tracing, which would slow the host and make its own gaps)."""
    import json
    import tempfile
    prof = profiled(step, steps)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                 key=lambda e: e["ts"])
    s = idle_summary(gpu, steps, min_us)
    print(f"\n## {title}: {s['kernels']} kernels a step, {s['busy_ms']:.2f} ms busy, idle between "
          f"them {s['idle_ms']:.2f} ms, of which {s['idle_long_ms']:.2f} ms in stretches over "
          f"{min_us:.0f} us")
    print("idle us by tenth of the step's kernels: " + " ".join(f"{t:.0f}" for t in s["tenths_us"]))
    print("idle us a step | the kernel that waited")
    for name, idle in sorted(s["by_kernel_us"].items(), key=lambda kv: -kv[1])[:top]:
        print(f"{idle:9.1f} | {name[:140]}")
    print("largest single stretches (us | kernel before -> kernel after):")
    for idle, before, after in s["largest"][:12]:
        print(f"{idle:9.1f} | {before[:64]} -> {after[:64]}")


def print_host_ops(title, forward, steps=3, top=25):
    """The host's ATen calls in a training forward (CPU activity only): calls a step and self
    host time a step by op, most time first. The profiler's own cost per call inflates every
    row alike; the ranking and the counts are what this is for."""
    from torch.profiler import ProfilerActivity
    prof = profiled(forward, steps, [ProfilerActivity.CPU], warmup=1)
    ops = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    ops.sort(key=lambda e: -e.self_cpu_time_total)
    calls = sum(e.count for e in ops) // steps
    print(f"\n## {title}: forward's ATen calls, {calls} a step (self host us a step | calls | op)")
    for e in ops[:top]:
        print(f"{e.self_cpu_time_total / steps:9.0f} | {e.count // steps:5d} | {e.key}")


def model_125m(arch, args):
    """The 125M-class model of the tables (seeded), on the GPU: (config, model)."""
    torch.manual_seed(0)
    c = fnn.ForgettingTransformerConfig(vocab_size=args.vocab, hidden_size=768,
                                        num_hidden_layers=args.layers, num_heads=12).preset(arch)
    return c, fnn.ForgettingTransformerForCausalLM(c).cuda()


# Dense bf16 peak of the GPU (the datasheet's, without sparsity) for the model FLOP utilization.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def training_flops_per_token(model, T):
    """Model FLOPs of one training token (forward + backward = 3x forward, no recomputation
    counted): 6 per parameter of the matrix products (every linear layer and the LM head; the
    embedding lookup is free) plus causal attention's two products, 6 * T * hidden per layer
    (2 * 2 * T/2 * hidden forward)."""
    c = model.config
    embedding = c.vocab_size * c.hidden_size
    matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2) - embedding
    if c.tie_word_embeddings:
        matrices += embedding
    return 6 * matrices + 6 * T * c.hidden_size * c.num_hidden_layers


def mfu(tokens_per_s, flops_per_token):
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    return float("nan") if peak is None else tokens_per_s * flops_per_token / (peak * 1e12)


def fox_training_step(model, ids, labels, reduction="mean"):
    """forward + backward of the mean per-token loss under bf16 autocast, as a closure: reduced
    in the loss (reduction "mean": the LM head's gradients come with the forward, as a trainer
    would call it), or with reduction "none" the per-token loss and its mean taken outside."""
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if reduction == "none":
                loss = model(ids, labels=labels).float().mean()
            else:
                loss = model(ids, labels=labels, reduction=reduction)
        loss.backward()
        return loss
    return step


def checkpointing_table(args):
    """fox_torch with and without per-block activation checkpointing: tokens/s and peak memory of
    a training step (parameters, gradients and activations; no optimizer state)."""
    B, T = args.batch, args.seqlen
    print("\n| model | k tokens/s | peak GiB | checkpointed: k tokens/s | peak GiB | time cost |")
    print("|---|---|---|---|---|---|")
    for arch in ("fox_pro", "transformer_pro"):
        _, model = model_125m(arch, args)
        ids = torch.randint(0, args.vocab, (B, T), device="cuda")
        step = fox_training_step(model, ids, ids)
        cells = []
        for checkpointing in (False, True):
            model.set_activation_checkpointing(checkpointing)
            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**30
            cells.append((B * T / time_step(step), peak))
        (tps, peak), (tps_ck, peak_ck) = cells
        print(f"| {arch} | {tps:,.0f} | {peak:.2f} | {tps_ck:,.0f} | {peak_ck:.2f} | "
              f"{tps / tps_ck:.2f}x the time |", flush=True)
        del model
        torch.cuda.empty_cache()


# The knobs of the training step's memory savings (GatedMLP's product recomputed in the
# backward, the LM head and loss in row chunks): all set turns both off; unset, both are on.
SAVINGS_OFF = {"FOX_RECOMPUTE_GATED": "0", "FOX_LOSS_CHUNK_ROWS": "0"}


def set_savings(on):
    for name, value in SAVINGS_OFF.items():
        if on:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def memory_census(args, top=16):
    """Where a training step's memory goes: the peak, the parameters and gradients, and the
    tensors saved for the backward pass (storages counted once) by dtype and shape; with the
    memory savings off and then on (one process; the knobs are read at each call), and the step
    time of each."""
    B, T = args.batch, args.seqlen
    for arch in ("fox_pro", "transformer_pro"):
        _, model = model_125m(arch, args)
        ids = torch.randint(0, args.vocab, (B, T), device="cuda")
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        fox_training_step(model, ids, ids)()  # warm-up (cuBLAS workspaces), outside the counts
        for on in (False, True):
            set_savings(on)
            storages, by_kind = set(), {}

            def pack(t):
                key = t.untyped_storage().data_ptr()
                if key not in storages and t.device.type == "cuda":
                    storages.add(key)
                    kind = (str(t.dtype).replace("torch.", ""), tuple(t.shape))
                    by_kind[kind] = by_kind.get(kind, 0) + t.untyped_storage().nbytes()
                return t

            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(ids, labels=ids).float().mean()
            after_forward = torch.cuda.memory_allocated() - base
            loss.backward()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**30
            saved = sum(by_kind.values())
            del loss
            ms = time_step(fox_training_step(model, ids, ids))
            print(f"\n## {arch}, B={B}, T={T}, memory savings {'on' if on else 'off'}: peak "
                  f"{peak:.2f} GiB; parameters {params / 2**30:.2f} GiB (+ as much for "
                  f"gradients); held after forward {after_forward / 2**30:.2f} GiB, of which saved "
                  f"for backward {saved / 2**30:.2f} GiB; step {ms:.1f} ms")
            print("| GiB | dtype | shape |\n|---|---|---|")
            for (dtype, shape), n in sorted(by_kind.items(), key=lambda kv: -kv[1])[:top]:
                print(f"| {n / 2**30:.3f} | {dtype} | {shape} |")
        set_savings(True)
        del model
        torch.cuda.empty_cache()


def step_from_zero(arch, args):
    """(model, its training step on random tokens with the gradients set to None first, as a
    training loop's zero_grad() does)."""
    _, model = model_125m(arch, args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seqlen), device="cuda")
    plain = fox_training_step(model, ids, ids)

    def step():
        model.zero_grad(set_to_none=True)
        return plain()
    return model, step


def head_start_ms(step, reps=10, cycles=40_000_000):
    """Median ms of (step as timed, the step after the GPU sleeps ~20 ms first): with the head
    start the host has queued the step's kernels before the GPU reaches them, so the second is
    the GPU's own time and the difference is how long the GPU waits for the host's launches."""
    for _ in range(3):
        step()
    plain, ahead = [], []
    for _ in range(reps):
        for sleep, times in ((False, plain), (True, ahead)):
            a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            torch.cuda.synchronize()
            a.record()
            if sleep:
                torch.cuda._sleep(cycles)
            b.record()
            step()
            c.record()
            torch.cuda.synchronize()
            times.append(b.elapsed_time(c))
    return statistics.median(plain), statistics.median(ahead)


def zero_grad_ms(model, step, reps=10):
    """Median host ms of zero_grad(set_to_none=True) after a step, ours (the C++ tree releases its
    gradients) against torch::nn::Module::zero_grad (which detaches each gradient first)."""
    out = []
    for release in (model.zero_grad, model.cpp_module.zero_grad):
        times = []
        for _ in range(reps):
            step()
            torch.cuda.synchronize()
            t = time.perf_counter()
            release()
            times.append((time.perf_counter() - t) * 1e3)
        out.append(statistics.median(times))
    return out


def gaps_table(args):
    """The step's time against the GPU's own time (a head start), and where the GPU waits."""
    B, T = args.batch, args.seqlen
    for arch in args.archs.split(","):
        model, step = step_from_zero(arch, args)
        t, gpu = head_start_ms(step)
        print(f"\n# {arch}, B={B}, T={T}: step {t:.2f} ms, with a head start {gpu:.2f} ms: the "
              f"GPU waits {t - gpu:.2f} ms for the host")
        print_gaps(arch, step)
        ours, module_s = zero_grad_ms(model, step)
        print(f"\nzero_grad: {ours:.3f} ms of host time (torch::nn::Module's: {module_s:.3f} ms)")
        ids = torch.randint(0, args.vocab, (B, T), device="cuda")

        def forward():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return model(ids, labels=ids, reduction="mean")
        print_host_ops(arch, forward)
        del model
        torch.cuda.empty_cache()


def ab_table(args, reps=20):
    """fox_torch's step, default against an environment switch set (--ab VAR=VALUE): the two
    alternate step by step in one process, median of each; the losses must agree."""
    name, value = switches.parse(args.ab)
    B, T = args.batch, args.seqlen
    what = ("the forward's logits without autograd" if args.logits else
            "fwd+bwd, gradients set to None before each step")
    print(f"# {torch.cuda.get_device_name()}; 125M-class, B={B}, T={T}, vocab {args.vocab}, bf16 "
          f"autocast, {what}")
    print(f"| model | default ms | {args.ab} ms | ratio | loss (default / switched) |\n"
          "|---|---|---|---|---|")
    for arch in args.archs.split(","):
        model, step = step_from_zero(arch, args)
        if args.logits:
            ids = torch.randint(0, args.vocab, (B, T), device="cuda")

            def step():
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    return model(ids).float().mean()

        def switched():
            with switches.environment(name, value):
                return step()

        losses = step().item(), switched().item()
        t0, t1 = interleaved_ms([step, switched], reps)
        print(f"| {arch} | {t0:.1f} | {t1:.1f} | {t1 / t0:.3f} | {losses[0]:.4f} / {losses[1]:.4f} |",
              flush=True)
        del model
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--archs", default="fox_pro,transformer_pro",
                    help="comma-separated presets of the main table (also fox_llama, "
                         "transformer_llama)")
    ap.add_argument("--profile", action="store_true",
                    help="also print the CUDA kernels that take the most time in each step")
    ap.add_argument("--gaps", action="store_true",
                    help="only where fox_torch's step leaves the GPU idle (gradients set to None "
                         "before each step, as a training loop does), and the forward's ATen "
                         "calls on the host")
    ap.add_argument("--checkpoint-activations", action="store_true",
                    help="only the table of fox_torch with and without per-block activation "
                         "checkpointing (tokens/s, peak memory)")
    ap.add_argument("--ab", metavar="VAR=VALUE", default=None,
                    help="only fox_torch, default against this environment switch set, the steps "
                         "interleaved (the switches are read at each call)")
    ap.add_argument("--logits", action="store_true",
                    help="with --ab: time the forward without labels or autograd (the logits, "
                         "as an evaluation asks for them) instead of the training step")
    ap.add_argument("--memory", action="store_true",
                    help="only the memory census of a training step (peak, saved tensors), with "
                         "the memory savings off and on, and the step time of each")
    args = ap.parse_args()
    if args.ab:
        return ab_table(args)
    if args.checkpoint_activations:
        return checkpointing_table(args)
    if args.gaps:
        return gaps_table(args)
    if args.memory:
        return memory_census(args)
    B, T = args.batch, args.seqlen
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; 125M-class: hidden 768, "
          f"{args.layers} layers, 12 heads, B={B}, T={T}, bf16 autocast, fwd+bwd")
    print("| model | fox_torch k tokens/s (MFU) | eager k tokens/s (MFU) | ratio | loss (fox / eager) |")
    print("|---|---|---|---|---|")
    block_mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, T, T, device="cuda")
    notes = []
    for arch in args.archs.split(","):
        eager_name = "FlexAttention" if arch.startswith("fox") else "SDPA"
        c, model = model_125m(arch, args)
        params = {k: v.detach().clone().requires_grad_(v.is_floating_point())
                  for k, v in model.state_dict().items()}
        ids = torch.randint(0, args.vocab, (B, T), device="cuda")
        labels = torch.randint(0, args.vocab, (B, T), device="cuda")

        fox_step = fox_training_step(model, ids, labels)

        def eager_step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = eager_loss(c, params, ids, labels, block_mask).mean()
            loss.backward()
            return loss

        fox_loss, eager_loss_value = fox_step().item(), eager_step().item()
        # Both implementations train the same parameters: the gate projections' gradients agree.
        fox_grads = dict(model.named_parameters())
        gaps = [((fox_grads[n].grad - params[n].grad).norm() / fox_grads[n].grad.norm()).item()
                for n in params if "fgate_proj" in n and n in fox_grads]
        if gaps:
            notes.append(f"{arch}: gate projection gradients, fox_torch against eager: largest "
                         f"relative gap {max(gaps):.1e} over {len(gaps)} tensors")
        t_fox, t_eager = time_step(fox_step), time_step(eager_step)
        tok = B * T / 1e3
        flops = training_flops_per_token(model, T)
        u_fox, u_eager = mfu(tok / t_fox * 1e6, flops), mfu(tok / t_eager * 1e6, flops)
        print(f"| {arch} | {tok / t_fox * 1e3:,.0f} ({u_fox:.1%}) | {tok / t_eager * 1e3:,.0f} "
              f"({u_eager:.1%}, {eager_name}) | {t_eager / t_fox:.2f} | {fox_loss:.4f} / "
              f"{eager_loss_value:.4f} |", flush=True)
        if args.profile:
            for name, step in (("fox_torch", fox_step), ("eager", eager_step)):
                print_profile(f"{arch}, {name}", step)
        del model, params
        torch.cuda.empty_cache()
    for note in notes:
        print(f"\n{note}")


if __name__ == "__main__":
    main()
