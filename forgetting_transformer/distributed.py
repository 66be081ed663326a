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
split, while attention needs K, V and the gates of the prefix on each rank; the gathered tensors
are not kept for the backward pass, which gathers them again (a rank holds the whole sequence's
K and V for one layer at a time, not for every layer).

Communication and compute overlap:
- backward: each layer's gather starts one attention call ahead (`_GatherChain`), and the
  gradients go back to their owners by reduce-scatter;
- both passes, opt-in (`FOX_CP_HEAD_GROUPS`): attention runs head group after head group, so
  that one group's gather or reduce-scatter is in flight while another group computes. Measured
  slower on 2 GPUs (+3..+20% a step): a collective beside the attention kernels slows both.
Otherwise the forward gather is exposed: a layer's attention needs it at once (0.8-2.9% of a step
at 64k-256k on 2 GPUs). (A ring would hide it. It needs the op to take a block of queries against
an earlier block of keys, with the gate sum between them as an offset; see bench/NOTES.md.)

Pruning across ranks (`_PrunedExchange`): with `adaptive_threshold`, a rank receives only the
pieces whose gate bias to its queries can reach the threshold (for any head of the layer; head by
head as an option), by all_to_all in place of the all-gather (prefetched for the backward the
same way).

Switches, read at each call so that one process can time both sides:
- `FOX_CP_OVERLAP=0`: no backward prefetch, and an all-reduce in place of the reduce-scatter;
- `FOX_CP_HEAD_GROUPS=G`: G head groups (default 1);
- `FOX_CP_PRUNE=0`: the all-gather even under pruning;
- `FOX_CP_PRUNE_HEADS=1`: pruning across ranks head by head (a local head's K, V and gates stop at
  the neighbouring piece while a global head's travel further): fewer bytes, an op call per set
  of heads; measured slower on 2 GPUs over NVLink.
"""
import os
import weakref
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from . import _C  # noqa: F401  (registers torch.ops.fox.*)

# Flat-buffer collectives under their current names (torch >= 2.14 calls the older ones
# deprecated; same arguments).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["context_parallel_attention", "set_context_parallel", "shard_sequence", "zigzag_shard",
           "zigzag_unshard"]

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


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, layout: str = "contiguous",
                   dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s part of a whole sequence `x` in `layout`: chunk rank of world_size
    (torch.tensor_split, "contiguous") or zigzag_shard's two chunks ("zigzag")."""
    if layout == "zigzag":
        return zigzag_shard(x, rank, world_size, dim)
    if layout == "contiguous":
        return torch.tensor_split(x, world_size, dim=dim)[rank]
    raise ValueError(f"shard_sequence: layout must be 'contiguous' or 'zigzag', got {layout!r}")


def _chunk_lengths(length: int, group, device) -> List[int]:
    """The sequence length of every rank's local part, in rank order."""
    mine = torch.tensor([length], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [int(t.item()) for t in every]


def _overlap_enabled() -> bool:
    """FOX_CP_OVERLAP=0 turns off the backward prefetch and the reduce-scatter (read at each call,
    so that one process can time both forms side by side)."""
    return os.environ.get("FOX_CP_OVERLAP", "1") != "0"


def _prune_across_ranks() -> bool:
    """FOX_CP_PRUNE=0 keeps the all-gather under pruning (read at each call: side by side)."""
    return os.environ.get("FOX_CP_PRUNE", "1") != "0"


def _prune_head_by_head() -> bool:
    """FOX_CP_PRUNE_HEADS=1 plans pruning across ranks head by head (read at each call: side by
    side). Off by default: it sends fewer bytes but runs an op call per set of heads with the
    copies of their rows, and measured slower on 2 GPUs over NVLink (bench/NOTES.md)."""
    return os.environ.get("FOX_CP_PRUNE_HEADS", "0") == "1"


def _in_sequence_order(where: "_SequenceLayout", batch: int, needed: int) -> bool:
    """Whether the gathered buffer (rank, batch, row) already holds the first `needed` positions
    in sequence order: one sequence, and each piece at its owner's slot (contiguous chunks, every
    one but the last as long as the longest)."""
    rows = max(where.lengths)
    return batch == 1 and all(start == owner * rows + offset
                              for start, owner, offset, _ in where.pieces if start < needed)


class _PendingGather:
    """K, V and the gates of every rank, in flight: one all-gather per tensor into a buffer
    (rank, batch, row, ...), each rank's part padded to the longest, started at construction.
    `prefix` waits for them and assembles the first positions of the sequence from the pieces:
    one copy per tensor, none where the buffer is in sequence order already."""

    def __init__(self, tensors, group, where: "_SequenceLayout"):
        rows = max(where.lengths)
        self.buffers, self.works, self.where = [], [], where
        for t in tensors:
            local = t.contiguous()
            if t.shape[1] < rows:  # padding rows are sent but never read: left uninitialized
                local = t.new_empty((t.shape[0], rows) + tuple(t.shape[2:]))
                local[:, :t.shape[1]] = t
            buffer = local.new_empty((len(where.lengths),) + tuple(local.shape))
            # Flat views: gloo takes only the concatenated form of the output.
            self.works.append(_all_gather_flat(buffer.view(-1), local.view(-1), group=group,
                                               async_op=True))
            self.buffers.append(buffer)

    def prefix(self, needed: int):
        """The first `needed` positions of the whole sequence, one tensor per gathered input."""
        for work in self.works:
            work.wait()
        out = []
        for buffer in self.buffers:
            if _in_sequence_order(self.where, buffer.shape[1], needed):
                out.append(buffer.view((1, -1) + tuple(buffer.shape[3:]))[:, :needed])
            else:
                out.append(torch.cat([buffer[owner, :, offset:offset + n]
                                      for start, owner, offset, n in self.where.pieces
                                      if start < needed], 1)[:, :needed])
        self.buffers = None
        return out


class _PendingReduction:
    """_PendingGather's transpose, started at construction: every rank's gradients of its
    assembled prefix, summed over the ranks, each rank getting its own pieces in local order.
    One reduce-scatter per tensor (each rank receives only its part), in flight until `wait`;
    FOX_CP_OVERLAP=0 restores the all-reduce of the whole sequence (done at once)."""

    def __init__(self, grads, group, where: "_SequenceLayout"):
        rank, world_size = dist.get_rank(group), len(where.lengths)
        rows, mine = max(where.lengths), where.lengths[rank]
        self.parts, self.works, self.mine = [], [], mine
        scatter = _overlap_enabled()  # one form for every tensor of the call
        for grad in grads:
            batch, needed, inner = grad.shape[0], grad.shape[1], tuple(grad.shape[2:])
            if _in_sequence_order(where, batch, needed) and needed == world_size * rows:
                total = grad.contiguous().view((world_size, 1, rows) + inner)
            else:
                # Padding rows are summed but never read; the pieces this rank did not attend to
                # must be zeros.
                every = all(start < needed for start, _, _, _ in where.pieces)
                total = (grad.new_empty if every else grad.new_zeros)(
                    (world_size, batch, rows) + inner)
                for start, owner, offset, n in where.pieces:
                    if start < needed:
                        total[owner, :, offset:offset + n] = grad[:, start:start + n]
            if scatter:
                part = total.new_empty(total.shape[1:])
                self.works.append(_reduce_scatter_flat(
                    part.view(-1), total.view(-1), group=group, async_op=True))
                self.parts.append(part)
            else:
                dist.all_reduce(total, group=group)  # in place: the gradient is this call's own
                self.parts.append(total[rank, :, :mine].clone())  # not a view keeping `total`

    def wait(self):
        for work in self.works:
            work.wait()
        return [p if p.shape[1] == self.mine else p[:, :self.mine].contiguous()
                for p in self.parts]


def _head_groups(num_heads: int, num_kv_heads: int):
    """The heads in FOX_CP_HEAD_GROUPS groups of whole KV groups (read at each call; 1 by
    default, fewer where the KV heads do not divide): (KV head slice, query head slice) each.
    With more than one, a group's attention runs while the next group's keys are still being
    gathered, and its gradients travel while the next group's backward runs."""
    value = os.environ.get("FOX_CP_HEAD_GROUPS", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"FOX_CP_HEAD_GROUPS must be a whole number >= 1, got {value!r}")
    groups = min(int(value), num_kv_heads)
    while num_kv_heads % groups:
        groups -= 1
    kv, q = num_kv_heads // groups, num_heads // groups
    return [(slice(i * kv, (i + 1) * kv), slice(i * q, (i + 1) * q)) for i in range(groups)]


def _gather_heads(k, v, log_fgate, group, where, heads):
    """One _PendingGather per head group, all started now (they complete in order)."""
    return [_PendingGather((k[:, :, kv], v[:, :, kv], log_fgate[:, :, qh]), group, where)
            for kv, qh in heads]


def _cat(tensors, dim):
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim)


class _GatherChain:
    """Backward prefetch across the attention calls of one forward pass. Each call links to the
    one before it (the next in backward order); when a call's backward has launched its work,
    it starts the exchange of the previous call's K, V and gates (the all-gather, or the pruned
    exchange), which then runs during the work between the two (this layer's projections, the
    previous layer's MLP). Only weak references are kept: a call whose tensors were freed
    (activation checkpointing recomputes them later) is not prefetched, and nothing is held
    alive longer than autograd holds it."""

    def __init__(self):
        self.last = None

    def reset(self):
        self.last = None

    def link(self, tensors, start):
        """start(k, v, log_fgate) begins the call's exchange and returns what is in flight."""
        entry = _ChainEntry(tensors, start, self.last)
        self.last = entry
        return entry


class _ChainEntry:
    def __init__(self, tensors, start, previous):
        self.refs = [weakref.ref(t) for t in tensors]
        self.start, self.previous = start, previous
        self.pending = None

    def prefetch(self):
        tensors = [r() for r in self.refs]
        if self.pending is None and all(t is not None for t in tensors):
            self.pending = self.start(*tensors)

    def take(self):
        pending, self.pending = self.pending, None
        return pending


def _prefetch_previous(entry: Optional[_ChainEntry]):
    """Called once a call's backward has launched its gradients' collectives: the next attention
    call in backward order starts its exchange now, behind them, and it runs while the layers
    between the two run their backward. Started before this call's kernels instead, it waited
    for the SMs they hold and delayed the collectives queued behind it (a slower step than no
    prefetch at all)."""
    if entry is not None:
        previous, entry.previous = entry.previous, None
        if previous is not None and _overlap_enabled():
            previous.prefetch()


class _GatheredAttention(torch.autograd.Function):
    """This rank's queries against the prefix of the sequence each of their pieces needs, through
    the op's forward and backward kernels, head group after head group (_head_groups). The
    gathered keys, values and gates are not kept for the backward, which gathers them again
    (prefetched while the layers after this one run their backward, when a _GatherChain links
    the calls): a rank keeps its own part of the sequence between the passes, not the whole (as
    the layers around attention do)."""

    @staticmethod
    def forward(ctx, q, k, v, log_fgate, group, where, sm_scale, adaptive_threshold, heads,
                entry):
        needed = max(start + n for start, _, n in where.mine)
        outs = [[] for _ in where.mine]  # per piece, per head group
        lses = [[] for _ in where.mine]
        for (_, qh), gathered in zip(heads, _gather_heads(k, v, log_fgate, group, where, heads)):
            k_seq, v_seq, g_seq = gathered.prefix(needed)
            for p, (start, offset, n) in enumerate(where.mine):
                out, lse = torch.ops.fox.forgetting_attention_fwd(
                    q[:, offset:offset + n, qh], k_seq[:, :start + n], v_seq[:, :start + n],
                    g_seq[:, :start + n], None, None, sm_scale, adaptive_threshold, None)
                outs[p].append(out)
                lses[p].append(lse)
        out = _cat([_cat(o, 2) for o in outs], 1)
        lses = [_cat(lse, 1) for lse in lses]  # (B, H, piece length)
        ctx.save_for_backward(q, k, v, log_fgate, out, *lses)
        ctx.group, ctx.where, ctx.needed, ctx.heads, ctx.entry = group, where, needed, heads, entry
        ctx.sm_scale, ctx.adaptive_threshold = sm_scale, adaptive_threshold
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, log_fgate, out, *lses = ctx.saved_tensors
        where, group, entry, heads = ctx.where, ctx.group, ctx.entry, ctx.heads
        gathers = entry.take() if entry is not None else None
        if gathers is None:
            gathers = _gather_heads(k, v, log_fgate, group, where, heads)
        one_piece = len(where.mine) == 1 and len(heads) == 1
        dq = None if one_piece else torch.empty_like(q)
        reductions = []
        # The piece with the longest prefix first: its gradients cover the whole prefix, the
        # others' are added to their part of it.
        order = sorted(range(len(where.mine)), key=lambda i: -sum(where.mine[i][::2]))
        for (_, qh), gathered in zip(heads, gathers):
            k_seq, v_seq, g_seq = gathered.prefix(ctx.needed)
            seq_grads = None  # dK, dV, dlog_fgate of the prefix, for this head group
            for i in order:
                start, offset, n = where.mine[i]
                piece = slice(offset, offset + n)
                dq_i, *grads_i = torch.ops.fox.forgetting_attention_bwd(
                    grad[:, piece, qh].contiguous(), q[:, piece, qh], k_seq[:, :start + n],
                    v_seq[:, :start + n], g_seq[:, :start + n], out[:, piece, qh],
                    lses[i][:, qh].contiguous(), None, None, ctx.sm_scale,
                    ctx.adaptive_threshold, None)
                grads_i[2] = grads_i[2].to(g_seq.dtype)
                if one_piece:
                    dq = dq_i
                else:
                    dq[:, piece, qh] = dq_i
                if seq_grads is None:
                    seq_grads = grads_i
                else:
                    for total, part in zip(seq_grads, grads_i):
                        total[:, :start + n] += part
            # In flight while the next head group's backward runs.
            reductions.append(_PendingReduction(seq_grads, group, where))
        parts = [r.wait() for r in reductions]  # per head group: dK, dV, dlog_fgate
        dk, dv, dg = (_cat([p[t] for p in parts], 2) for t in range(3))
        _prefetch_previous(entry)
        return dq, dk, dv, dg, None, None, None, None, None, None


class _SequenceLayout:
    """Where the pieces of a sequence live, from every rank's local length (in rank order).

    pieces: (global start, owning rank, offset in the owner's local tensor, length), in sequence
    order. mine: this rank's pieces as (global start, local offset, length), in local order.
    Every rank sees the same lengths, so every rank raises alike: none waits in a collective."""

    def __init__(self, lengths: List[int], rank: int, layout: str, who: str):
        world_size = len(lengths)
        self.lengths, self.total = lengths, sum(lengths)
        if layout == "contiguous":
            if min(lengths) == 0:
                raise ValueError(f"{who}: every rank needs a non-empty chunk, got lengths {lengths}")
            starts = [sum(lengths[:r]) for r in range(world_size)]
            self.pieces = [(starts[r], r, 0, lengths[r]) for r in range(world_size)]
        elif layout == "zigzag":
            sizes = _zigzag_chunk_sizes(self.total, world_size)
            expected = [sizes[r] + sizes[2 * world_size - 1 - r] for r in range(world_size)]
            if lengths != expected or min(sizes) == 0:
                raise ValueError(
                    f"{who}: layout='zigzag' expects the parts zigzag_shard cuts (lengths "
                    f"{expected} for {self.total} positions, at least {2 * world_size} positions "
                    f"in all), got lengths {lengths}")
            starts = [sum(sizes[:c]) for c in range(2 * world_size)]
            self.pieces = []
            for c in range(2 * world_size):
                owner = c if c < world_size else 2 * world_size - 1 - c
                self.pieces.append((starts[c], owner, 0 if c < world_size else sizes[owner],
                                    sizes[c]))
        else:
            raise ValueError(f"{who}: layout must be 'contiguous' or 'zigzag', got {layout!r}")
        self.mine = [(start, offset, n) for offset, start, n in
                     sorted((offset, start, n) for start, owner, offset, n in self.pieces
                            if owner == rank)]


def _layout(length: int, group, device, layout: str, who: str) -> _SequenceLayout:
    return _SequenceLayout(_chunk_lengths(length, group, device), dist.get_rank(group), layout, who)


class _PrunedExchange:
    """Pruning across ranks: which pieces of the sequence (and which of their KV heads) each rank
    needs when the pruning threshold rules out distant ones, and the exchange of only those
    (all_to_all with uneven splits in place of the all-gather).

    Key piece j matters to query piece i > j for a KV head only if, for some batch row and some
    query head of its group, the largest gate bias between them reaches the threshold; that bias
    is at most the sum of the gate totals of the pieces strictly between them (log f <= 0, so
    farther pieces only fall further). The totals come from one all-gather of each piece's
    per-(row, head) sums, so every rank derives the same plan. `first[i][g]` is the first piece
    query piece i needs for KV head g (it needs every one from there to itself). By default a
    layer's heads share the earliest of theirs (one op call a query piece; a piece travels with
    every head). Head by head (FOX_CP_PRUNE_HEADS=1), a local head stops at its neighbour while a
    global head of the same layer reaches back further, and only the global head's K, V and gates
    travel that far. A rank's op calls start, for each set of heads, at that piece, as the
    single-process op skips the tiles before it."""

    def __init__(self, log_fgate, group, where: "_SequenceLayout", threshold: float,
                 kv_heads: Optional[int] = None):
        rank, world_size = dist.get_rank(group), len(where.lengths)
        owned = [[i for i, p in enumerate(where.pieces) if p[1] == r] for r in range(world_size)]
        owned = [sorted(ids, key=lambda i: where.pieces[i][2]) for ids in owned]  # local order
        per_rank = max(len(ids) for ids in owned)
        batch, heads = log_fgate.shape[0], log_fgate.shape[2]
        kv_heads = kv_heads or heads
        group_size = heads // kv_heads
        # The pieces' totals, and in the last slot the largest gate (the bound needs log f <= 0).
        mine = log_fgate.new_zeros((per_rank + 1, batch, heads), dtype=torch.float64)
        for slot, i in enumerate(owned[rank]):
            _, _, offset, n = where.pieces[i]
            mine[slot] = log_fgate[:, offset:offset + n].double().sum(1)
        mine[per_rank] = log_fgate.double().amax(1)
        every = mine.new_empty((world_size,) + tuple(mine.shape))
        _all_gather_flat(every.view(-1), mine.view(-1), group=group)
        every = every.cpu()
        positive = float(every[:, per_rank].max()) > 0
        totals = [every[where.pieces[i][1], owned[where.pieces[i][1]].index(i)]
                  for i in range(len(where.pieces))]
        # first[i][g]: walking down from piece i, a KV head keeps a piece while the largest bias of
        # any of its query heads (over the batch) to that piece reaches the threshold.
        self.first = []
        for i in range(len(where.pieces)):
            first = [i] * kv_heads
            between = torch.zeros(batch, heads, dtype=torch.float64)
            for j in range(i - 1, -1, -1):
                reach = between.amax(0).view(kv_heads, group_size).amax(1) >= threshold
                if not bool(reach.any()):
                    break
                first = [j if reach[g] else f for g, f in enumerate(first)]
                between = between + totals[j]
            if not _prune_head_by_head():
                first = [min(first)] * kv_heads
            self.first.append(first)
        # needs[r][j]: the KV heads rank r needs of piece j (a piece it does not own).
        needs = [{} for _ in range(world_size)]
        for r in range(world_size):
            for i in owned[r]:
                for g, f in enumerate(self.first[i]):
                    for j in range(f, i):
                        if where.pieces[j][1] != r:
                            needs[r].setdefault(j, set()).add(g)
        needs = [{j: sorted(hs) for j, hs in sorted(n.items())} for n in needs]
        # A positive log f (not a forget gate) voids the bound: then the all-gather, as without
        # pruning across ranks.
        self.prunes = not positive and any(f > 0 for i, fs in enumerate(self.first) for f in fs)
        # owned[r]: rank r's pieces (indices into where.pieces) in local order, as where.mine
        self.where, self.group, self.rank, self.owned = where, group, rank, owned
        self.kv_heads, self.group_size = kv_heads, group_size
        # Pieces (with their KV heads) this rank sends to each rank, and receives from each, in
        # sequence order.
        self.send = [[(j, hs) for j, hs in needs[r].items() if where.pieces[j][1] == rank]
                     for r in range(world_size)]
        self.receive = [[(j, hs) for j, hs in needs[rank].items() if where.pieces[j][1] == o]
                        for o in range(world_size)]
        # What this rank sends: rows of any head, and rows x KV heads.
        self.sent_rows = sum(where.pieces[j][3] for parts in self.send for j, _ in parts)
        self.sent_head_rows = sum(where.pieces[j][3] * len(hs) for parts in self.send
                                  for j, hs in parts)

    def heads_of(self, slot, kv_heads):
        """Indices along dim 2 of tensor `slot` (0, 1: K, V; 2: the gates, one per query head) for
        the given KV heads."""
        if slot < 2:
            return list(kv_heads)
        return [g * self.group_size + h for g in kv_heads for h in range(self.group_size)]

    def _local(self, t, j):
        """Piece j's rows of its owner's local tensor t (B, T_r, ...)."""
        _, _, offset, n = self.where.pieces[j]
        return t[:, offset:offset + n]

    def _all_to_all(self, parts_to, rows_from, like):
        """Starts sending parts_to[r], the (B, n, h, ...) tensors for rank r, each as n * h rows
        (row-major over its positions, then heads); returns the work and the buffer of the rows
        received, rank after rank, as (rows, B, ...) (the exchange runs along dim 0)."""
        inner = tuple(like.shape[3:])
        flat = [t.permute(1, 2, 0, *range(3, t.dim())).reshape((-1, like.shape[0]) + inner)
                for parts in parts_to for t in parts]
        send = (torch.cat(flat, 0) if flat else like.new_empty((0, like.shape[0]) + inner))
        received = like.new_empty((sum(rows_from), like.shape[0]) + inner)
        work = dist.all_to_all_single(received, send.contiguous(), rows_from,
                                      [sum(t.shape[1] * t.shape[2] for t in parts)
                                       for parts in parts_to],
                                      group=self.group, async_op=True)
        return work, received

    def _part_shape(self, j, hs, slot):
        """(positions, heads) of piece j's part of tensor `slot` for KV heads hs."""
        return self.where.pieces[j][3], len(self.heads_of(slot, hs))

    def _unpack(self, received, items, slot):
        """received (rows, B, ...) -> [(B, n, h, ...) of each (piece, KV heads) of items]."""
        shapes = [self._part_shape(j, hs, slot) for j, hs in items]
        out = []
        for (n, h), part in zip(shapes, torch.split(received, [n * h for n, h in shapes], 0)):
            part = part.reshape((n, h) + tuple(part.shape[1:]))
            out.append(part.permute(2, 0, 1, *range(3, part.dim())))
        return out

    def _rows_of(self, items, slot):
        """The rows (positions x heads) of items' parts of tensor `slot` in the exchange."""
        return sum(n * h for n, h in (self._part_shape(j, hs, slot) for j, hs in items))

    def exchange(self, tensors) -> "_PendingExchange":
        """Starts sending every rank the pieces of `tensors` (this rank's K, V, gates) it needs,
        for the heads it needs them; `pieces()` of the result waits for them."""
        return _PendingExchange(self, tensors)

    def return_to_owners(self, grads, local_shapes):
        """The transpose of `exchange`: grads {piece: (KV heads, [gradient of each tensor for
        those heads])} summed into each owner's local tensors (this rank's own gradients first,
        then every other rank's in rank order)."""
        out = []
        for slot, shape in enumerate(local_shapes):
            like = next(g[slot] for _, g in grads.values())
            to = [[grads[j][1][slot] for j, _ in items] for items in self.receive]
            work, received = self._all_to_all(to, [self._rows_of(items, slot)
                                                   for items in self.send], like)
            total = like.new_zeros(shape)
            for i in self.owned[self.rank]:
                if i in grads:
                    self._local(total, i).add_(grads[i][1][slot])
            work.wait()
            senders = [item for items in self.send for item in items]
            for (j, hs), part in zip(senders, self._unpack(received, senders, slot)):
                self._local(total, j)[:, :, _head_index(self.heads_of(slot, hs))] += part
            out.append(total)
        return out


class _PendingExchange:
    """_PrunedExchange's exchange of K, V and the gates, in flight: one all_to_all per tensor,
    started at construction."""

    def __init__(self, plan: _PrunedExchange, tensors):
        self.plan, self.tensors = plan, tensors
        self.flights = [plan._all_to_all([[_heads(plan._local(t, j), plan.heads_of(slot, hs))
                                           for j, hs in items] for items in plan.send],
                                         [plan._rows_of(items, slot) for items in plan.receive],
                                         t)
                        for slot, t in enumerate(tensors)]

    def pieces(self):
        """{piece: (KV heads, [its rows of each tensor for those heads])} for every piece this
        rank needs or owns (an owned piece with every head)."""
        plan = self.plan
        every = list(range(plan.kv_heads))
        pieces = {i: (every, [plan._local(t, i) for t in self.tensors])
                  for i in plan.owned[plan.rank]}
        order = [item for items in plan.receive for item in items]
        for slot, (work, received) in enumerate(self.flights):
            work.wait()
            for (j, hs), part in zip(order, plan._unpack(received, order, slot)):
                pieces.setdefault(j, (hs, [None] * len(self.tensors)))[1][slot] = part
        self.flights = self.tensors = None
        return pieces


def _head_sets(first):
    """The KV heads of a query piece grouped by the first piece they need: [(first, heads)]."""
    sets = {}
    for g, f in enumerate(first):
        sets.setdefault(f, []).append(g)
    return sorted(sets.items())


def _head_index(index):
    """A list of head indices as a slice where it is a run of consecutive heads: then indexing
    takes a view (no gather kernel), and an assignment is a plain copy."""
    if index and index == list(range(index[0], index[0] + len(index))):
        return slice(index[0], index[0] + len(index))
    return index


def _heads(t, index):
    """t[:, :, index]: a view for consecutive heads."""
    return t[:, :, _head_index(index)]


def _held_index(plan, held, heads, slot):
    """Where the given KV heads lie along dim 2 of tensor `slot` of a piece that holds `held`."""
    return plan.heads_of(slot, [held.index(g) for g in heads])


def _span_keys(plan, pieces, span, heads):
    """K, V and the gates of the pieces in span, for the given KV heads, in sequence order."""
    return [torch.cat([_heads(pieces[j][1][slot], _held_index(plan, pieces[j][0], heads, slot))
                       for j in span], 1) for slot in range(3)]


class _PrunedAttention(torch.autograd.Function):
    """_GatheredAttention under pruning across ranks: each query piece attends, for each set of
    KV heads, from the first piece that set needs, and only the pieces (and heads) some rank
    needs are exchanged."""

    @staticmethod
    def forward(ctx, q, k, v, log_fgate, plan: _PrunedExchange, sm_scale, adaptive_threshold,
                entry):
        pieces = plan.exchange((k, v, log_fgate)).pieces()
        out = torch.empty_like(q)
        lses = []
        for (_, offset, n), i in zip(plan.where.mine, plan.owned[plan.rank]):
            for f, heads in _head_sets(plan.first[i]):
                qh = plan.heads_of(2, heads)  # the query heads of these KV heads
                keys = _span_keys(plan, pieces, range(f, i + 1), heads)
                o, lse = torch.ops.fox.forgetting_attention_fwd(
                    _heads(q[:, offset:offset + n], qh), *keys, None, None, sm_scale,
                    adaptive_threshold, None)
                out[:, offset:offset + n, _head_index(qh)] = o
                lses.append(lse)
        ctx.save_for_backward(q, k, v, log_fgate, out, *lses)
        ctx.plan, ctx.sm_scale, ctx.adaptive_threshold = plan, sm_scale, adaptive_threshold
        ctx.entry = entry
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, log_fgate, out, *lses = ctx.saved_tensors
        plan, entry = ctx.plan, ctx.entry
        pending = entry.take() if entry is not None else None
        if pending is None:
            pending = plan.exchange((k, v, log_fgate))
        pieces = pending.pieces()
        dq = torch.empty_like(q)
        # piece -> (its KV heads here, [dK, dV, dlog_fgate] for them), summed over this rank's
        # queries
        grads = {}
        lse_of = iter(lses)
        for (_, offset, n), i in zip(plan.where.mine, plan.owned[plan.rank]):
            for f, heads in _head_sets(plan.first[i]):
                qh = plan.heads_of(2, heads)
                span = list(range(f, i + 1))
                keys = _span_keys(plan, pieces, span, heads)
                rows = slice(offset, offset + n)
                dq_i, *d = torch.ops.fox.forgetting_attention_bwd(
                    _heads(grad[:, rows], qh).contiguous(), _heads(q[:, rows], qh), *keys,
                    _heads(out[:, rows], qh), next(lse_of), None, None, ctx.sm_scale,
                    ctx.adaptive_threshold, None)
                dq[:, rows, _head_index(qh)] = dq_i
                d[2] = d[2].to(log_fgate.dtype)
                for j, parts in zip(span, zip(*(torch.split(t, [plan.where.pieces[j][3]
                                                                for j in span], 1) for t in d))):
                    held = pieces[j][0]
                    if j not in grads and heads == held:
                        grads[j] = (held, list(parts))
                        continue
                    if j not in grads:
                        grads[j] = (held, [t.new_zeros(t.shape[:2] + (len(plan.heads_of(s, held)),)
                                                       + t.shape[3:])
                                           for s, t in enumerate(parts)])
                    for slot, part in enumerate(parts):
                        index = _head_index(_held_index(plan, held, heads, slot))
                        grads[j][1][slot][:, :, index] += part
        dk, dv, dg = plan.return_to_owners(grads, [k.shape, v.shape, log_fgate.shape])
        _prefetch_previous(entry)
        return dq, dk, dv, dg, None, None, None, None


def _attend(q, k, v, log_fgate, group, where: _SequenceLayout, sm_scale, adaptive_threshold,
            chain: Optional[_GatherChain] = None):
    """The local queries against the prefix of the sequence each of their pieces needs; with a
    chain, linked to the previous call for the backward prefetch."""
    if torch.is_autocast_enabled(q.device.type):
        # As the op's autocast kernel: q, k, v in the autocast dtype, the gates in float32.
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t
                   for t in (q, k, v))
        if log_fgate.dtype != torch.float64:
            log_fgate = log_fgate.float()
    linked = chain is not None and torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k, v, log_fgate))
    if adaptive_threshold is not None and _prune_across_ranks():
        plan = _PrunedExchange(log_fgate.detach(), group, where, adaptive_threshold, k.shape[2])
        if plan.prunes:
            entry = chain.link((k, v, log_fgate), lambda *kvg: plan.exchange(kvg)) if linked \
                else None
            with torch.autocast(q.device.type, enabled=False):
                return _PrunedAttention.apply(q, k, v, log_fgate, plan, sm_scale,
                                              adaptive_threshold, entry)
    heads = _head_groups(q.shape[2], k.shape[2])
    entry = None
    if linked:
        entry = chain.link((k, v, log_fgate),
                           lambda *kvg: _gather_heads(*kvg, group, where, heads))
    with torch.autocast(q.device.type, enabled=False):
        return _GatheredAttention.apply(q, k, v, log_fgate, group, where, sm_scale,
                                        adaptive_threshold, heads, entry)


