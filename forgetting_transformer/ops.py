"""Python face of the fox ops: the user-facing wrapper and the fake (meta) kernels that let
torch.compile and opcheck trace the C++ ops."""
import math
from typing import Optional

import torch

from . import _C  # noqa: F401  (registers torch.ops.fox.*)


def forgetting_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor,
    *,
    head_first: bool = False,
    seq_start: Optional[torch.Tensor] = None,
    sm_scale: Optional[float] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    adaptive_threshold: Optional[float] = None,
    cache_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Forgetting Attention (Lin et al., ICLR 2025); drop-in for the authors' function.

    softmax(sm_scale * q k^T + D) v, causal, with D_ij = sum_{l=j+1..i} log_fgate_l.

    Args:
        q: (batch, seqlen_q, num_heads, head_dim) unless head_first.
        k, v: (batch, seqlen_k, num_kv_heads, head_dim) unless head_first; num_heads must be a
            multiple of num_kv_heads (GQA/MQA). seqlen_q <= seqlen_k: the queries are the last
            seqlen_q positions (chunked prefill, decoding).
        log_fgate: (batch, seqlen_k, num_heads) unless head_first, float32: log of the forget
            gates, e.g. F.logsigmoid(fgate_logit.float()). float16 is accepted too (a compact
            decoding cache: half the gate bytes, each value rounded to 11 bits, summed in
            float32); its gradient is float16.
        head_first: tensors are (batch, heads, seqlen, ...) instead of (batch, seqlen, heads, ...).
        seq_start: (batch,) integers in [0, seqlen_k): keys before seq_start[b] are ignored
            (left padding). Queries with no visible key get zeros.
        sm_scale: scale of q.k; default 1/sqrt(head_dim).
        cu_seqlens: (num_seqs + 1,) integer offsets of a packed batch (batch size 1), as in
            FlashAttention's varlen API; each sequence attends causally within itself.
        adaptive_threshold: adaptive computation pruning: skip key tiles whose largest gate bias
            is below this value (see `pruning_threshold`). Default: exact attention.
        cache_seqlens: (batch,) integers in [seqlen_q, seqlen_k]: row b holds cache_seqlens[b]
            valid keys (a preallocated KV cache filled to different lengths, as in
            FlashAttention's kvcache API, the new tokens already written); its queries are the
            last seqlen_q of them and later keys are ignored.

    Returns:
        (batch, seqlen_q, num_heads, head_dim), or (batch, num_heads, seqlen_q, head_dim) if
        head_first, in the dtype of q.
    """
    if head_first:
        for name, x, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("log_fgate", log_fgate, 3)):
            if x.dim() != rank:
                raise RuntimeError(
                    f"head_first: {name} must have rank {rank} (batch, heads, seqlen"
                    f"{', head_dim' if rank == 4 else ''}), got shape {tuple(x.shape)}"
                )
        q, k, v, log_fgate = (x.transpose(1, 2) for x in (q, k, v, log_fgate))
    out = torch.ops.fox.forgetting_attention(
        q, k, v, log_fgate, seq_start, cu_seqlens, sm_scale, adaptive_threshold, cache_seqlens
    )
    return out.transpose(1, 2) if head_first else out


def pruning_threshold(q: torch.Tensor, k: torch.Tensor, tolerance: float, *,
                      sm_scale: Optional[float] = None, head_first: bool = False) -> float:
    """The tolerance form of adaptive computation pruning (Lin et al. 2025): the
    ``adaptive_threshold`` that loses at most ``tolerance`` of each row's attention mass.

    With U = max|q|·max|k|·sm_scale (norms over the head dimension) every score lies in [-U, U];
    skipping the keys whose gate bias is below log(tolerance) - 2U - log(seqlen_k) then drops at
    most ``tolerance`` of the softmax mass of every query (the diagonal keeps the denominator
    >= e^-U). Pass the result as ``adaptive_threshold``.
    """
    if not 0.0 < tolerance < 1.0:
        raise ValueError(f"tolerance must be in (0, 1), got {tolerance}")
    head_dim = q.shape[-1]
    seqlen_k = k.shape[2] if head_first else k.shape[1]
    scale = sm_scale if sm_scale is not None else head_dim ** -0.5
    bound = (q.float().norm(dim=-1).max() * k.float().norm(dim=-1).max()).item() * scale
    return math.log(tolerance) - 2.0 * bound - math.log(max(seqlen_k, 1))


# ---- fake kernels: shapes and dtypes only -------------------------------------------------------


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.register_fake("fox::forgetting_attention")
def _forgetting_attention_fake(q, k, v, log_fgate, seq_start=None, cu_seqlens=None,
                               sm_scale=None, adaptive_threshold=None, cache_seqlens=None):
    return q.new_empty(q.shape)


@torch.library.register_fake("fox::forgetting_attention_fwd")
def _forgetting_attention_fwd_fake(q, k, v, log_fgate, seq_start=None, cu_seqlens=None,
                                   sm_scale=None, adaptive_threshold=None, cache_seqlens=None):
    batch, seqlen_q, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, seqlen_q), dtype=_lse_dtype(q))


@torch.library.register_fake("fox::forgetting_attention_bwd")
def _forgetting_attention_bwd_fake(grad_out, q, k, v, log_fgate, out, lse, seq_start=None,
                                   cu_seqlens=None, sm_scale=None, adaptive_threshold=None,
                                   cache_seqlens=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), \
        log_fgate.new_empty(log_fgate.shape)
