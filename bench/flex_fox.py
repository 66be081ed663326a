"""FoX through FlexAttention, the baseline of bench_cuda.py and bench_model.py."""


def fox_score_mod(c_q, c_k):
    """score_mod adding the forget-gate bias c[q] - c[kv], c (B, H, N) the cumulative log f.

    Pass c twice, as two tensors (c_q = c, c_k = c.clone() where c needs a gradient): FlexAttention
    differentiates a captured tensor only where the score_mod indexes it once. The gradient of c is
    then that of c_q plus that of c_k (scattered by FlexAttention with atomic adds)."""
    def fox(score, b, h, q_idx, kv_idx):
        return score + c_q[b, h, q_idx] - c_k[b, h, kv_idx]
    return fox
