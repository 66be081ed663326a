"""Run configurations: presets, a YAML/JSON file (--config) and command-line flags, in that order.

A config is a flat dict. ``lr`` and ``num_heads`` may be a number or a mapping from model
architecture to number (the paper tunes them per architecture).
"""
import copy
import json
import os
from typing import Any, Dict, Optional

from . import data

ARCHS = ("fox_pro", "transformer_pro", "fox_llama", "transformer_llama")

# Everything a run needs; presets override parts of it.
DEFAULTS: Dict[str, Any] = {
    "preset": "tiny",
    "models": ["fox_pro", "transformer_pro"],
    "vocab_size": data.VOCAB_SIZE,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_heads": 4,
    "hidden_ratio": None,            # None: the architecture's (3.5 Pro, 4.0 LLaMA)
    "rope_base": 500000.0,
    "seq_len": 512,
    "batch_size": 4,                 # sequences per optimizer step
    "micro_batch_size": None,        # gradient accumulation: sequences per forward/backward
    "steps": 300,
    "warmup_steps": 30,
    "lr": {"fox_pro": 3e-3, "transformer_pro": 3e-3, "fox_llama": 2e-3, "transformer_llama": 1e-3},
    "min_lr_ratio": 0.0,             # cosine decays to lr * min_lr_ratio (the paper: 0)
    "betas": [0.9, 0.95],
    "weight_decay": 0.1,
    "grad_clip": 1.0,
    "seed": 0,
    "val_fraction": 0.05,
    "max_files": None,               # cap on train files (tests); None: all
    "data_dir": None,                # a directory of text files (default: the stdlib's *.py)
    "tokens": None,                  # pre-tokenized ids: .npy, or raw (token_dtype)
    "token_dtype": None,             # uint16 | uint32, for raw token files
    "fsdp": False,                   # under torchrun: FSDP2 (fully_shard per block) instead of DDP
    "checkpoint_activations": False, # recompute each block's activations in the backward pass
    "cuda_graph": False,             # replay each micro-batch's forward + backward as a CUDA graph
    "context_parallel": 1,           # under torchrun: ranks every sequence is split over
    "context_parallel_layout": "zigzag",  # zigzag | contiguous (forgetting_transformer.distributed)
    "tensorboard": True,             # also log to <out_dir>/tensorboard when it is installed
    "log_interval": 10,
    "eval_interval": 100,            # validation loss during training, in steps (0: off)
    "eval_batches": 2,
    "checkpoint_interval": 100,      # in steps (a checkpoint is also written at the end)
    "device": "auto",                # auto | cpu | cuda
    "dtype": "auto",                 # auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16
    "threads": None,                 # torch.set_num_threads
    "out_dir": "runs/tiny",
}

PAPER_BATCH = 32           # sequences of 16k tokens: 0.5M tokens per step
PAPER_SEQ = 16384
PAPER_WARMUP = 268435456 // (PAPER_BATCH * PAPER_SEQ)   # 256Mi tokens = 512 steps

PRESETS: Dict[str, Dict[str, Any]] = {
    # Both models on a 2-core CPU: 300 steps x 4 x 512 tokens, ~65 s when the CPU is quiet
    # (~19k tokens/s for the two models together), up to 5x longer when the cores are contended.
    "tiny": {},
    # A few seconds: tests and smoke runs.
    "micro": {"hidden_size": 32, "num_hidden_layers": 1, "num_heads": 2, "seq_len": 64,
              "batch_size": 2, "steps": 20, "warmup_steps": 2, "log_interval": 5,
              "eval_interval": 10, "eval_batches": 1, "checkpoint_interval": 10,
              "max_files": 40, "out_dir": "runs/micro"},
    # The paper's settings (LongCrawl64 configs of the authors): 16k context, batch 32 x 16k,
    # warmup 256Mi tokens, cosine to 0, bf16. Tokens: 2.5Bi / 7Bi / 45Bi (48B).
    "125m": {"hidden_size": 768, "num_hidden_layers": 12, "num_heads": 12,
             "seq_len": PAPER_SEQ, "batch_size": PAPER_BATCH, "micro_batch_size": 2,
             "steps": 2684354560 // (PAPER_BATCH * PAPER_SEQ), "warmup_steps": PAPER_WARMUP,
             "lr": {"fox_pro": 2e-3, "transformer_pro": 2e-3, "fox_llama": 2e-3,
                    "transformer_llama": 1e-3},
             "log_interval": 64, "eval_interval": 1024, "checkpoint_interval": 512,
             "out_dir": "runs/125m"},
    "360m": {"hidden_size": 1024, "num_hidden_layers": 24, "num_heads": 16,
             "seq_len": PAPER_SEQ, "batch_size": PAPER_BATCH, "micro_batch_size": 1,
             "steps": 7516192768 // (PAPER_BATCH * PAPER_SEQ), "warmup_steps": PAPER_WARMUP,
             "lr": {"fox_pro": 2e-3, "transformer_pro": 2e-3, "fox_llama": 2e-3,
                    "transformer_llama": 1e-3},
             "log_interval": 64, "eval_interval": 2048, "checkpoint_interval": 512,
             "out_dir": "runs/360m"},
    # 760M: FoX uses head dim 64 (24 heads), the Transformer head dim 128 (12 heads).
    "760m": {"hidden_size": 1536, "num_hidden_layers": 24,
             "num_heads": {"fox_pro": 24, "fox_llama": 24, "transformer_pro": 12,
                           "transformer_llama": 12},
             "seq_len": PAPER_SEQ, "batch_size": PAPER_BATCH, "micro_batch_size": 1,
             "steps": 48318382080 // (PAPER_BATCH * PAPER_SEQ), "warmup_steps": PAPER_WARMUP,
             "lr": {"fox_pro": 2e-3, "transformer_pro": 1e-3, "fox_llama": 1e-3,
                    "transformer_llama": 5e-4},
             "log_interval": 64, "eval_interval": 4096, "checkpoint_interval": 512,
             "out_dir": "runs/760m"},
}


