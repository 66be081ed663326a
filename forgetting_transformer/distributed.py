"""Context parallelism: Forgetting Attention over a sequence split across the ranks of a process
group (torch.distributed), each rank holding one contiguous chunk.

The gate bias between a query and an earlier key is the sum of log f between them, across chunk
boundaries. Here every rank gathers the keys, values and gates of the chunks before and including
its own, and runs the single-process op on that prefix with its chunk as the queries (the op's
seqlen_q < seqlen_k form: the queries are the last positions). The op anchors the gate sums tile
by tile, so the bias is exact at any length (no global prefix sum), and its autograd gives the
gradients of the prefix, which are summed back to the chunks' owners.

This is the all-gather form of context parallelism: the activations of every other layer stay
chunked, while attention needs K, V and the gates of the prefix on each rank.
"""
from typing import List, Optional

import torch
import torch.distributed as dist

from .ops import forgetting_attention

__all__ = ["context_parallel_attention"]


def _chunk_lengths(length: int, group, device) -> List[int]:
    """The sequence length of every rank's chunk, in rank order."""
    mine = torch.tensor([length], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [int(t.item()) for t in every]


class _GatherPrefix(torch.autograd.Function):
    """Forward: the chunks (along dim 1) of ranks 0..rank, concatenated. Backward: the gradient of
    every rank's prefix is summed over the ranks, and each rank keeps the part of its own chunk."""

    @staticmethod
    def forward(ctx, x, group, lengths):
        rank = dist.get_rank(group)
        longest = max(lengths)
        padded = x.new_zeros((x.shape[0], longest) + tuple(x.shape[2:]))
        padded[:, : x.shape[1]] = x
        chunks = [torch.empty_like(padded) for _ in lengths]
        dist.all_gather(chunks, padded.contiguous(), group=group)
        ctx.group, ctx.lengths, ctx.rank = group, lengths, rank
        return torch.cat([c[:, :n] for c, n in zip(chunks[: rank + 1], lengths[: rank + 1])], 1)

    @staticmethod
    def backward(ctx, grad):
        lengths, rank = ctx.lengths, ctx.rank
        total = grad.new_zeros((grad.shape[0], sum(lengths)) + tuple(grad.shape[2:]))
        total[:, : grad.shape[1]] = grad
        dist.all_reduce(total, group=ctx.group)
        start = sum(lengths[:rank])
        return total[:, start : start + lengths[rank]].contiguous(), None, None


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor,
    group=None,
    *,
    sm_scale: Optional[float] = None,
    adaptive_threshold: Optional[float] = None,
) -> torch.Tensor:
    """Forgetting Attention of a sequence whose chunks are spread over the ranks of `group`.

    Every rank passes its contiguous chunk, in rank order: q (B, T_r, H, D), k and v
    (B, T_r, H_kv, D), log_fgate (B, T_r, H) float32; the chunk lengths T_r may differ between
    ranks. Returns this rank's chunk of the output, equal to the rows of
    `forgetting_attention(q_all, k_all, v_all, log_fgate_all)` for this chunk; backward gives
    every rank the gradients of its own chunk of q, k, v and log_fgate (the gradients of the keys,
    values and gates that later ranks attended to are summed across ranks). Every rank must run
    the backward through its output: the gradients are summed with collectives.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context_parallel_attention: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or log_fgate.dim() != 3:
        raise ValueError("context_parallel_attention: q, k, v must be (batch, seqlen, heads, "
                         "head_dim) and log_fgate (batch, seqlen, heads), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, "
                         f"{tuple(log_fgate.shape)}")
    if not (q.shape[1] == k.shape[1] == v.shape[1] == log_fgate.shape[1]):
        raise ValueError("context_parallel_attention: q, k, v and log_fgate must hold the same "
                         f"chunk of the sequence, got lengths {q.shape[1]}, {k.shape[1]}, "
                         f"{v.shape[1]}, {log_fgate.shape[1]}")
    lengths = _chunk_lengths(q.shape[1], group, q.device)
    if min(lengths) == 0:  # every rank sees the lengths: all raise, none waits in a collective
        raise ValueError(f"context_parallel_attention: every rank needs a non-empty chunk, got "
                         f"lengths {lengths}")
    k_prefix = _GatherPrefix.apply(k, group, lengths)
    v_prefix = _GatherPrefix.apply(v, group, lengths)
    g_prefix = _GatherPrefix.apply(log_fgate, group, lengths)
    return forgetting_attention(q, k_prefix, v_prefix, g_prefix, sm_scale=sm_scale,
                                adaptive_threshold=adaptive_threshold)
