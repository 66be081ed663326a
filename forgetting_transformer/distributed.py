"""Context parallelism: Forgetting Attention over a sequence split across the ranks of a process
group (torch.distributed).

The gate bias between a query and an earlier key is the sum of log f between them, across chunk
boundaries. Here every rank gathers the keys, values and gates of the sequence up to its last
query and runs the single-process op on that prefix with its queries as the last positions (the
op's seqlen_q < seqlen_k form). The op anchors the gate sums tile by tile, so the bias is exact at
any length (no global prefix sum), and its autograd gives the gradients of the prefix, which are
summed back to their owners.

Two layouts of the sequence over the P ranks:

- "contiguous": rank r holds chunk r of P, in order. Causal attention makes rank r's work grow as
  (r + 1/2) chunk^2: the last rank does 2P - 1 times the first's.
- "zigzag": the sequence is cut into 2P chunks and rank r holds chunks r and 2P - 1 - r, one
  early and one late (`zigzag_shard` cuts a tensor so, `zigzag_unshard` puts it back): every
  rank does the same work.

This is the all-gather form of context parallelism: the activations of every other layer stay
split, while attention needs K, V and the gates of the prefix on each rank.
"""
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from .ops import forgetting_attention

__all__ = ["context_parallel_attention", "zigzag_shard", "zigzag_unshard"]