class _PreviousTokens(torch.autograd.Function):
    """Forward: y (B, T, C) -> (B, pieces, C), the token before each of this rank's pieces (zeros
    before the first piece of the sequence), from one all-gather of every piece's last token.
    Backward: the gradients are put at their source pieces and summed over the ranks (one
    all-reduce). One function for every rank, whether or not its pieces have a predecessor, so
    that every rank runs the same collectives in backward."""

    @staticmethod
    def forward(ctx, y, group, where: "_SequenceLayout"):
        world_size = len(where.lengths)
        per_rank = max(sum(1 for p in where.pieces if p[1] == r) for r in range(world_size))
        ends = y.new_zeros((y.shape[0], per_rank) + tuple(y.shape[2:]))
        for i, (_, offset, n) in enumerate(where.mine):
            ends[:, i] = y[:, offset + n - 1]
        gathered = [torch.empty_like(ends) for _ in range(world_size)]
        dist.all_gather(gathered, ends, group=group)
        # Piece i of the sequence ends where piece i + 1 begins: (owner, index in its ends).
        source = {}
        for owner in range(world_size):
            owned = sorted((offset, start, n) for start, o, offset, n in where.pieces if o == owner)
            for j, (_, start, n) in enumerate(owned):
                source[start + n] = (owner, j)
        ctx.group, ctx.where, ctx.source, ctx.per_rank = group, where, source, per_rank
        ctx.y_shape = y.shape
        first = [gathered[source[start][0]][:, source[start][1]] if start > 0
                 else torch.zeros_like(ends[:, 0]) for start, _, _ in where.mine]
        return torch.stack(first, 1)

    @staticmethod
    def backward(ctx, grad):
        where, world_size = ctx.where, len(ctx.where.lengths)
        total = grad.new_zeros((world_size, ctx.per_rank) + tuple(grad.shape[:1]) +
                               tuple(grad.shape[2:]))
        for i, (start, _, _) in enumerate(where.mine):
            if start > 0:
                owner, j = ctx.source[start]
                total[owner, j] += grad[:, i]
        dist.all_reduce(total, group=ctx.group)
        grad_y = grad.new_zeros(ctx.y_shape)
        rank = dist.get_rank(ctx.group)
        for i, (_, offset, n) in enumerate(where.mine):
            grad_y[:, offset + n - 1] = total[rank, i]
        return grad_y, None, None


