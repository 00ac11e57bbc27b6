// CPU kernels of the fused window attention: one window at a time, one query (or key) row at a time, with
// the pair logits recomputed in the backward instead of stored. Deterministic: rows are owned by their
// window, and table gradients are summed over a fixed partition of the windows in a fixed order.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sptr/dispatch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "fused_window_attention_host.h"

namespace sptr {
namespace {

// One head of one window: the pair logit and the per-token table products it gathers from.
template <typename T>
struct WindowHead {
  using A = at::opmath_type<T>;
  const FusedOperands& o;
  RelPosParams rel;
  int64_t lo, n, h, H, d, L3;
  A scale;
  const T *q, *k, *v, *tq, *tk, *tv;
  std::vector<A> qt, kt, gt;  // (n, 3L): q_i·Tq[r], k_j·Tk[r], dO_i·Tv[r]

  WindowHead(const FusedOperands& o_, int64_t lo_, int64_t hi_, int64_t h_, double scale_)
      : o(o_), rel(o_.rel_params()), lo(lo_), n(hi_ - lo_), h(h_), H(o_.H), d(o_.d), L3(3 * o_.L),
        scale(static_cast<A>(scale_)), q(o_.q.const_data_ptr<T>()), k(o_.k.const_data_ptr<T>()),
        v(o_.v.const_data_ptr<T>()), tq(ptr(o_.table_q)), tk(ptr(o_.table_k)), tv(ptr(o_.table_v)) {
    if (tq) table_products(qt, q, tq);
    if (tk) table_products(kt, k, tk);
  }

  static const T* ptr(const at::Tensor& t) { return t.defined() ? t.const_data_ptr<T>() : nullptr; }
  const T* row(const T* x, int64_t local) const { return x + ((lo + local) * H + h) * d; }
  const T* table_row(const T* t, int64_t r) const { return t + (r * H + h) * d; }

  A dot(const T* x, const T* y) const {
    A s = 0;
    for (int64_t c = 0; c < d; ++c) s += static_cast<A>(x[c]) * static_cast<A>(y[c]);
    return s;
  }

  void table_products(std::vector<A>& dst, const T* x, const T* table) {
    dst.assign(n * L3, A(0));
    for (int64_t i = 0; i < n; ++i)
      for (int64_t r = 0; r < L3; ++r) dst[i * L3 + r] = dot(row(x, i), table_row(table, r));
  }

  void rows_of_pair(int64_t i, int64_t j, int out[3]) const {
    const int32_t* ci = rel.coords + (lo + i) * 3;
    const int32_t* cj = rel.coords + (lo + j) * 3;
    const float ri = rel.radius ? rel.radius[lo + i] : 0.f, rj = rel.radius ? rel.radius[lo + j] : 0.f;
    for (int a = 0; a < 3; ++a) out[a] = rel_row(rel, ci, cj, ri, rj, a);
  }

  A logit(int64_t i, int64_t j, const int rows[3]) const {
    A qside = dot(row(q, i), row(k, j)), kside = 0;
    for (int a = 0; a < 3 && o.has_rel(); ++a) {
      if (tq) qside += qt[i * L3 + rows[a]];
      if (tk) kside += kt[j * L3 + rows[a]];
    }
    return scale * qside + kside;
  }

