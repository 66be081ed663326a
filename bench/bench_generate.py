"""Generation speed, side by side in one process on one GPU: our FoX (Pro) (static cache, decoding
step replayed as a CUDA graph; also its eager step and the growing cache, for comparison) against
Hugging Face transformers' LlamaForCausalLM of the same size (eager with its dynamic cache, and its
static cache under torch.compile(mode="reduce-overhead") where that runs). Random weights, bf16,
greedy, a fixed number of new tokens (no stop token).

Per batch size: prefill time, ms per generated token (the decoding steps after the first, which
also captures the graph), tokens/s, and the bytes floor of one step: weights + the cache read at
the mean context (K, V and, for FoX, log f) over the measured copy bandwidth.

    python3 bench/bench_generate.py                       # 125M, B 1/16/64, 2k prompt, 128 new
    python3 bench/bench_generate.py --model 760m --batch 1 --prompt 32768 131072 --new 64
    python3 bench/bench_generate.py --gate-cache --kv-heads 4 --prompt 32768   # float16 gate cache
"""
import argparse
import contextlib
import json
import os
import time

import torch

from forgetting_transformer import nn as fnn
import switches

SIZES = {  # hidden, layers, heads (FoX's head dim 64 at both sizes, as the paper's configs)
    "125m": (768, 12, 12),
    "760m": (1536, 24, 24),
}
VOCAB = 50277  # the GPT-NeoX tokenizer of the authors' runs


def sync_time():
    torch.cuda.synchronize()
    return time.perf_counter()


def copy_bandwidth():
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    t0 = sync_time()
    for _ in range(10):
        y.copy_(x)
    return 2 * x.numel() * 10 / (sync_time() - t0)


def fox_model(size, kv_heads=None):
    hidden, layers, heads = SIZES[size]
    cfg = fnn.ForgettingTransformerConfig(vocab_size=VOCAB, hidden_size=hidden,
                                          num_hidden_layers=layers, num_heads=heads,
                                          num_kv_heads=kv_heads)
    return fnn.ForgettingTransformerForCausalLM(cfg.preset("fox_pro")).to(
        "cuda", torch.bfloat16).eval()


def time_fox(model, ids, new, **options):
    """(prefill s, s per decoding step) through a GenerationSession."""
    opts = fnn.GenerationOptions(max_new_tokens=new, **options)
    session = fnn.GenerationSession(model.cpp_module, ids, opts)
    t0 = sync_time()
    session.prefill()
    t1 = sync_time()
    session.step()  # the first step captures the graph
    t2 = sync_time()
    for _ in range(new - 2):
        session.step()
    t3 = sync_time()
    return t1 - t0, (t3 - t2) / (new - 2)


def time_fox_dynamic(model, ids, new):
    """The growing cache (no graph): whole generate, minus a separately timed prefill."""
    with torch.no_grad():
        t0 = sync_time()
        model(ids, cache=model.new_cache())
        t1 = sync_time()
        model.generate(ids, max_new_tokens=new, static_cache=False)
        t2 = sync_time()
    prefill = t1 - t0
    return prefill, (t2 - t1 - prefill) / (new - 1)


def llama_model(size, fox_cfg, max_positions):
    from transformers import LlamaConfig, LlamaForCausalLM
    hidden, layers, heads = SIZES[size]
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads,
                      intermediate_size=fox_cfg.intermediate_size or fnn.mlp_intermediate_size(
                          hidden, fox_cfg.hidden_ratio),
                      max_position_embeddings=max_positions, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


def time_llama(model, ids, new, warmup_new=3, **kw):
    mask = torch.ones_like(ids)
    gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, **kw)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask,
                       **dict(gen, max_new_tokens=warmup_new, min_new_tokens=warmup_new))
        t0 = sync_time()
        model(ids, attention_mask=mask, use_cache=True)
        t1 = sync_time()
        model.generate(ids, attention_mask=mask, **gen)
        t2 = sync_time()
    prefill = t1 - t0
    return prefill, (t2 - t1 - prefill) / (new - 1)


