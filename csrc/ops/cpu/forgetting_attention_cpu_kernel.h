// CPU kernels of Forgetting Attention: tiled, online softmax, O(N*D) extra memory.
//
// Kernels read only ForwardParams/BackwardParams (plus, for bf16, operands the backend packed for
// the bf16 GEMM); matrix products of tiles go through blas.h (TileGemms below) and the work is
// spread over the cores by parallel_tasks (parallel.h).
//
// Gate bias without cancellation: for a tile of queries anchored at position a (its first query
// for the forward/dQ passes, the last key of the key tile for the dK/dV pass) we keep
// R_x = c_x - c_a, built by sums that start at a: forward over positions after a, backward over
// positions before a. Then d_ij = R_{p_i} - R_j. Its error grows with the distance to the
// anchor, never with the absolute position (two global prefix sums of ~1e6 would lose the bias
// of nearby tokens entirely).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../params.h"
#include "blas.h"
#include "parallel.h"
#include "vectorized.h"

namespace fox::cpu {

constexpr int64_t kBlockQ = 256;
constexpr int64_t kBlockK = 128;

using BFloat16 = c10::BFloat16;

// Accumulation type of an input type: float64 for float64 (the gradcheck path), else float32.
template <typename In>
using AccOf = std::conditional_t<std::is_same_v<In, double>, double, float>;

// bf16 inputs: copies of K, V (and Q, dO for the backward) in the layouts of the bf16 GEMM, made
// by the backend (O(N*D) memory, one pass). Rows are absolute rows of the tensors.
struct PackedBf16 {
  // (batch, kv_heads, D/2, ld_t, 2): K^T and V^T, head-dim pairs interleaved (B of q.k, dO.v)
  const BFloat16* kt = nullptr;
  const BFloat16* vt = nullptr;
  // (batch, kv_heads, pairs, D, 2): V, key-row pairs interleaved, zero rows after the end (B of P.V)
  const BFloat16* vp = nullptr;
  // (batch, heads, D, ld_qt): dO^T, zero columns after the end (A of P^T.dO)
  const BFloat16* dot = nullptr;
  // dS is not rounded to bf16 but split into hi + lo (dS's rounding alone doubled the dQ error of
  // the float32 path): the products with dS run over pairs (hi, lo) against a pair (x, x).
  // (batch, kv_heads, seqlen_k, D, 2): K with each element twice (B of dS.K)
  const BFloat16* kd = nullptr;
  // (batch, heads, D, 2 * ld_qt): Q^T with each element twice (A of dS^T.Q)
  const BFloat16* qtd = nullptr;
  int64_t ld_t = 0, pairs = 0, ld_qt = 0;
};

// Pointers of one (sequence, head) pair.
template <typename In>
struct HeadView {
  using Acc = AccOf<In>;
  const In* q;
  const In* k;
  const In* v;
  const Acc* g;  // log forget gates, stride g_stride between positions
  int64_t ldq, ldk, ldv, g_stride;
};

template <typename In>
inline HeadView<In> head_view(const ForwardParams& p, const SequenceView& s, int64_t h) {
  const int64_t hk = h / p.heads_per_kv_head();
  HeadView<In> view;
  view.q = static_cast<const In*>(p.q) + s.batch_index * p.q_batch_stride + s.row_q * p.q_row_stride +
           h * p.q_head_stride;
  view.k = static_cast<const In*>(p.k) + s.batch_index * p.k_batch_stride + s.row_k * p.k_row_stride +
           hk * p.k_head_stride;
  view.v = static_cast<const In*>(p.v) + s.batch_index * p.v_batch_stride + s.row_k * p.v_row_stride +
           hk * p.v_head_stride;
  view.g = static_cast<const AccOf<In>*>(p.log_fgate) + s.batch_index * p.g_batch_stride +
           s.row_k * p.g_row_stride + h * p.g_head_stride;
  view.ldq = p.q_row_stride;
  view.ldk = p.k_row_stride;
  view.ldv = p.v_row_stride;
  view.g_stride = p.g_row_stride;
  return view;
}

// Gate sums relative to an anchor position a: R[x] = c_x - c_a for x in [lo, hi), computed by
// walking away from a. Storage is indexed by x - lo.
// Gate sums are kept in float64 (see vectorized.h); the walk costs O(tile) per tile.
using Bias = double;

template <typename G>
inline void relative_cumsum(const G* g, int64_t g_stride, int64_t anchor, int64_t lo,
                            int64_t hi, Bias* R) {
  if (anchor >= lo && anchor < hi) R[anchor - lo] = 0;
  Bias run = 0;
  for (int64_t x = std::max(anchor + 1, lo); x < hi; ++x) {
    // callers pass ranges that contain the anchor, so the walk covers every position in between
    run += static_cast<Bias>(g[x * g_stride]);
    R[x - lo] = run;
  }
  run = 0;
  for (int64_t x = std::min(anchor, hi) - 1; x >= lo; --x) {
    run -= static_cast<Bias>(g[(x + 1) * g_stride]);
    R[x - lo] = run;
  }
}

// R of the keys [j0, j1) of a query tile anchored at `anchor`, for tiles visited from the diagonal
// downwards: positions >= anchor come from the queries' Rq, the others continue the walk down from
// the previous tile (`carry` holds R at j1 on entry and at j0 on return). Returns the largest bias
// of the tile pair, R(anchor) - R(j1 - 1) = -R(j1 - 1), as float for the pruning test.
template <typename T>
inline float key_biases(const HeadView<T>& hv, int64_t anchor, int64_t j0, int64_t j1,
                        const Bias* Rq, Bias& carry, Bias* Rk) {
  for (int64_t j = j1 - 1; j >= j0; --j) {
    if (j >= anchor) {
      Rk[j - j0] = Rq[j - anchor];
    } else {
      carry -= static_cast<Bias>(hv.g[(j + 1) * hv.g_stride]);
      Rk[j - j0] = carry;
    }
  }
  return static_cast<float>(-Rk[j1 - 1 - j0]);
}

// One task of the passes over query tiles (forward and dQ): its sequence, head and rows, and the
// gate sums Rq of its queries relative to the anchor, the position of its first query.
template <typename T>
struct QueryTile {
  SequenceView s;
  int64_t h, i0, nq, anchor, last_pos;
  HeadView<T> hv;
};

// Fills tile and Rq for task (sequence, head, query tile); false when the tile is past the end of
// a shorter (packed) sequence.
template <typename T>
inline bool query_tile(const ForwardParams& p, int64_t task, int64_t max_q_tiles,
                       QueryTile<T>& t, Bias* Rq) {
  // Tasks go out from the last query tiles (most key tiles) to the first, so that the cheapest
  // tasks come last and even out the cores' loads.
  const int64_t pairs = p.batch * p.num_heads;
  t.h = (task % pairs) % p.num_heads;
  t.s = p.sequence((task % pairs) / p.num_heads);
  t.i0 = (max_q_tiles - 1 - task / pairs) * kBlockQ;
  if (t.i0 >= t.s.len_q) return false;
  t.nq = std::min(kBlockQ, t.s.len_q - t.i0);
  t.hv = head_view<T>(p, t.s, t.h);
  t.anchor = t.s.query_position(t.i0);
  t.last_pos = t.anchor + t.nq - 1;
  relative_cumsum(t.hv.g, t.hv.g_stride, t.anchor, t.anchor, t.last_pos + 1, Rq);
  return true;
}

// ----------------------------------------------------------------------------------------------
// Tile products of one bound (sequence, head), without the softmax scale (callers apply it):
//   scores:   X (nq x nk) = A (nq x D: rows of Q or dO) . B^T, B = keys [j0, j0 + nk) of K or V
//   times:    C (nq x D) += X (nq x nk, float) . (K or V rows [j0, j0 + nk))
//   grads_kv: dK^T, dV^T (D x nk, ld kBlockK) += Q^T dS, dO^T P over the queries [i0, i0 + nq)
// float32/float64 run the BLAS on the tensors; bf16 runs the bf16 micro-kernel on packed copies.
enum class Operand { K, V };

template <typename In>
struct TileGemms {
  using Acc = AccOf<In>;
  HeadView<In> hv;
  const In* dout = nullptr;  // dO rows of the sequence and head (backward)
  int64_t lddo = 0, D;

