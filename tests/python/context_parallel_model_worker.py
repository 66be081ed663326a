"""One rank of the context-parallel model tests (run under torchrun by test_distributed.py): builds
the same small model and token sequence on every rank from a shared seed, runs the model
context-parallel (set_context_parallel) on its part of the sequence, weighs its per-token losses
by a shared random weight, and saves its part of the loss, its share of every parameter gradient
the number of backward prefetches it started and of attention calls that took the pruned exchange
to OUT_DIR/rank<r>.pt."""
import argparse
import os

import torch
import torch.distributed as dist

from forgetting_transformer import distributed
from forgetting_transformer.distributed import set_context_parallel, zigzag_shard
from forgetting_transformer.nn import ForgettingTransformerConfig, ForgettingTransformerForCausalLM


def build(arch, dtype, kv_heads=None, pruning=None, seed=0, gate_bias=None):
    """The model (gate_bias: every forget gate's bias set to it, for gates that forget fast)."""
    config = ForgettingTransformerConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                         num_heads=4).preset(arch)
    if kv_heads:
        config.num_kv_heads = kv_heads
    if pruning is not None:
        config.log_pruning_tolerance = pruning
    torch.manual_seed(seed)
    model = ForgettingTransformerForCausalLM(config).to(dtype)
    if gate_bias is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("fgate_proj.bias"):
                    p.fill_(gate_bias)
    return model


def inputs(total, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, 50, (2, total), generator=g)
    labels = torch.randint(0, 50, (2, total), generator=g)
    labels[0, 3] = labels[1, -1] = -100
    weights = torch.rand(2, total, generator=g, dtype=torch.float64)
    return ids, labels, weights


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", required=True)
    ap.add_argument("--lengths", type=int, nargs="+", required=True)
    ap.add_argument("--layout", default="contiguous", choices=["contiguous", "zigzag"])
    ap.add_argument("--kv-heads", type=int, default=0)
    ap.add_argument("--pruning", type=float, default=None)
    ap.add_argument("--checkpointing", type=int, default=0)
    ap.add_argument("--overlap", type=int, default=1, help="0: FOX_CP_OVERLAP=0")
    ap.add_argument("--head-groups", type=int, default=1, help="FOX_CP_HEAD_GROUPS")
    ap.add_argument("--gate-bias", type=float, default=None)
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args()
    if not args.overlap:
        os.environ["FOX_CP_OVERLAP"] = "0"
    os.environ["FOX_CP_HEAD_GROUPS"] = str(args.head_groups)
    # Count the backward prefetches that start a gather (the saved file reports them).
    prefetches = []
    plain_prefetch = distributed._ChainEntry.prefetch

    def counted_prefetch(entry):
        idle = entry.pending is None
        plain_prefetch(entry)
        prefetches.extend([1] if idle and entry.pending is not None else [])
    distributed._ChainEntry.prefetch = counted_prefetch
    # Count the attention calls that took the pruned exchange (pruning across ranks).
    pruned = []
    plain_plan = distributed._PrunedExchange.__init__

    def counted_plan(plan, *args):
        plain_plan(plan, *args)
        pruned.extend([1] if plan.prunes else [])
    distributed._PrunedExchange.__init__ = counted_plan
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args.arch, torch.float64, args.kv_heads, args.pruning,
                  gate_bias=args.gate_bias)
    if args.checkpointing:
        model.set_activation_checkpointing(True)
    set_context_parallel(model, layout=args.layout)
    ids, labels, weights = inputs(sum(args.lengths))
    if args.layout == "zigzag":  # --lengths: the whole sequence's length only
        part = lambda t: zigzag_shard(t, rank, world)  # noqa: E731
    else:
        start, n = sum(args.lengths[:rank]), args.lengths[rank]
        part = lambda t: t[:, start:start + n]  # noqa: E731
    loss = model(part(ids), labels=part(labels))
    (loss * part(weights)).sum().backward()
    torch.save({"loss": loss.detach(), "prefetches": len(prefetches), "pruned": len(pruned),
                "grads": {name: p.grad for name, p in model.named_parameters()}},
               os.path.join(args.out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