def load_file(path: str) -> Dict[str, Any]:
    with open(path) as fh:
        text = fh.read()
    if path.endswith(".json"):
        return json.loads(text)
    try:
        import yaml
    except ImportError:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise SystemExit(f"{path}: reading YAML needs pyyaml (pip install pyyaml)") from None
    return yaml.safe_load(text) or {}


def build(preset: Optional[str] = None, file: Optional[str] = None,
          overrides: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """DEFAULTS < preset < file < overrides (None values in overrides are ignored)."""
    from_file = load_file(file) if file else {}
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    name = overrides.get("preset") or preset or from_file.get("preset") or DEFAULTS["preset"]
    if name not in PRESETS:
        raise SystemExit(f"unknown preset {name!r} (one of {', '.join(PRESETS)})")
    cfg = copy.deepcopy(DEFAULTS)
    cfg.update(copy.deepcopy(PRESETS[name]))
    for src in (from_file, overrides):
        unknown = set(src) - set(DEFAULTS)
        if unknown:
            raise SystemExit(f"unknown config keys: {', '.join(sorted(unknown))}")
        cfg.update(src)
    cfg["preset"] = name
    if isinstance(cfg["models"], str):
        cfg["models"] = [m.strip() for m in cfg["models"].split(",") if m.strip()]
    for m in cfg["models"]:
        if m not in ARCHS:
            raise SystemExit(f"unknown model {m!r} (one of {', '.join(ARCHS)})")
    return cfg


def per_model(value, arch: str):
    if isinstance(value, dict):
        if arch not in value:
            raise SystemExit(f"no value for {arch} in {value}")
        return value[arch]
    return value


def model_config(cfg: Dict[str, Any], arch: str):
    """The ForgettingTransformerConfig of one architecture of a run config."""
    from ..nn import ForgettingTransformerConfig
    c = ForgettingTransformerConfig(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                                    num_hidden_layers=cfg["num_hidden_layers"],
                                    num_heads=per_model(cfg["num_heads"], arch)).preset(arch)
    if cfg.get("hidden_ratio"):
        c.hidden_ratio = float(cfg["hidden_ratio"])
    c.rope_base = float(cfg["rope_base"])
    c.bos_token_id, c.eos_token_id, c.pad_token_id = data.BOS, data.EOS, data.PAD
    return c


CONFIG_FIELDS = ("vocab_size", "hidden_size", "hidden_ratio", "intermediate_size",
                 "num_hidden_layers", "num_heads", "num_kv_heads", "rope_base", "use_rope",
                 "use_output_gate", "fgate_type", "use_output_norm", "qk_norm", "use_k_shift",
                 "use_v_shift", "tie_word_embeddings", "norm_eps")


def describe(c) -> Dict[str, Any]:
    return {k: getattr(c, k) for k in CONFIG_FIELDS}


def parse_value(text: str):
    """--set key=value: JSON if it parses (numbers, lists, dicts, true/false/null), else a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def dump(cfg: Dict[str, Any], path: str):
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(cfg, fh, indent=2, sort_keys=True)
    os.replace(tmp, path)