  TileGemms(const ForwardParams& p, const PackedBf16*) : D(p.head_dim) {}
  void bind(const ForwardParams& p, const SequenceView& s, int64_t h, const In* dout_rows,
            int64_t ld_dout) {
    hv = head_view<In>(p, s, h);
    dout = dout_rows;
    lddo = ld_dout;
  }
  const In* rows(Operand o, int64_t j0) const {
    return o == Operand::K ? hv.k + j0 * hv.ldk : hv.v + j0 * hv.ldv;
  }
  int64_t ld(Operand o) const { return o == Operand::K ? hv.ldk : hv.ldv; }

  void scores(const In* a, int64_t lda, int64_t nq, Operand o, int64_t j0, int64_t nk, Acc* x,
              int64_t ldx) {
    gemm_abt<Acc>(nq, nk, D, Acc(1), a, lda, rows(o, j0), ld(o), Acc(0), x, ldx);
  }
  void times(const Acc* x, int64_t ldx, int64_t nq, Operand o, int64_t j0, int64_t nk, Acc* c,
             int64_t ldc) {
    gemm_ab<Acc>(nq, D, nk, Acc(1), x, ldx, rows(o, j0), ld(o), Acc(1), c, ldc);
  }
  // dV += P^T dO and dK += dS^T Q, (key x D) row-major: for sgemm this orientation measured
  // 3-6% faster in fwd+bwd than accumulating the transposes as the bf16 path does.
  static constexpr bool kGradsTransposed = false;
  void grads_kv(int64_t i0, int64_t nq, int64_t nk, const Acc* P, const Acc* dS, int64_t ld,
                Acc* dk, Acc* dv) {
    gemm_atb<Acc>(nk, D, nq, Acc(1), P, ld, dout + i0 * lddo, lddo, Acc(1), dv, D);
    gemm_atb<Acc>(nk, D, nq, Acc(1), dS, ld, hv.q + i0 * hv.ldq, hv.ldq, Acc(1), dk, D);
  }
  void done() {}
};

template <>
struct TileGemms<BFloat16> {
  using Acc = float;
  static constexpr int64_t kLdX = kBlockK + 2;  // bf16 copy of a float tile, one pad pair
  const PackedBf16& pk;
  int64_t D, row_k = 0;
  const BFloat16 *kt = nullptr, *vt = nullptr, *vp = nullptr, *dot = nullptr;
  const BFloat16 *kd = nullptr, *qtd = nullptr;
  std::vector<uint16_t> xb, pv, sv;  // bf16 tiles: X (row-major or split); VNNI P; split dS
  std::vector<float> zeros;

