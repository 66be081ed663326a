"""`fox generate`: continue a prompt with each model of a checkpoint (static KV cache; on a GPU the
decoding step is a replayed CUDA graph) and report the prefill time and the decoding speed."""
import time
from typing import Dict, Optional

import torch

from .data import EOS, decode, encode
from .train import load_checkpoint, models_from_checkpoint


def generate(checkpoint: str, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
             top_p: float = 0.95, top_k: int = 0, greedy: bool = False, seed: int = 0,
             models: Optional[str] = None, quiet: bool = False,
             device: Optional[str] = None) -> Dict[str, str]:
    ckpt = load_checkpoint(checkpoint)
    archs = [m.strip() for m in models.split(",")] if models else None
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = {}
    for arch, model in models_from_checkpoint(ckpt, device, archs).items():
        torch.manual_seed(seed)
        ids = torch.tensor([encode(prompt)], device=device)
        kwargs = dict(max_new_tokens=max_new_tokens, stop_tokens=[EOS])
        if not greedy:
            kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
        # Streamed: the first token arrives after the prefill, the others one decoding step each.
        tokens, times = [], [time.perf_counter()]
        with torch.no_grad():
            for token in model.stream(ids, **kwargs):
                tokens.append(int(token[0]))
                times.append(time.perf_counter())
        out[arch] = decode(ids[0, 1:].tolist() + tokens)
        prefill_ms = 1e3 * (times[1] - times[0]) if len(times) > 1 else 0.0
        rate = (len(tokens) - 1) / (times[-1] - times[1]) if len(tokens) > 1 else float("nan")
        if not quiet:
            print(f"===== {arch} (step {ckpt['step']}) =====\n{out[arch]}\n", flush=True)
            print(f"[{arch}] {len(tokens)} tokens on {device}: prefill {prefill_ms:.1f} ms "
                  f"({ids.shape[1]} tokens), decoding {rate:.1f} tokens/s", flush=True)
    return out