  void pair_rows(int64_t i, int64_t j, int rows[3]) const {
    if (o.has_rel()) rows_of_pair(i, j, rows);
  }
};

// Window w's tokens, clamped into [0, N] (memory safety without the Python-side value checks).
std::pair<int64_t, int64_t> window_range(const int32_t* offsets, int64_t w, int64_t N) {
  const int64_t lo = std::clamp<int64_t>(offsets[w], 0, N);
  return {lo, std::clamp<int64_t>(offsets[w + 1], lo, N)};
}

template <typename T>
void fused_fwd_kernel(const FusedOperands& o, double scale, at::Tensor& out, at::Tensor& lse) {
  using A = at::opmath_type<T>;
  const int32_t* offsets = o.offsets.const_data_ptr<int32_t>();
  T* out_p = out.data_ptr<T>();
  A* lse_p = lse.data_ptr<A>();
  const int64_t H = o.H, d = o.d, L3 = 3 * o.L;
  at::parallel_for(0, o.W, 1, [&](int64_t wb, int64_t we) {
    std::vector<A> s, acc(d), hist(L3);
    std::vector<int> rows;
    for (int64_t w = wb; w < we; ++w) {
      const auto [lo, hi] = window_range(offsets, w, o.N);
      const int64_t n = hi - lo;
      if (n <= 0) continue;
      s.resize(n);
      rows.resize(n * 3);
      for (int64_t h = 0; h < H; ++h) {
        WindowHead<T> wh(o, lo, hi, h, scale);
        for (int64_t i = 0; i < n; ++i) {
          A m = -std::numeric_limits<A>::infinity();
          for (int64_t j = 0; j < n; ++j) {
            wh.pair_rows(i, j, &rows[j * 3]);
            s[j] = wh.logit(i, j, &rows[j * 3]);
            m = std::max(m, s[j]);
          }
          A l = 0;
          for (int64_t j = 0; j < n; ++j) l += std::exp(s[j] - m);
          const A lse_i = m + std::log(l);
          std::fill(acc.begin(), acc.end(), A(0));
          std::fill(hist.begin(), hist.end(), A(0));
          for (int64_t j = 0; j < n; ++j) {
            const A p = std::exp(s[j] - lse_i);
            const T* vj = wh.row(wh.v, j);
            for (int64_t c = 0; c < d; ++c) acc[c] += p * static_cast<A>(vj[c]);
            if (wh.tv)
              for (int a = 0; a < 3; ++a) hist[rows[j * 3 + a]] += p;
          }
          if (wh.tv)
            for (int64_t r = 0; r < L3; ++r) {
              if (hist[r] == A(0)) continue;
              const T* t = wh.table_row(wh.tv, r);
              for (int64_t c = 0; c < d; ++c) acc[c] += hist[r] * static_cast<A>(t[c]);
            }
          T* dst = out_p + ((lo + i) * H + h) * d;
          for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<T>(acc[c]);
          lse_p[(lo + i) * H + h] = lse_i;
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> window_attention_fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& offsets,
    const std::optional<at::Tensor>& coords, const std::optional<at::Tensor>& radius,
    const std::optional<at::Tensor>& table_q, const std::optional<at::Tensor>& table_k,
    const std::optional<at::Tensor>& table_v, int64_t rel_shift, double radial_a, double scale,
    bool /*deterministic: used by the backward*/) {
  FusedOperands o(q, k, v, offsets, coords, radius, table_q, table_k, table_v, rel_shift, radial_a);
  at::Tensor out = at::zeros_like(o.q);
  at::Tensor lse = at::zeros({o.N, o.H}, o.q.options().dtype(at::toOpMathType(o.q.scalar_type())));
  SPTR_DISPATCH_FLOATING(o.q.scalar_type(), "window_attention_fwd_cpu",
                         [&] { fused_fwd_kernel<scalar_t>(o, scale, out, lse); });
  return {out, lse};
}

// Table gradients of one fixed group of windows; groups are summed in order afterwards.
template <typename A>
struct TableGrads {
  std::vector<A> q, k, v;
};

template <typename T>
void fused_bwd_kernel(const FusedOperands& o, const at::Tensor& grad, const at::Tensor& out, const at::Tensor& lse,
                      double scale, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, at::Tensor& dtq, at::Tensor& dtk,
                      at::Tensor& dtv) {
  using A = at::opmath_type<T>;
  const int32_t* offsets = o.offsets.const_data_ptr<int32_t>();
  const T* go = grad.const_data_ptr<T>();
  const T* op = out.const_data_ptr<T>();
  const A* lse_p = lse.const_data_ptr<A>();
  T *dq_p = dq.data_ptr<T>(), *dk_p = dk.data_ptr<T>(), *dv_p = dv.data_ptr<T>();
  const int64_t H = o.H, d = o.d, L3 = 3 * o.L, tsize = L3 * H * d;
  const A sc = static_cast<A>(scale);

  std::vector<A> delta(o.N * H);
  at::parallel_for(0, o.N * H, 1024, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      A s = 0;
      for (int64_t c = 0; c < d; ++c) s += static_cast<A>(go[r * d + c]) * static_cast<A>(op[r * d + c]);
      delta[r] = s;
    }
  });

  const int64_t groups = std::min<int64_t>(o.W, 64);
  std::vector<TableGrads<A>> partial(groups);
  at::parallel_for(0, groups, 1, [&](int64_t gb, int64_t ge) {
    std::vector<A> acc(d), acc2(d), hq(L3), hk(L3), hv(L3);
    for (int64_t g = gb; g < ge; ++g) {
      TableGrads<A>& tg = partial[g];
      if (o.table_q.defined()) tg.q.assign(tsize, A(0));
      if (o.table_k.defined()) tg.k.assign(tsize, A(0));
      if (o.table_v.defined()) tg.v.assign(tsize, A(0));
      for (int64_t w = g * o.W / groups; w < (g + 1) * o.W / groups; ++w) {
        const auto [lo, hi] = window_range(offsets, w, o.N);
        const int64_t n = hi - lo;
        if (n <= 0) continue;
        for (int64_t h = 0; h < H; ++h) {
          WindowHead<T> wh(o, lo, hi, h, scale);
          const T* gq = go + h * d;  // row i of head h: gq + (lo + i)·H·d
          auto grow = [&](int64_t i) { return gq + (lo + i) * H * d; };
          if (wh.tv) wh.table_products(wh.gt, go, wh.tv);
          // P and dS of pair (i, j), recomputed where needed (no n x n buffer, so windows of any size fit).
          auto pair = [&](int64_t i, int64_t j, int rr[3], A& pij, A& dsij) {
            wh.pair_rows(i, j, rr);
            pij = std::exp(wh.logit(i, j, rr) - lse_p[(lo + i) * H + h]);
            A dp = wh.dot(grow(i), wh.row(wh.v, j));
            if (wh.tv)
              for (int a = 0; a < 3; ++a) dp += wh.gt[i * L3 + rr[a]];
            dsij = pij * (dp - delta[(lo + i) * H + h]);
          };
          for (int64_t i = 0; i < n; ++i) {  // query rows: dq, dTq, dTv
            std::fill(acc.begin(), acc.end(), A(0));
            std::fill(hq.begin(), hq.end(), A(0));
            std::fill(hv.begin(), hv.end(), A(0));
            for (int64_t j = 0; j < n; ++j) {
              int rr[3] = {0, 0, 0};
              A pij, g;
              pair(i, j, rr, pij, g);
              const T* kj = wh.row(wh.k, j);
              for (int64_t c = 0; c < d; ++c) acc[c] += g * static_cast<A>(kj[c]);
              for (int a = 0; a < 3 && o.has_rel(); ++a) {
                hq[rr[a]] += g;
                hv[rr[a]] += pij;
              }
            }
            const T* qi = wh.row(wh.q, i);
            for (int64_t r = 0; r < L3; ++r) {
              for (int64_t c = 0; c < d; ++c) {
                if (wh.tq) {
                  acc[c] += hq[r] * static_cast<A>(wh.table_row(wh.tq, r)[c]);
                  tg.q[(r * H + h) * d + c] += sc * hq[r] * static_cast<A>(qi[c]);
                }
                if (wh.tv) tg.v[(r * H + h) * d + c] += hv[r] * static_cast<A>(grow(i)[c]);
              }
            }
            T* dst = dq_p + ((lo + i) * H + h) * d;
            for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<T>(sc * acc[c]);
          }
          for (int64_t j = 0; j < n; ++j) {  // key rows: dk, dv, dTk
            std::fill(acc.begin(), acc.end(), A(0));
            std::fill(acc2.begin(), acc2.end(), A(0));
            std::fill(hk.begin(), hk.end(), A(0));
            for (int64_t i = 0; i < n; ++i) {
              int rr[3] = {0, 0, 0};
              A pij, g;
              pair(i, j, rr, pij, g);
              const T* qi = wh.row(wh.q, i);
              const T* gi = grow(i);
              for (int64_t c = 0; c < d; ++c) {
                acc[c] += sc * g * static_cast<A>(qi[c]);
                acc2[c] += pij * static_cast<A>(gi[c]);
              }
              for (int a = 0; a < 3 && wh.tk; ++a) hk[rr[a]] += g;
            }
            const T* kj = wh.row(wh.k, j);
            for (int64_t r = 0; r < L3 && wh.tk; ++r) {
              for (int64_t c = 0; c < d; ++c) {
                acc[c] += hk[r] * static_cast<A>(wh.table_row(wh.tk, r)[c]);
                tg.k[(r * H + h) * d + c] += hk[r] * static_cast<A>(kj[c]);
              }
            }
            T* dk_dst = dk_p + ((lo + j) * H + h) * d;
            T* dv_dst = dv_p + ((lo + j) * H + h) * d;
            for (int64_t c = 0; c < d; ++c) {
              dk_dst[c] = static_cast<T>(acc[c]);
              dv_dst[c] = static_cast<T>(acc2[c]);
            }
          }
        }
      }
    }
  });
  auto reduce = [&](at::Tensor& dst, std::vector<A> TableGrads<A>::*member) {
    if (!dst.numel()) return;
    A* out_p = dst.data_ptr<A>();
    for (const TableGrads<A>& tg : partial)
      for (int64_t e = 0; e < tsize; ++e) out_p[e] += (tg.*member)[e];
  };
  reduce(dtq, &TableGrads<A>::q);
  reduce(dtk, &TableGrads<A>::k);
  reduce(dtv, &TableGrads<A>::v);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> window_attention_bwd_cpu(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& offsets, const std::optional<at::Tensor>& coords,
    const std::optional<at::Tensor>& radius, const std::optional<at::Tensor>& table_q,
    const std::optional<at::Tensor>& table_k, const std::optional<at::Tensor>& table_v, int64_t rel_shift,
    double radial_a, double scale, bool deterministic) {
  (void)deterministic;  // the CPU kernel always is
  FusedOperands o(q, k, v, offsets, coords, radius, table_q, table_k, table_v, rel_shift, radial_a);
  check_backward_operands(o, grad, out, lse);
  const at::Tensor g = grad.contiguous(), oc = out.contiguous(), lc = lse.contiguous();
  at::Tensor dq = at::zeros_like(o.q), dk = at::zeros_like(o.k), dv = at::zeros_like(o.v);
  at::Tensor dtq = o.table_grad_buffer(o.table_q), dtk = o.table_grad_buffer(o.table_k),
             dtv = o.table_grad_buffer(o.table_v);
  SPTR_DISPATCH_FLOATING(o.q.scalar_type(), "window_attention_bwd_cpu", [&] {
    fused_bwd_kernel<scalar_t>(o, g, oc, lc, scale, dq, dk, dv, dtq, dtk, dtv);
  });
  return {dq, dk, dv, table_grad_result(dtq, o.table_q), table_grad_result(dtk, o.table_k),
          table_grad_result(dtv, o.table_v)};
}

}  // namespace

TORCH_LIBRARY_IMPL(sptr, CPU, m) {
  m.impl("window_attention_fwd", &window_attention_fwd_cpu);
  m.impl("window_attention_bwd", &window_attention_bwd_cpu);
}

}  // namespace sptr