  TileGemms(const ForwardParams& p, const PackedBf16* packed)
      : pk(*packed), D(p.head_dim), xb(kBlockQ * 2 * kLdX), pv((kBlockQ / 2 + 1) * kBlockK * 2),
        sv(kBlockQ * kBlockK * 2), zeros(kBlockK, 0.f) {}

  void bind(const ForwardParams& p, const SequenceView& s, int64_t h, const BFloat16*, int64_t) {
    const int64_t kvh = s.batch_index * p.num_kv_heads + h / p.heads_per_kv_head();
    const int64_t qh = s.batch_index * p.num_heads + h;
    row_k = s.row_k;
    auto at = [](const BFloat16* base, int64_t offset) { return base ? base + offset : nullptr; };
    kt = at(pk.kt, kvh * D * pk.ld_t + s.row_k * 2);
    vt = at(pk.vt, kvh * D * pk.ld_t + s.row_k * 2);
    vp = at(pk.vp, kvh * pk.pairs * D * 2);
    dot = at(pk.dot, qh * D * pk.ld_qt + s.row_q);
    kd = at(pk.kd, (kvh * p.seqlen_k + s.row_k) * D * 2);
    qtd = at(pk.qtd, qh * D * 2 * pk.ld_qt + 2 * s.row_q);
  }

