"""`fox generate`: continue a prompt with each model of a checkpoint (model.generate, KV cache)."""
from typing import Dict, Optional

import torch

from .data import EOS, decode, encode
from .train import load_checkpoint, models_from_checkpoint


def generate(checkpoint: str, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
             top_p: float = 0.95, top_k: int = 0, greedy: bool = False, seed: int = 0,
             models: Optional[str] = None, quiet: bool = False) -> Dict[str, str]:
    ckpt = load_checkpoint(checkpoint)
    archs = [m.strip() for m in models.split(",")] if models else None
    out = {}
    for arch, model in models_from_checkpoint(ckpt, "cpu", archs).items():
        torch.manual_seed(seed)
        ids = torch.tensor([encode(prompt)])
        kwargs = dict(max_new_tokens=max_new_tokens, stop_tokens=[EOS])
        if not greedy:
            kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
        with torch.no_grad():
            seq = model.generate(ids, **kwargs)
        out[arch] = decode(seq[0, 1:].tolist())
        if not quiet:
            print(f"===== {arch} (step {ckpt['step']}) =====\n{out[arch]}\n", flush=True)
    return out