def profile_step(model, B, prompt, steps=10):
    """The kernels of one replayed decoding step (torch.profiler), with their device times."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    ids = torch.randint(0, VOCAB, (B, prompt), device="cuda")
    session = fnn.GenerationSession(model.cpp_module, ids,
                                    fnn.GenerationOptions(max_new_tokens=steps + 8))
    session.prefill()
    for _ in range(4):
        session.step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            session.step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    kernels = sum(e.count for e in events) / steps
    total = sum(e.self_device_time_total for e in events) / steps
    print(f"B={B}, prompt {prompt}: {kernels:.0f} kernels per step, {total:.0f} us of kernel time")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40,
                                    max_name_column_width=90))


def interleaved_table(args, title, columns, variant):
    """Our graph-replayed step in two variants side by side (interleaved, median of 3): variant(v)
    is a context manager and the GenerationOptions of variant v (v = 0, 1)."""
    fox = fox_model(args.model, args.kv_heads)
    hidden, layers, heads = SIZES[args.model]
    print(f"{torch.cuda.get_device_name()}: {args.model} FoX (Pro) with {heads}/"
          f"{args.kv_heads or heads} heads, bf16, graph replay, {args.new} new tokens; {title}")
    print(f"| B | prompt | {columns[0]} ms/token | {columns[1]} ms/token | ratio |\n"
          "|---|---|---|---|---|")
    for prompt in args.prompt:
        for B in args.batch:
            ids = torch.randint(0, VOCAB, (B, prompt), device="cuda")
            time_fox(fox, ids[:, :64], 8)
            times = ([], [])
            for _ in range(3):
                for v in (0, 1):
                    context, options = variant(v)
                    with context:
                        times[v].append(time_fox(fox, ids, args.new, **options)[1])
            a, b = (sorted(t)[1] * 1e3 for t in times)
            print(f"| {B} | {prompt} | {a:.3f} | {b:.3f} | {b / a:.3f} |", flush=True)
            del ids
            torch.cuda.empty_cache()


def gate_cache_table(args):
    """float32 against float16 gate caches, for a GQA variant of the model (--kv-heads)."""
    interleaved_table(args, "the static cache's gates", ("float32 gates", "float16 gates"),
                      lambda v: (contextlib.nullcontext(),
                                 dict(gate_cache_dtype=torch.float16) if v else {}))


def ab_table(args):
    """The default against a switch set (--ab VAR=VALUE)."""
    name, value = switches.parse(args.ab)
    interleaved_table(args, f"default against {args.ab}", ("default", args.ab),
                      lambda v: (switches.environment(name, value) if v
                                 else contextlib.nullcontext(), {}))


def prefill_table(args, reps=5):
    """The session's prefill (the LM head on each row's last position) against the model's forward
    over the same prompt into the same kind of cache (every position's logits, what the prefill
    made before): ms and peak GiB above the model and cache, the two alternating."""
    model = fox_model(args.model)
    m = model.cpp_module
    print(f"# {torch.cuda.get_device_name()}; {args.model}, vocab {VOCAB}, bf16, prefill of one "
          "prompt into a static cache")
    print("| B | prompt | session prefill ms | forward with all logits ms | peak GiB (session / "
          "forward) |\n|---|---|---|---|---|")
    for B in args.batch:
        for prompt in args.prompt:
            ids = torch.randint(0, VOCAB, (B, prompt), device="cuda")

            def session():
                opts = fnn.GenerationOptions(max_new_tokens=2)
                fnn.GenerationSession(m, ids, opts).prefill()

            def forward():
                with torch.no_grad():
                    m.forward(ids, None, m.new_static_cache(B, prompt + 2))[:, -1].argmax(-1)

            times, peaks = [[], []], [0, 0]
            for rep in range(reps + 1):
                for i, fn in enumerate((session, forward)):
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    t0 = sync_time()
                    fn()
                    t1 = sync_time()
                    if rep:  # the first round warms up
                        times[i].append(t1 - t0)
                        peaks[i] = max(peaks[i], torch.cuda.max_memory_allocated() - base)
            med = [sorted(t)[len(t) // 2] * 1e3 for t in times]
            print(f"| {B} | {prompt} | {med[0]:.1f} | {med[1]:.1f} | {peaks[0] / 2**30:.2f} / "
                  f"{peaks[1] / 2**30:.2f} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="125m", choices=sorted(SIZES))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt", type=int, nargs="+", default=[2048])
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--no-llama", action="store_true", help="ours only")
    ap.add_argument("--no-compile", action="store_true", help="skip LLaMA static + compile")
    ap.add_argument("--out", default=None, help="write generate.json here")
    ap.add_argument("--profile", action="store_true",
                    help="only list the kernels of one replayed step (first batch and prompt)")
    ap.add_argument("--kv-heads", type=int, default=None,
                    help="with --gate-cache: key/value heads of the GQA variant")
    ap.add_argument("--gate-cache", action="store_true",
                    help="only ours with float32 against float16 gate caches (GQA: --kv-heads)")
    ap.add_argument("--ab", metavar="VAR=VALUE", default=None,
                    help="only ours, default against this environment switch set")
    ap.add_argument("--prefill", action="store_true",
                    help="only the session's prefill against a forward that makes every "
                         "position's logits (time and peak memory)")
    args = ap.parse_args()
    if args.prefill:
        return prefill_table(args)
    if args.ab:
        return ab_table(args)
    if args.gate_cache:
        return gate_cache_table(args)
    if args.profile:
        return profile_step(fox_model(args.model), args.batch[0], args.prompt[0])
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    device = torch.cuda.get_device_name()
    print(f"{device}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; {args.model}, bf16, "
          f"{args.new} new tokens")
    fox = fox_model(args.model)
    weight_bytes = sum(p.numel() * p.element_size() for p in fox.parameters())
    hidden, layers, heads = SIZES[args.model]
    head_dim = hidden // heads
    llama = None
    if not args.no_llama:
        try:
            llama = llama_model(args.model, fox.config, max(args.prompt) + args.new + 8)
        except Exception as e:  # transformers missing or incompatible: ours alone
            print(f"LLaMA baseline unavailable: {type(e).__name__}: {e}")
    rows = []
    print("| B | prompt | impl | prefill ms | ms/token | tokens/s (all rows) | floor ms/token "
          "| x floor |\n|---|---|---|---|---|---|---|---|")
    for prompt in args.prompt:
        for B in args.batch:
            ids = torch.randint(0, VOCAB, (B, prompt), device="cuda")
            ctx = prompt + args.new / 2
            cache_bytes = layers * B * ctx * heads * (2 * head_dim * 2 + 4)
            floor_fox = (weight_bytes + cache_bytes) / bandwidth
            floor_llama = (weight_bytes + layers * B * ctx * heads * 2 * head_dim * 2) / bandwidth
            runs = []
            time_fox(fox, ids[:, :64], 8)  # warm-up: kernels' and cuBLAS's one-time setup
            runs.append(("fox graph", floor_fox, lambda: time_fox(fox, ids, args.new)))
            runs.append(("fox eager static", floor_fox,
                         lambda: time_fox(fox, ids, args.new, cuda_graph=False)))
            if prompt <= 8192:
                runs.append(("fox dynamic cache", floor_fox,
                             lambda: time_fox_dynamic(fox, ids, args.new)))
            if llama is not None:
                runs.append(("llama eager", floor_llama, lambda: time_llama(llama, ids, args.new)))
            for name, floor, fn in runs:
                try:
                    prefill, step = fn()
                except Exception as e:
                    print(f"| {B} | {prompt} | {name} | failed: {type(e).__name__}: "
                          f"{str(e)[:120]} |")
                    continue
                row = dict(B=B, prompt=prompt, impl=name, prefill_ms=prefill * 1e3,
                           ms_per_token=step * 1e3, tokens_per_s=B / step,
                           floor_ms=floor * 1e3, x_floor=step / floor)
                rows.append(row)
                print(f"| {B} | {prompt} | {name} | {prefill * 1e3:.1f} | {step * 1e3:.3f} | "
                      f"{B / step:.0f} | {floor * 1e3:.3f} | {step / floor:.1f} |", flush=True)
            del ids
            torch.cuda.empty_cache()
    if llama is not None and not args.no_compile:
        # transformers compiles the decoding step itself where the cache is static (generate's
        # automatic compilation: torch.compile, mode "reduce-overhead", so CUDA graphs); the prefill
        # stays eager. A static cache's length is prompt + new tokens and the graphs are per shape,
        # so the warm-up generates as many tokens as the timed run (one compilation per batch).
        try:
            from transformers.generation import CompileConfig
            compiled = dict(cache_implementation="static",
                            compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
            for B in args.batch:
                ids = torch.randint(0, VOCAB, (B, args.prompt[0]), device="cuda")
                prefill, step = time_llama(llama, ids, args.new, warmup_new=args.new, **compiled)
                floor = (weight_bytes + layers * B * (args.prompt[0] + args.new / 2) * heads * 2
                         * head_dim * 2) / bandwidth
                rows.append(dict(B=B, prompt=args.prompt[0], impl="llama static+compile",
                                 prefill_ms=prefill * 1e3, ms_per_token=step * 1e3,
                                 tokens_per_s=B / step, floor_ms=floor * 1e3, x_floor=step / floor))
                ours = [r for r in rows if r["impl"] == "fox graph" and r["B"] == B
                        and r["prompt"] == args.prompt[0]]
                against = f" (fox graph {ours[0]['ms_per_token'] / (step * 1e3):.2f}x its time)" \
                    if ours else ""
                print(f"| {B} | {args.prompt[0]} | llama static+compile | {prefill * 1e3:.1f} | "
                      f"{step * 1e3:.3f} | {B / step:.0f} | {floor * 1e3:.3f} | "
                      f"{step / floor:.1f} |{against}", flush=True)
                del ids
        except Exception as e:
            print(f"LLaMA static cache + torch.compile failed: {type(e).__name__}: "
                  f"{str(e)[:300]}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"generate_{args.model}.json"), "w") as f:
            json.dump(dict(device=device, bandwidth=bandwidth, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