  void scores(const BFloat16* a, int64_t lda, int64_t nq, Operand o, int64_t j0, int64_t nk,
              float* x, int64_t ldx) {
    gemm_bf16_vnni(nq, nk, D, a, lda, (o == Operand::K ? kt : vt) + j0 * 2, pk.ld_t, x, ldx, false);
  }
  void times(const float* x, int64_t ldx, int64_t nq, Operand o, int64_t j0, int64_t nk, float* c,
             int64_t ldc) {
    if (o == Operand::K) {  // dS.K: dS split, K doubled
      for (int64_t r = 0; r < nq; ++r) split_bf16(x + r * ldx, xb.data() + r * 2 * kLdX, nk);
      gemm_bf16_vnni(nq, D, 2 * nk, reinterpret_cast<const BFloat16*>(xb.data()), 2 * kLdX,
                     kd + j0 * D * 2, D, c, ldc, true);
      return;
    }
    // P.V, P rounded. The pairs of vp start at even absolute rows: a tile starting at an odd row starts one
    // row early, with a zero column in front of X (and a zero column closes an odd width).
    const int64_t off = (row_k + j0) & 1, width = (off + nk + 1) & ~int64_t(1);
    for (int64_t r = 0; r < nq; ++r) {
      uint16_t* y = xb.data() + r * kLdX;
      y[0] = 0;
      y[width - 1] = 0;
      to_bf16(x + r * ldx, y + off, nk);
    }
    const BFloat16* b = vp + (row_k + j0 - off) * D;
    gemm_bf16_vnni(nq, D, width, reinterpret_cast<const BFloat16*>(xb.data()), kLdX, b, D, c, ldc,
                   true);
  }
  // dV^T and dK^T (D x kBlockK): the micro-kernel wants the query dimension paired in B.
  static constexpr bool kGradsTransposed = true;
  void grads_kv(int64_t i0, int64_t nq, int64_t nk, const float* P, const float* dS, int64_t ld,
                float* dkT, float* dvT) {
    // dV^T: B = P with query-row pairs interleaved; an odd last row pairs with zeros (dO^T has a
    // zero column after the end, so A reads finite values there).
    for (int64_t r = 0; r < nq; r += 2)
      interleave_bf16(P + r * ld, r + 1 < nq ? P + (r + 1) * ld : zeros.data(),
                      pv.data() + r * kBlockK, nk);
    gemm_bf16_vnni(D, nk, (nq + 1) & ~int64_t(1), dot + i0, pk.ld_qt,
                   reinterpret_cast<const BFloat16*>(pv.data()), kBlockK, dvT, kBlockK, true);
    // dK^T: B = dS split (one row pair per query), A = Q^T doubled
    for (int64_t r = 0; r < nq; ++r) split_bf16(dS + r * ld, sv.data() + r * kBlockK * 2, nk);
    gemm_bf16_vnni(D, nk, 2 * nq, qtd + 2 * i0, 2 * pk.ld_qt,
                   reinterpret_cast<const BFloat16*>(sv.data()), kBlockK, dkT, kBlockK, true);
  }
  void done() { gemm_bf16_release(); }
};

// ----------------------------------------------------------------------------------------------
// Forward: one task per (sequence, head, query tile). Key tiles are visited from the diagonal
// backwards so that R of the keys extends the walk from the anchor, and pruning is a `break`.
template <typename In>
void forward_kernel(const ForwardParams& p, const PackedBf16* packed = nullptr) {
  using Acc = AccOf<In>;
  const int64_t D = p.head_dim, H = p.num_heads;
  const int64_t max_q_tiles = (p.seqlen_q + kBlockQ - 1) / kBlockQ;
  const int64_t num_tasks = p.batch * H * max_q_tiles;
  const Acc scale = static_cast<Acc>(p.scale);

  parallel_tasks(num_tasks, [&](TaskQueue& tasks) {
    TileGemms<In> gemms(p, packed);
    std::vector<Acc> S(kBlockQ * kBlockK), acc(kBlockQ * D), row_max(kBlockQ), row_sum(kBlockQ);
    std::vector<Bias> Rq(kBlockQ), Rk(kBlockK);
    for (int64_t task; tasks.next(task);) {
      QueryTile<In> tile;
      if (!query_tile(p, task, max_q_tiles, tile, Rq.data())) continue;
      const auto& [s, h, i0, nq, anchor, last_pos, hv] = tile;
      gemms.bind(p, s, h, nullptr, 0);

      std::fill(acc.begin(), acc.begin() + nq * D, Acc(0));
      std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<Acc>::infinity());
      std::fill(row_sum.begin(), row_sum.end(), Acc(0));

      // Walk key tiles [j0, j1) downwards from the one that holds the last query's position.
      Bias carry = 0;         // R at position j1 (the key just after the current tile)
      int64_t j1 = last_pos + 1;
      while (j1 > s.first_key) {
        const int64_t j0 = std::max(s.first_key, j1 - kBlockK);
        const int64_t nk = j1 - j0;
        // Largest bias of this tile pair: first query (R = 0) against the last key. Earlier
        // tiles only have smaller biases, so the rest of the row is pruned too.
        if (key_biases(hv, anchor, j0, j1, Rq.data(), carry, Rk.data()) < p.prune_threshold) break;

        // Rows [0, r0) precede the tile's first key (diagonal tiles only): nothing to compute.
        const int64_t r0 = std::clamp<int64_t>(j0 - anchor, 0, nq - 1);
        gemms.scores(hv.q + (i0 + r0) * hv.ldq, hv.ldq, nq - r0, Operand::K, j0, nk,
                     S.data() + r0 * kBlockK, kBlockK);
        for (int64_t r = r0; r < nq; ++r) {
          Acc* srow = S.data() + r * kBlockK;
          // keys after the query's position are masked (only in the diagonal tile)
          const int64_t visible = std::clamp<int64_t>(anchor + r - j0 + 1, 0, nk);
          const Acc tile_max = visible > 0
                                   ? add_bias_and_max(srow, Rk.data(), Rq[r], scale, visible)
                                   : -std::numeric_limits<Acc>::infinity();
          std::fill(srow + visible, srow + nk, -std::numeric_limits<Acc>::infinity());
          const Acc new_max = std::max(row_max[r], tile_max);
          if (new_max == -std::numeric_limits<Acc>::infinity()) {
            std::fill(srow, srow + nk, Acc(0));
            continue;
          }
          const Acc correction = std::exp(row_max[r] - new_max);
          row_sum[r] = row_sum[r] * correction + exp_and_sum(srow, new_max, nk);
          row_max[r] = new_max;
          if (correction != Acc(1)) scale_row(acc.data() + r * D, correction, D);
        }
        gemms.times(S.data() + r0 * kBlockK, kBlockK, nq - r0, Operand::V, j0, nk,
                    acc.data() + r0 * D, D);
        j1 = j0;
      }

      In* out = static_cast<In*>(p.out) + s.batch_index * p.o_batch_stride +
                (s.row_q + i0) * p.o_row_stride + h * p.o_head_stride;
      Acc* lse = static_cast<Acc*>(p.lse) + (s.batch_index * H + h) * p.seqlen_q + s.row_q + i0;
      for (int64_t r = 0; r < nq; ++r) {
        const bool empty = row_sum[r] == Acc(0);
        const Acc inv = empty ? Acc(0) : Acc(1) / row_sum[r];
        for (int64_t d = 0; d < D; ++d) out[r * p.o_row_stride + d] = static_cast<In>(acc[r * D + d] * inv);
        lse[r] = empty ? -std::numeric_limits<Acc>::infinity() : row_max[r] + std::log(row_sum[r]);
      }
    }
    gemms.done();
  });
}