def _require_initialized(who: str):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{who}: torch.distributed is not initialized (call "
                           "torch.distributed.init_process_group first)")


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

    adaptive_threshold (the same on every rank) prunes as the op does, and across ranks too: a
    rank is not sent the parts of the sequence whose gate bias to every one of its queries, in
    every head, lies below it (log_fgate <= 0, as a log forget gate is).
    """
    who = "context_parallel_attention"
    _require_initialized(who)
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"{who}: layout must be 'contiguous' or 'zigzag', got {layout!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or log_fgate.dim() != 3:
        raise ValueError(f"{who}: q, k, v must be (batch, seqlen, heads, head_dim) and log_fgate "
                         f"(batch, seqlen, heads), got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}, {tuple(log_fgate.shape)}")
    if not (q.shape[1] == k.shape[1] == v.shape[1] == log_fgate.shape[1]):
        raise ValueError(f"{who}: q, k, v and log_fgate must hold the same part of the sequence, "
                         f"got lengths {q.shape[1]}, {k.shape[1]}, {v.shape[1]}, "
                         f"{log_fgate.shape[1]}")
    where = _layout(q.shape[1], group, q.device, layout, who)
    return _attend(q, k, v, log_fgate, group, where, sm_scale, adaptive_threshold)


def set_context_parallel(model, group=None, *, layout: Optional[str] = "contiguous"):
    """Runs a fox model (forgetting_transformer.nn's ForgettingTransformerForCausalLM or
    ForgettingTransformerModel) context-parallel over the ranks of `group`: every rank then passes
    its part of each sequence (`input_ids` and `labels` cut as for context_parallel_attention:
    one contiguous chunk a rank, or `zigzag_shard`'s two) and gets the per-token outputs of its
    part, equal to those of the whole sequence in one process. Attention sees the whole
    sequence through context_parallel_attention, the KV-shift of a part's first token reads the
    token before it from the rank that holds it, RoPE takes global positions and the pruning
    threshold is agreed over the ranks. Gradients of the parameters are each rank's share: sum
    them over the group (data parallelism over the same ranks does, with the loss scaled by the
    number of ranks it averages over). layout=None turns it off. Not with a cache or seq_start
    (generation runs on whole sequences)."""
    from . import _C
    from .nn import ForgettingTransformerModel
    decoder = getattr(model, "model", model)
    if not isinstance(decoder, ForgettingTransformerModel):
        raise TypeError("set_context_parallel: expects a forgetting_transformer.nn "
                        "ForgettingTransformerForCausalLM or ForgettingTransformerModel, got "
                        f"{type(model).__name__}")
    if layout is None:
        _C.nn.set_sequence_shard(decoder.cpp_module, None)
        return model
    who = "set_context_parallel"
    _require_initialized(who)
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"{who}: layout must be 'contiguous' or 'zigzag', got {layout!r}")
    state = {}
    chain = _GatherChain()

    def prepare(shard, length, device):
        where = _layout(length, group, device, layout, who)
        state["where"] = where
        chain.reset()  # a new forward pass: its attention calls link among themselves
        shard.positions = torch.cat([torch.arange(start, start + n, dtype=torch.int64)
                                     for start, _, n in where.mine]).to(device)
        shard.piece_lengths = [n for _, _, n in where.mine]
        shard.sequence_length = where.total

    def previous_tokens(y):
        return _PreviousTokens.apply(y, group, state["where"])

    def attention(q, k, v, log_fgate, sm_scale, adaptive_threshold):
        if adaptive_threshold is not None:   # the same threshold on every rank: the lowest
            t = torch.tensor([adaptive_threshold], dtype=torch.float64, device=q.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
            adaptive_threshold = float(t.item())
        return _attend(q, k, v, log_fgate, group, state["where"], sm_scale, adaptive_threshold,
                       chain)

    shard = _C.nn.SequenceShard()
    shard.prepare, shard.previous_tokens, shard.attention = prepare, previous_tokens, attention
    _C.nn.set_sequence_shard(decoder.cpp_module, shard)
    return model
