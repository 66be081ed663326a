"""What the Hugging Face wrapper (forgetting_transformer.model) costs on top of the nn model.

The wrapper shares the nn model's tensors, so both run the same C++ modules; the difference is
the Python around them (output classes, argument checks, generate's configuration). Measured side
by side in one process, interleaved, median of repeats:

  train step   forward + backward of the per-token loss (mean), B x T tokens
  generate     model.generate(prompt, max_new_tokens=N) (greedy): time per generated token, from
               the difference between N and N/2 tokens (so prefill and per-call work cancel),
               and the whole call; for comparison, generate with a stopping criterion (our
               generation step by step, as lm-eval's generate_until runs) and transformers' own
               decoding loop over our cache (what requests outside the fast path run)

    python bench/bench_hf_wrapper.py                       # CPU: the small model
    python bench/bench_hf_wrapper.py --device cuda --preset 125m --autocast bf16
"""
import argparse
import json
import statistics
import time

import torch

from forgetting_transformer import nn as fnn
import forgetting_transformer.model as fm
from transformers import StoppingCriteriaList

PRESETS = {
    # vocab, hidden, layers, heads
    "small": (4096, 256, 4, 4),
    "125m": (32768, 768, 12, 12),
}


def timer(device):
    if device.type == "cuda":
        def now():
            torch.cuda.synchronize(device)
            return time.perf_counter()
    else:
        now = time.perf_counter
    return now