// ----------------------------------------------------------------------------------------------
// Backward. Pass 1 (per sequence, kv head, key tile): dK, dV and the column sums of dS, which
// give dc_t = -sum_i dS_it. Pass 2 (per sequence, head, query tile): dQ. Pass 3: dlog_fgate as
// the reverse cumulative sum of dc. No two tasks write the same output, so the result is
// deterministic; the price is recomputing S and dP in pass 2.

// P and dS of one (query tile, key tile) pair, from the saved lse and delta = rowsum(dO * O).
// On entry P holds q.k (unscaled) and dP holds dO.v; on return P holds P and dP holds dS (without
// the softmax scale). Masked entries are zero.
template <typename Acc>
inline void probabilities_and_dscores(int64_t nq, int64_t nk, const Bias* Rq, const Bias* Rk,
                                      Acc scale, int64_t first_q_pos, int64_t j0, const Acc* lse,
                                      const Acc* delta, Acc* P, Acc* dP, int64_t ld) {
  for (int64_t r = 0; r < nq; ++r) {
    Acc* prow = P + r * ld;
    Acc* dprow = dP + r * ld;
    const int64_t visible =
        std::isinf(lse[r]) ? 0 : std::clamp<int64_t>(first_q_pos + r - j0 + 1, 0, nk);
    probs_and_dscores(prow, dprow, Rk, Rq[r], scale, lse[r], delta[r], visible);
    std::fill(prow + visible, prow + nk, Acc(0));
    std::fill(dprow + visible, dprow + nk, Acc(0));
  }
}