def _zigzag_chunk_sizes(total: int, world_size: int) -> List[int]:
    """Sizes of the 2P chunks of a sequence of `total` positions, as torch.tensor_split cuts it."""
    n = 2 * world_size
    return [total // n + (1 if c < total % n else 0) for c in range(n)]


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s part of a whole sequence `x` in the zigzag layout: chunks rank and
    2 * world_size - 1 - rank of 2 * world_size (torch.tensor_split along `dim`), concatenated."""
    parts = torch.tensor_split(x, 2 * world_size, dim=dim)
    return torch.cat([parts[rank], parts[2 * world_size - 1 - rank]], dim)


def zigzag_unshard(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's zigzag part (in rank order): zigzag_shard undone."""
    world_size = len(shards)
    sizes = _zigzag_chunk_sizes(sum(t.shape[dim] for t in shards), world_size)
    chunks = [None] * (2 * world_size)
    for r, t in enumerate(shards):
        first, second = torch.split(t, [sizes[r], sizes[2 * world_size - 1 - r]], dim)
        chunks[r], chunks[2 * world_size - 1 - r] = first, second
    return torch.cat(chunks, dim)


def _chunk_lengths(length: int, group, device) -> List[int]:
    """The sequence length of every rank's local part, in rank order."""
    mine = torch.tensor([length], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [int(t.item()) for t in every]


class _GatherSequence(torch.autograd.Function):
    """Forward: the first `needed` positions of the whole sequence, assembled from every rank's
    local tensor (dim 1) by one all-gather; `pieces` says where each piece of the sequence lives:
    (global start, owning rank, offset in the owner's local tensor, length), in sequence order.
    Backward: the gradients of every rank's assembled prefix are summed over the ranks (one
    all-reduce) and each rank keeps its own pieces."""

    @staticmethod
    def forward(ctx, x, group, lengths, pieces, needed):
        longest = max(lengths)
        padded = x.new_zeros((x.shape[0], longest) + tuple(x.shape[2:]))
        padded[:, : x.shape[1]] = x
        gathered = [torch.empty_like(padded) for _ in lengths]
        dist.all_gather(gathered, padded.contiguous(), group=group)
        parts = [gathered[owner][:, offset:offset + n] for start, owner, offset, n in pieces
                 if start < needed]
        ctx.group, ctx.lengths, ctx.pieces = group, lengths, pieces
        ctx.rank = dist.get_rank(group)
        return torch.cat(parts, 1)[:, :needed]

    @staticmethod
    def backward(ctx, grad):
        total = grad.new_zeros((grad.shape[0], sum(ctx.lengths)) + tuple(grad.shape[2:]))
        total[:, : grad.shape[1]] = grad
        dist.all_reduce(total, group=ctx.group)
        mine = sorted((offset, start, n) for start, owner, offset, n in ctx.pieces
                      if owner == ctx.rank)
        grad_x = torch.cat([total[:, start:start + n] for _, start, n in mine], 1)
        return grad_x.contiguous(), None, None, None, None


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor,
    group=None,
    *,
    sm_scale: Optional[float] = None,
    adaptive_threshold: Optional[float] = None,
    layout: str = "contiguous",
) -> torch.Tensor:
    """Forgetting Attention of a sequence whose parts are spread over the ranks of `group`.

    Every rank passes its part of the sequence: q (B, T_r, H, D), k and v (B, T_r, H_kv, D),
    log_fgate (B, T_r, H) float32. With layout="contiguous" (default) that is chunk r in rank
    order, and the chunk lengths T_r may differ between ranks; with layout="zigzag" it is chunks r
    and 2P - 1 - r of 2P, concatenated (`zigzag_shard`; balanced causal work). Returns this rank's
    part of the output, equal to the rows of
    `forgetting_attention(q_all, k_all, v_all, log_fgate_all)` for these positions; backward gives
    every rank the gradients of its own part of q, k, v and log_fgate (the gradients of the keys,
    values and gates that other ranks attended to are summed across ranks). Every rank must run
    the backward through its output: the gradients are summed with collectives.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context_parallel_attention: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"context_parallel_attention: layout must be 'contiguous' or 'zigzag', "
                         f"got {layout!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or log_fgate.dim() != 3:
        raise ValueError("context_parallel_attention: q, k, v must be (batch, seqlen, heads, "
                         "head_dim) and log_fgate (batch, seqlen, heads), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, "
                         f"{tuple(log_fgate.shape)}")
    if not (q.shape[1] == k.shape[1] == v.shape[1] == log_fgate.shape[1]):
        raise ValueError("context_parallel_attention: q, k, v and log_fgate must hold the same "
                         f"part of the sequence, got lengths {q.shape[1]}, {k.shape[1]}, "
                         f"{v.shape[1]}, {log_fgate.shape[1]}")
    lengths = _chunk_lengths(q.shape[1], group, q.device)
    rank, world_size = dist.get_rank(group), len(lengths)
    # Every rank sees the same lengths, so every rank raises alike: none waits in a collective.
    if layout == "contiguous":
        if min(lengths) == 0:
            raise ValueError(f"context_parallel_attention: every rank needs a non-empty chunk, "
                             f"got lengths {lengths}")
        starts = [sum(lengths[:r]) for r in range(world_size)]
        pieces = [(starts[r], r, 0, lengths[r]) for r in range(world_size)]
        queries = [(0, lengths[rank], starts[rank] + lengths[rank])]  # (local start, n, prefix)
    else:
        sizes = _zigzag_chunk_sizes(sum(lengths), world_size)
        expected = [sizes[r] + sizes[2 * world_size - 1 - r] for r in range(world_size)]
        if lengths != expected or min(sizes) == 0:
            raise ValueError(
                f"context_parallel_attention: layout='zigzag' expects the parts zigzag_shard "
                f"cuts (lengths {expected} for {sum(lengths)} positions, at least "
                f"{2 * world_size} positions in all), got lengths {lengths}")
        starts = [sum(sizes[:c]) for c in range(2 * world_size)]
        pieces = []
        for c in range(2 * world_size):
            owner = c if c < world_size else 2 * world_size - 1 - c
            pieces.append((starts[c], owner, 0 if c < world_size else sizes[owner], sizes[c]))
        late = 2 * world_size - 1 - rank
        queries = [(0, sizes[rank], starts[rank] + sizes[rank]),
                   (sizes[rank], sizes[late], starts[late] + sizes[late])]
    needed = max(prefix for _, _, prefix in queries)
    k_seq = _GatherSequence.apply(k, group, lengths, pieces, needed)
    v_seq = _GatherSequence.apply(v, group, lengths, pieces, needed)
    g_seq = _GatherSequence.apply(log_fgate, group, lengths, pieces, needed)
    outs = [forgetting_attention(q[:, start:start + n], k_seq[:, :prefix], v_seq[:, :prefix],
                                 g_seq[:, :prefix], sm_scale=sm_scale,
                                 adaptive_threshold=adaptive_threshold)
            for start, n, prefix in queries]
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)