def interleaved(fns, repeats, now):
    """Runs every fn once per round (the order alternates), returns the median seconds of each."""
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            t0 = now()
            fns[name]()
            times[name].append(now() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="model size (default: small on CPU, 125m on CUDA)")
    ap.add_argument("--batch", type=int, default=None, help="training batch (default 2 / 4)")
    ap.add_argument("--seq", type=int, default=None, help="training length (default 256 / 2048)")
    ap.add_argument("--gen-batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=32, help="prompt length")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=None, help="default 15 (CPU) / 30 (CUDA)")
    ap.add_argument("--autocast", choices=["none", "bf16"], default=None,
                    help="default: bf16 on CUDA, none on CPU")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    preset = args.preset or ("125m" if cuda else "small")
    batch = args.batch or (4 if cuda else 2)
    seq = args.seq or (2048 if cuda else 256)
    repeats = args.repeats or (30 if cuda else 15)
    use_autocast = (args.autocast or ("bf16" if cuda else "none")) == "bf16"
    vocab, hidden, layers, heads = PRESETS[preset]

    torch.manual_seed(0)
    config = fnn.ForgettingTransformerConfig(vocab_size=vocab, hidden_size=hidden,
                                             num_hidden_layers=layers,
                                             num_heads=heads).preset("fox_pro")
    nn_model = fnn.ForgettingTransformerForCausalLM(config).to(device)
    hf_model = fm.ForgettingTransformerForCausalLM.from_fox(nn_model)  # the same tensors
    now = timer(device)

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast)

    # ---- training step ----
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    labels = torch.randint(0, vocab, (batch, seq), device=device)
    nn_model.train()

    def train_nn():
        with autocast():
            loss = nn_model(ids, labels=labels).mean()
        loss.backward()

    def train_hf():
        with autocast():
            loss = hf_model(input_ids=ids, labels=labels).loss.mean()
        loss.backward()

    for _ in range(3):
        train_nn(), train_hf()
    train = interleaved({"nn": train_nn, "hf": train_hf}, repeats, now)
    nn_model.zero_grad(set_to_none=True)

    # The wrapper's own cost per forward, where it is not lost in the noise of a whole step: the
    # same forward (with labels, building the autograd graph) on 8 tokens.
    few_ids, few_labels = ids[:1, :8], labels[:1, :8]

    def few_nn():
        with autocast():
            nn_model(few_ids, labels=few_labels)

    def few_hf():
        with autocast():
            hf_model(input_ids=few_ids, labels=few_labels)

    few = interleaved({"nn": few_nn, "hf": few_hf}, 300, now)

    # ---- generation ----
    nn_model.eval()
    prompt = torch.randint(0, vocab, (args.gen_batch, args.prompt), device=device)
    n_full, n_half = args.new_tokens, args.new_tokens // 2

    def gen(model, n, **kw):
        def run():
            with autocast():
                model.generate(prompt, max_new_tokens=n, **kw)
        return run

    no_stop = dict(stop_tokens=[-1])  # every call generates exactly n tokens
    # A stopping criterion that never stops (lm-eval's generate_until passes one): generate then
    # runs our generation step by step, the criterion checked on the host after each token.
    never = StoppingCriteriaList([lambda input_ids, scores, **kw: torch.zeros(
        input_ids.shape[0], dtype=torch.bool, device=input_ids.device)])
    fns = {
        "nn": gen(nn_model, n_full, **no_stop), "nn_half": gen(nn_model, n_half, **no_stop),
        "hf": gen(hf_model, n_full, eos_token_id=None),
        "hf_half": gen(hf_model, n_half, eos_token_id=None),
        "loop": gen(hf_model, n_full, eos_token_id=None, return_dict_in_generate=True),
        "loop_half": gen(hf_model, n_half, eos_token_id=None, return_dict_in_generate=True),
        "nn_one": gen(nn_model, 1, **no_stop), "hf_one": gen(hf_model, 1, eos_token_id=None),
        "steps": gen(hf_model, n_full, eos_token_id=None, stopping_criteria=never),
        "steps_half": gen(hf_model, n_half, eos_token_id=None, stopping_criteria=never),
    }
    for fn in fns.values():
        fn()
    gen_t = interleaved(fns, repeats, now)

    def per_token(name):
        return (gen_t[name] - gen_t[name + "_half"]) / (n_full - n_half)

    rows = [
        ("forward, 8 tokens (wrapper cost)", few["nn"], few["hf"]),
        ("train step (fwd+bwd)", train["nn"], train["hf"]),
        ("generated token", per_token("nn"), per_token("hf")),
        (f"generate call ({n_full} tokens)", gen_t["nn"], gen_t["hf"]),
        ("generate call (1 token)", gen_t["nn_one"], gen_t["hf_one"]),
        ("token, with a stopping criterion", per_token("nn"), per_token("steps")),
        ("token, transformers' loop", per_token("nn"), per_token("loop")),
    ]
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"device: {name}, threads {torch.get_num_threads()}, model {preset} FoX (Pro) "
          f"({sum(p.numel() for p in nn_model.parameters()) / 1e6:.1f}M params), "
          f"autocast {'bf16' if use_autocast else 'off'}")
    print(f"train: B={batch} T={seq}; generate: B={args.gen_batch} prompt={args.prompt} "
          f"new={n_full} (per token from {n_full} vs {n_half}); median of {repeats} "
          "interleaved repeats")
    print(f"{'':32s} {'nn':>11s} {'hf wrapper':>11s} {'overhead':>9s}")
    results = {}
    for label, a, b in rows:
        print(f"{label:32s} {a * 1e3:9.3f}ms {b * 1e3:9.3f}ms {100 * (b / a - 1):+8.2f}%")
        results[label] = {"nn_ms": a * 1e3, "hf_ms": b * 1e3, "overhead_pct": 100 * (b / a - 1)}
    fwd_cost, gen_cost = few["hf"] - few["nn"], gen_t["hf_one"] - gen_t["nn_one"]
    print(f"wrapper cost: {fwd_cost * 1e6:.0f} us per forward = "
          f"{100 * fwd_cost / train['nn']:.2f}% of the train step; {gen_cost * 1e6:.0f} us per "
          f"generate call = {100 * gen_cost / gen_t['nn']:.2f}% of a {n_full}-token call, "
          f"{100 * gen_cost / n_full / per_token('nn'):.2f}% per token")
    results["wrapper_cost_us"] = {"forward": fwd_cost * 1e6, "generate_call": gen_cost * 1e6}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "preset": preset, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