template <typename In>
void backward_kernel(const BackwardParams& p, AccOf<In>* dc /* (batch, heads, seqlen_k) scratch */,
                     AccOf<In>* delta_buf /* (batch, heads, seqlen_q) scratch */,
                     AccOf<In>* rowsum_buf /* (batch, heads, seqlen_q) scratch */,
                     const PackedBf16* packed = nullptr) {
  using Acc = AccOf<In>;
  const int64_t D = p.head_dim, H = p.num_heads, Hkv = p.num_kv_heads;
  const int64_t group = p.heads_per_kv_head();
  const Acc scale = static_cast<Acc>(p.scale);

  auto out_row = [&](const void* base, int64_t bs, int64_t rs, int64_t hs, const SequenceView& s,
                     int64_t h) {
    return static_cast<const In*>(base) + s.batch_index * bs + s.row_q * rs + h * hs;
  };

  // delta_i = dO_i . O_i
  parallel_tasks(p.batch * H, [&](TaskQueue& tasks) {
    for (int64_t bh; tasks.next(bh);) {
      const SequenceView s = p.sequence(bh / H);
      const int64_t h = bh % H;
      const In* o = out_row(p.out, p.o_batch_stride, p.o_row_stride, p.o_head_stride, s, h);
      const In* dout = out_row(p.dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride, s, h);
      Acc* delta = delta_buf + (s.batch_index * H + h) * p.seqlen_q + s.row_q;
      for (int64_t i = 0; i < s.len_q; ++i) {
        Acc sum = 0;
        for (int64_t d = 0; d < D; ++d)
          sum += static_cast<Acc>(o[i * p.o_row_stride + d]) * static_cast<Acc>(dout[i * p.do_row_stride + d]);
        delta[i] = sum;
      }
    }
  });

  // dQ = scale * (dS K), written from an unscaled accumulator
  auto write_dq = [&](const SequenceView& s, int64_t h, int64_t i0, int64_t nq, const Acc* dq) {
    In* dq_out = static_cast<In*>(p.dq) + s.batch_index * p.dq_batch_stride +
                 (s.row_q + i0) * p.dq_row_stride + h * p.dq_head_stride;
    for (int64_t r = 0; r < nq; ++r)
      for (int64_t d = 0; d < D; ++d)
        dq_out[r * p.dq_row_stride + d] = static_cast<In>(dq[r * D + d] * scale);
  };

  // dQ on its own, per (sequence, head, query tile), walking key tiles from the diagonal
  // backwards as the forward does.
  auto dq_pass = [&]() {
  const int64_t max_q_tiles = (p.seqlen_q + kBlockQ - 1) / kBlockQ;
  parallel_tasks(p.batch * H * max_q_tiles, [&](TaskQueue& tasks) {
    TileGemms<In> gemms(p, packed);
    std::vector<Acc> P(kBlockQ * kBlockK), dP(kBlockQ * kBlockK), dq(kBlockQ * D);
    std::vector<Bias> Rq(kBlockQ), Rk(kBlockK);
    std::vector<Acc> delta(kBlockQ), rowsum(kBlockQ);
    for (int64_t task; tasks.next(task);) {
      QueryTile<In> tile;
      if (!query_tile(p, task, max_q_tiles, tile, Rq.data())) continue;
      const auto& [s, h, i0, nq, anchor, last_pos, hv] = tile;
      const Acc* lse = static_cast<const Acc*>(p.lse) + (s.batch_index * H + h) * p.seqlen_q + s.row_q + i0;
      const Acc* delta_h = delta_buf + (s.batch_index * H + h) * p.seqlen_q + s.row_q + i0;
      for (int64_t r = 0; r < nq; ++r) delta[r] = delta_h[r];
      const In* dout = out_row(p.dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride, s, h);
      gemms.bind(p, s, h, dout, p.do_row_stride);
      std::fill(dq.begin(), dq.begin() + nq * D, Acc(0));
      std::fill(rowsum.begin(), rowsum.end(), Acc(0));

      Bias carry = 0;
      int64_t j1 = last_pos + 1;
      while (j1 > s.first_key) {
        const int64_t j0 = std::max(s.first_key, j1 - kBlockK);
        const int64_t nk = j1 - j0;
        if (key_biases(hv, anchor, j0, j1, Rq.data(), carry, Rk.data()) < p.prune_threshold) break;
        // Rows [0, r0) precede the tile's first key, as in the forward.
        const int64_t r0 = std::clamp<int64_t>(j0 - anchor, 0, nq - 1), m = nq - r0;
        Acc* P_r0 = P.data() + r0 * kBlockK;
        Acc* dP_r0 = dP.data() + r0 * kBlockK;
        gemms.scores(hv.q + (i0 + r0) * hv.ldq, hv.ldq, m, Operand::K, j0, nk, P_r0, kBlockK);
        gemms.scores(dout + (i0 + r0) * p.do_row_stride, p.do_row_stride, m, Operand::V, j0, nk,
                     dP_r0, kBlockK);
        probabilities_and_dscores<Acc>(m, nk, Rq.data() + r0, Rk.data(), scale, anchor + r0, j0,
                                       lse + r0, delta.data() + r0, P_r0, dP_r0, kBlockK);
        gemms.times(dP_r0, kBlockK, m, Operand::K, j0, nk, dq.data() + r0 * D, D);
        for (int64_t r = r0; r < nq; ++r) rowsum[r] += sum_row(dP.data() + r * kBlockK, nk);
        j1 = j0;
      }
      write_dq(s, h, i0, nq, dq.data());
      std::copy_n(rowsum.data(), nq, rowsum_buf + (s.batch_index * H + h) * p.seqlen_q + s.row_q + i0);
    }
    gemms.done();
  });
  };

  // dK, dV and the column sums of dS of one key tile (all heads of its kv group); with dq_acc
  // (group x len_q x D) and rowsum_acc (group x len_q), accumulators of this sequence, it also adds
  // the tile's part of dQ and of the row sums of dS. dK and dV accumulate as D x kBlockK when
  // TileGemms::kGradsTransposed, else kBlockK x D.
  struct TileBuffers {
    TileGemms<In> gemms;
    std::vector<Acc> P, dP, dk, dv;
    std::vector<Bias> Rk, Rq;
    std::vector<Acc> delta, colsum;
    TileBuffers(const ForwardParams& p, const PackedBf16* packed)
        : gemms(p, packed), P(kBlockQ * kBlockK), dP(kBlockQ * kBlockK),
          dk(p.head_dim * kBlockK), dv(p.head_dim * kBlockK), Rk(kBlockK), Rq(kBlockQ),
          delta(kBlockQ), colsum(kBlockK) {}
  };
  auto key_tile = [&](TileBuffers& buf, const SequenceView& s, int64_t hk, int64_t tile,
                      Acc* dq_acc, Acc* rowsum_acc) {
    auto& [gemms, P, dP, dk, dv, Rk, Rq, delta, colsum] = buf;
    const int64_t j0 = tile * kBlockK;
    if (j0 >= s.len_k) return;
    const int64_t nk = std::min(kBlockK, s.len_k - j0);
    const int64_t anchor = j0 + nk - 1;  // last key of the tile
    std::fill(dk.begin(), dk.end(), Acc(0));
    std::fill(dv.begin(), dv.end(), Acc(0));
    const bool visible = anchor >= s.first_key;
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      const HeadView<In> hv = head_view<In>(p, s, h);
      Acc* dc_row = dc + (s.batch_index * H + h) * p.seqlen_k + s.row_k;
      std::fill(colsum.begin(), colsum.begin() + nk, Acc(0));
      if (visible) {
        relative_cumsum(hv.g, hv.g_stride, anchor, j0, anchor + 1, Rk.data());
        const Acc* lse = static_cast<const Acc*>(p.lse) + (s.batch_index * H + h) * p.seqlen_q + s.row_q;
        const Acc* delta_h = delta_buf + (s.batch_index * H + h) * p.seqlen_q + s.row_q;
        const In* dout = out_row(p.dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride, s, h);
        gemms.bind(p, s, h, dout, p.do_row_stride);
        // Query tiles from the first one that sees this key tile; positions of tile queries
        // after the anchor extend the walk forward from it.
        const int64_t offset = s.len_k - s.len_q;
        int64_t i_begin = std::max<int64_t>(0, j0 - offset);
        Bias carry = 0;             // R at the position just before the next query tile
        int64_t carried_to = anchor;  // position that `carry` refers to
        for (int64_t i0 = i_begin; i0 < s.len_q; i0 += kBlockQ) {
          const int64_t nq = std::min(kBlockQ, s.len_q - i0);
          const int64_t q_pos0 = i0 + offset;
          for (int64_t r = 0; r < nq; ++r) {
            const int64_t pos = q_pos0 + r;
            if (pos <= anchor) {
              Rq[r] = Rk[pos - j0];
            } else {
              while (carried_to < pos) {
                ++carried_to;
                carry += static_cast<Bias>(hv.g[carried_to * hv.g_stride]);
              }
              Rq[r] = carry;
            }
          }
          // Largest bias of the pair: first query of the tile against the last key (R = 0).
          if (static_cast<float>(Rq[0]) < p.prune_threshold) break;
          for (int64_t r = 0; r < nq; ++r) delta[r] = delta_h[i0 + r];
          gemms.scores(hv.q + i0 * hv.ldq, hv.ldq, nq, Operand::K, j0, nk, P.data(), kBlockK);
          gemms.scores(dout + i0 * p.do_row_stride, p.do_row_stride, nq, Operand::V, j0, nk,
                       dP.data(), kBlockK);
          probabilities_and_dscores<Acc>(nq, nk, Rq.data(), Rk.data(), scale, q_pos0, j0,
                                         lse + i0, delta.data(), P.data(), dP.data(), kBlockK);
          // first_key masking: keys before it get no probability
          if (j0 < s.first_key) {
            for (int64_t r = 0; r < nq; ++r)
              for (int64_t c = 0; c < std::min(nk, s.first_key - j0); ++c) {
                P[r * kBlockK + c] = 0;
                dP[r * kBlockK + c] = 0;
              }
          }
          gemms.grads_kv(i0, nq, nk, P.data(), dP.data(), kBlockK, dk.data(), dv.data());
          for (int64_t r = 0; r < nq; ++r) add_row(colsum.data(), dP.data() + r * kBlockK, nk);
          if (dq_acc != nullptr) {
            const int64_t row = (h - hk * group) * s.len_q + i0;
            gemms.times(dP.data(), kBlockK, nq, Operand::K, j0, nk, dq_acc + row * D, D);
            for (int64_t r = 0; r < nq; ++r)
              rowsum_acc[row + r] += sum_row(dP.data() + r * kBlockK, nk);
          }
        }
      }
      for (int64_t c = 0; c < nk; ++c) dc_row[j0 + c] = -colsum[c];
    }
    In* dk_out = static_cast<In*>(p.dk) + s.batch_index * p.dk_batch_stride +
                 (s.row_k + j0) * p.dk_row_stride + hk * p.dk_head_stride;
    In* dv_out = static_cast<In*>(p.dv) + s.batch_index * p.dv_batch_stride +
                 (s.row_k + j0) * p.dv_row_stride + hk * p.dv_head_stride;
    for (int64_t c = 0; c < nk; ++c)
      for (int64_t d = 0; d < D; ++d) {
        const int64_t at = TileGemms<In>::kGradsTransposed ? d * kBlockK + c : c * D + d;
        dk_out[c * p.dk_row_stride + d] = static_cast<In>(dk[at] * scale);
        dv_out[c * p.dv_row_stride + d] = static_cast<In>(dv[at]);
      }
  };

  const int64_t max_k_tiles = (p.seqlen_k + kBlockK - 1) / kBlockK;
  if (p.batch * Hkv >= at::get_num_threads()) {
    // Enough (sequence, kv head) pairs to fill the cores: one pass per pair, dQ accumulated in a
    // float buffer of the pair (group x len_q x D), visiting key tiles in order (deterministic).
    parallel_tasks(p.batch * Hkv, [&](TaskQueue& tasks) {
      TileBuffers buf(p, packed);
      std::vector<Acc> dq_acc, rowsum_acc;
      for (int64_t task; tasks.next(task);) {
        const int64_t hk = task % Hkv;
        const SequenceView s = p.sequence(task / Hkv);
        dq_acc.assign(group * s.len_q * D, Acc(0));
        rowsum_acc.assign(group * s.len_q, Acc(0));
        for (int64_t tile = 0; tile * kBlockK < s.len_k; ++tile)
          key_tile(buf, s, hk, tile, dq_acc.data(), rowsum_acc.data());
        for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
          const int64_t local = h - hk * group;
          write_dq(s, h, 0, s.len_q, dq_acc.data() + local * s.len_q * D);
          std::copy_n(rowsum_acc.data() + local * s.len_q, s.len_q,
                      rowsum_buf + (s.batch_index * H + h) * p.seqlen_q + s.row_q);
        }
      }
      buf.gemms.done();
    });
  } else {
    // Few pairs: spread the key tiles over the cores, then compute dQ in a second pass.
    // Key tiles in order: the first ones see the most query tiles, so the cheapest come last.
    parallel_tasks(p.batch * Hkv * max_k_tiles, [&](TaskQueue& tasks) {
      TileBuffers buf(p, packed);
      for (int64_t task; tasks.next(task);) {
        const int64_t pair = task % (p.batch * Hkv);
        key_tile(buf, p.sequence(pair / Hkv), pair % Hkv, task / (p.batch * Hkv), nullptr, nullptr);
      }
      buf.gemms.done();
    });
    dq_pass();
  }
  // dlog_fgate_t = sum_{u >= t} dc_u with dc_u = rowsum_u(dS) - colsum_u(dS), accumulated in
  // float64. The row sums vanish in exact arithmetic, but not for a saved O rounded to bf16/fp16
  // (delta = dO.O then misses dO.(O - round(O))), and the reverse cumsum would add that error up.
  parallel_tasks(p.batch * H, [&](TaskQueue& tasks) {
    for (int64_t bh; tasks.next(bh);) {
      const SequenceView s = p.sequence(bh / H);
      const int64_t h = bh % H;
      const Acc* dc_row = dc + (s.batch_index * H + h) * p.seqlen_k + s.row_k;
      const Acc* rowsum_row = rowsum_buf + (s.batch_index * H + h) * p.seqlen_q + s.row_q;
      const int64_t offset = s.len_k - s.len_q;
      Acc* dg = static_cast<Acc*>(p.dlog_fgate) + s.batch_index * p.dg_batch_stride +
                s.row_k * p.dg_row_stride + h * p.dg_head_stride;
      double run = 0;
      for (int64_t t = s.len_k - 1; t >= 0; --t) {
        run += dc_row[t];
        if (t >= offset) run += rowsum_row[t - offset];
        dg[t * p.dg_row_stride] = static_cast<Acc>(run);
      }
    }
  });
}

}  // namespace fox::cpu
