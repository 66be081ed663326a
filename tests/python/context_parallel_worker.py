"""One rank of the context-parallel tests (run under torchrun by test_distributed.py): builds the
whole sequence from a shared seed, takes its part (a contiguous chunk, or the zigzag layout's two
chunks), runs context_parallel_attention forward and backward, and saves its part's output and
gradients (and the rows its pruning plans sent) to OUT_DIR/<dtype>_rank<r>.pt."""
import argparse
import os

import torch
import torch.distributed as dist

from forgetting_transformer import distributed
from forgetting_transformer.distributed import context_parallel_attention, zigzag_shard


def full_inputs(lengths, heads, kv_heads, head_dim, dtype, seed, device, gate_bias=2.0):
    """gate_bias: one value for every head, or one a head (fast and slow forgetting heads)."""
    g = torch.Generator().manual_seed(seed)
    gate_bias = torch.tensor(gate_bias, dtype=torch.float32)
    T = sum(lengths)
    q = torch.randn(2, T, heads, head_dim, generator=g)
    k = torch.randn(2, T, kv_heads, head_dim, generator=g)
    v = torch.randn(2, T, kv_heads, head_dim, generator=g)
    log_fgate = torch.nn.functional.logsigmoid(torch.randn(2, T, heads, generator=g) + gate_bias)
    grad_out = torch.randn(2, T, heads, head_dim, generator=g)
    cast = lambda t: t.to(device=device, dtype=dtype)
    return cast(q), cast(k), cast(v), log_fgate.to(device=device, dtype=torch.float32 if dtype != torch.float64 else dtype), cast(grad_out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", required=True)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--dtype", nargs="+", default=["float64"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layout", default="contiguous", choices=["contiguous", "zigzag"])
    ap.add_argument("--threshold", type=float, default=None, help="adaptive_threshold")
    ap.add_argument("--gate-bias", type=float, nargs="+", default=[2.0],
                    help="log f = logsigmoid(N(0,1) + this): one value, or one a head")
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args()
    # Rows (and rows x KV heads) each pruning plan sends (the saved file reports them).
    sent_rows, sent_head_rows = [], []
    plain_init = distributed._PrunedExchange.__init__

    def recorded_init(plan, *a, **kw):
        plain_init(plan, *a, **kw)
        sent_rows.append(plan.sent_rows if plan.prunes else None)
        sent_head_rows.append(plan.sent_head_rows if plan.prunes else None)
    distributed._PrunedExchange.__init__ = recorded_init
    cuda = torch.cuda.is_available() and os.environ.get("FOX_TEST_BACKEND") == "nccl"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    for name in args.dtype:  # one process group for every dtype asked: one launch
        dtype = getattr(torch, name)
        q, k, v, lf, grad_out = full_inputs(args.lengths, args.heads, args.kv_heads,
                                            args.head_dim, dtype, args.seed, device,
                                            args.gate_bias if len(args.gate_bias) > 1
                                            else args.gate_bias[0])
        if args.layout == "zigzag":  # --lengths: the whole sequence's length only
            part = lambda t: zigzag_shard(t, rank, dist.get_world_size())  # noqa: E731
        else:
            start, n = sum(args.lengths[:rank]), args.lengths[rank]
            part = lambda t: t[:, start:start + n]  # noqa: E731
        mine = [part(t).detach().clone().requires_grad_(True) for t in (q, k, v, lf)]
        saved = []  # bytes kept for the backward pass
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
            out = context_parallel_attention(*mine, layout=args.layout,
                                             adaptive_threshold=args.threshold)
        out.backward(part(grad_out))
        local = sum(t.numel() * t.element_size() for t in mine + [out])
        torch.save({"out": out.detach().cpu(), "grads": [t.grad.cpu() for t in mine],
                    "saved_bytes": sum(saved), "local_bytes": local, "sent_rows": sent_rows,
                    "sent_head_rows": sent_head_rows},
                   os.path.join(args.out_dir, f"{name}_rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
