// Per-element math of the window attention family, shared by the CPU loops and the CUDA kernels so both
// devices compute exactly the same expression. Layouts (all contiguous): q (Nq,h,d), k/v (Nk,h,d),
// tables (L,3,h,d), rel_idx (M,3), pair tensors (M,h). Accumulation in A = at::opmath_type<T>.
//
// Every index is bounds-checked before use; an out-of-range pair contributes nothing. The Python wrappers
// reject such input with a clear error first, so this only guarantees "never an illegal memory access".
#pragma once
#include <sptr/views.h>

namespace sptr {

template <typename T>
struct PairLogitArgs {
  const T* q = nullptr;
  const T* k = nullptr;
  const T* table_q = nullptr;  // null: no query-table term
  const T* table_k = nullptr;  // null: no key-table term
  IntView index_0, index_1, rel;
  int64_t num_q = 0, num_k = 0, num_pairs = 0, L = 0, h = 0, d = 0;
  bool with_qk = true;
};

template <typename T>
struct AggregateArgs {
  const T* attn = nullptr;     // (M,h)
  const T* v = nullptr;        // (Nk,h,d)
  const T* table_v = nullptr;  // null: no value-table term
  IntView offsets, index_0, index_1, rel;
  int64_t num_out = 0, num_v = 0, num_pairs = 0, L = 0, h = 0, d = 0;
};

// Start of row (l, a, head) in a (L,3,h,d) table, or -1 when rel is out of range.
SPTR_HD int64_t table_row(IntView rel, int64_t m, int a, int64_t head, int64_t L, int64_t h, int64_t d) {
  const int64_t l = rel[m * 3 + a];
  return (l < 0 || l >= L) ? -1 : ((l * 3 + a) * h + head) * d;
}

// The three table rows of pair m for one head; false if any rel entry is out of range.
SPTR_HD bool table_rows(IntView rel, int64_t m, int64_t head, int64_t L, int64_t h, int64_t d, int64_t rows[3]) {
  bool ok = true;
  for (int a = 0; a < 3; ++a) {
    rows[a] = table_row(rel, m, a, head, L, h, d);
    ok = ok && rows[a] >= 0;
  }
  return ok;
}

template <typename A, typename T>
SPTR_HD A table_sum(const T* table, const int64_t rows[3], int64_t c) {
  return A(table[rows[0] + c]) + A(table[rows[1] + c]) + A(table[rows[2] + c]);
}

template <typename T>
SPTR_HD bool pair_ends(const PairLogitArgs<T>& p, int64_t m, int64_t& i, int64_t& j) {
  i = p.index_0[m];
  j = p.index_1[m];
  return i >= 0 && i < p.num_q && j >= 0 && j < p.num_k;
}

// logits[m, head] = with_qk*<q_i,k_j> + <q_i, E_Tq[m]> + <k_j, E_Tk[m]>
template <typename A, typename T>
SPTR_HD A pair_logit(const PairLogitArgs<T>& p, int64_t m, int64_t head) {
  int64_t i, j, rows[3] = {0, 0, 0};
  if (!pair_ends(p, m, i, j)) return A(0);
  const bool tables = p.table_q || p.table_k;
  if (tables && !table_rows(p.rel, m, head, p.L, p.h, p.d, rows)) return A(0);
  const T* qi = p.q + (i * p.h + head) * p.d;
  const T* kj = p.k + (j * p.h + head) * p.d;
  A s = A(0);
  for (int64_t c = 0; c < p.d; ++c) {
    const A qv = A(qi[c]), kv = A(kj[c]);
    if (p.with_qk) s += qv * kv;
    if (p.table_q) s += qv * table_sum<A>(p.table_q, rows, c);
    if (p.table_k) s += kv * table_sum<A>(p.table_k, rows, c);
  }
  return s;
}

// Contributions of grad[m, head] to element c of dq, dk and the table gradients. `Acc` receives
// (flat offset, value) for each target; CPU adds serially, CUDA adds atomically.
template <typename A, typename T, typename Acc>
SPTR_HD void pair_logit_backward(const PairLogitArgs<T>& p, const T* grad, int64_t m, int64_t head, int64_t c,
                                 Acc& acc) {
  int64_t i, j, rows[3] = {0, 0, 0};
  if (!pair_ends(p, m, i, j)) return;
  const bool tables = p.table_q || p.table_k;
  if (tables && !table_rows(p.rel, m, head, p.L, p.h, p.d, rows)) return;
  const A g = A(grad[m * p.h + head]);
  const A qv = A(p.q[(i * p.h + head) * p.d + c]);
  const A kv = A(p.k[(j * p.h + head) * p.d + c]);
  A to_q = p.with_qk ? kv : A(0);
  A to_k = p.with_qk ? qv : A(0);
  if (p.table_q) to_q += table_sum<A>(p.table_q, rows, c);
  if (p.table_k) to_k += table_sum<A>(p.table_k, rows, c);
  acc.q((i * p.h + head) * p.d + c, g * to_q);
  acc.k((j * p.h + head) * p.d + c, g * to_k);
  for (int a = 0; a < 3; ++a) {
    if (p.table_q) acc.table_q(rows[a] + c, g * qv);
    if (p.table_k) acc.table_k(rows[a] + c, g * kv);
  }
}

// [offsets[row], offsets[row + 1]) clamped to [0, total]: malformed offsets never index out of bounds.
SPTR_HD void clamped_range(IntView offsets, int64_t row, int64_t total, int64_t& begin, int64_t& end) {
  begin = offsets[row];
  end = offsets[row + 1];
  begin = begin < 0 ? 0 : (begin > total ? total : begin);
  end = end < begin ? begin : (end > total ? total : end);
}

template <typename T>
SPTR_HD void row_range(const AggregateArgs<T>& p, int64_t row, int64_t& begin, int64_t& end) {
  clamped_range(p.offsets, row, p.num_pairs, begin, end);
}

// out[row, head, c] = sum over pairs m of the row of attn[m, head] * (v[j(m), head, c] + E_Tv[m, head, c])
template <typename A, typename T>
SPTR_HD A aggregate_element(const AggregateArgs<T>& p, int64_t row, int64_t head, int64_t c) {
  int64_t begin, end, rows[3] = {0, 0, 0};
  row_range(p, row, begin, end);
  A s = A(0);
  for (int64_t m = begin; m < end; ++m) {
    const int64_t j = p.index_1[m];
    if (j < 0 || j >= p.num_v) continue;
    if (p.table_v && !table_rows(p.rel, m, head, p.L, p.h, p.d, rows)) continue;
    A val = A(p.v[(j * p.h + head) * p.d + c]);
    if (p.table_v) val += table_sum<A>(p.table_v, rows, c);
    s += A(p.attn[m * p.h + head]) * val;
  }
  return s;
}

template <typename T>
SPTR_HD bool aggregate_pair(const AggregateArgs<T>& p, int64_t m, int64_t head, int64_t& i, int64_t& j,
                            int64_t rows[3]) {
  i = p.index_0[m];
  j = p.index_1[m];
  if (i < 0 || i >= p.num_out || j < 0 || j >= p.num_v) return false;
  return !p.table_v || table_rows(p.rel, m, head, p.L, p.h, p.d, rows);
}

// dattn[m, head] = <grad[i(m), head], v[j(m), head] + E_Tv[m, head]>
template <typename A, typename T>
SPTR_HD A aggregate_attn_grad(const AggregateArgs<T>& p, const T* grad, int64_t m, int64_t head) {
  int64_t i, j, rows[3] = {0, 0, 0};
  if (!aggregate_pair(p, m, head, i, j, rows)) return A(0);
  A s = A(0);
  for (int64_t c = 0; c < p.d; ++c) {
    A val = A(p.v[(j * p.h + head) * p.d + c]);
    if (p.table_v) val += table_sum<A>(p.table_v, rows, c);
    s += A(grad[(i * p.h + head) * p.d + c]) * val;
  }
  return s;
}

// Contributions of pair m to element c of dv and of the value-table gradient.
template <typename A, typename T, typename Acc>
SPTR_HD void aggregate_backward(const AggregateArgs<T>& p, const T* grad, int64_t m, int64_t head, int64_t c,
                                Acc& acc) {
  int64_t i, j, rows[3] = {0, 0, 0};
  if (!aggregate_pair(p, m, head, i, j, rows)) return;
  const A w = A(p.attn[m * p.h + head]) * A(grad[(i * p.h + head) * p.d + c]);
  acc.v((j * p.h + head) * p.d + c, w);
  if (p.table_v)
    for (int a = 0; a < 3; ++a) acc.table_v(rows[a] + c, w);
}

}  // namespace sptr

namespace sptr {

// Gradient sinks: where the scatter-style backward contributions go. `Add::add(base, offset, value)` is a
// plain += on the CPU and an atomicAdd on CUDA (global or shared memory).
template <typename A, typename Add>
struct LogitGradSink {
  A *dq, *dk, *dtable_q, *dtable_k;
  SPTR_HD void q(int64_t o, A v) { Add::add(dq, o, v); }
  SPTR_HD void k(int64_t o, A v) { Add::add(dk, o, v); }
  SPTR_HD void table_q(int64_t o, A v) { Add::add(dtable_q, o, v); }
  SPTR_HD void table_k(int64_t o, A v) { Add::add(dtable_k, o, v); }
};

template <typename A, typename Add>
struct AggregateGradSink {
  A *dv, *dtable_v;
  SPTR_HD void v(int64_t o, A x) { Add::add(dv, o, x); }
  SPTR_HD void table_v(int64_t o, A x) { Add::add(dtable_v, o, x); }
};

SPTR_HD float exp_of(float x) { return ::expf(x); }
SPTR_HD double exp_of(double x) { return ::exp(x); }

// Numerically stable softmax of src[begin:end, head] (a CSR segment of an (M,h) tensor).
template <typename A, typename T>
SPTR_HD void segment_softmax(const T* src, T* out, int64_t begin, int64_t end, int64_t h, int64_t head) {
  if (begin >= end) return;
  A mx = A(src[begin * h + head]);
  for (int64_t m = begin + 1; m < end; ++m) {
    const A x = A(src[m * h + head]);
    mx = x > mx ? x : mx;
  }
  A total = A(0);
  for (int64_t m = begin; m < end; ++m) total += exp_of(A(src[m * h + head]) - mx);
  for (int64_t m = begin; m < end; ++m) out[m * h + head] = T(exp_of(A(src[m * h + head]) - mx) / total);
}

// Item e = (segment e / h, head e % h) of the CSR softmax over an (M, h) tensor.
template <typename A, typename T>
SPTR_HD void softmax_item(const T* src, T* out, IntView indptr, int64_t M, int64_t h, int64_t e) {
  int64_t begin, end;
  clamped_range(indptr, e / h, M, begin, end);
  segment_softmax<A>(src, out, begin, end, h, e % h);
}

// dsrc = y * (grad - sum(grad * y)) over the segment.
template <typename A, typename T>
SPTR_HD void segment_softmax_backward(const T* grad, const T* y, T* dsrc, int64_t begin, int64_t end, int64_t h,
                                      int64_t head) {
  A dot = A(0);
  for (int64_t m = begin; m < end; ++m) dot += A(grad[m * h + head]) * A(y[m * h + head]);
  for (int64_t m = begin; m < end; ++m) dsrc[m * h + head] = T(A(y[m * h + head]) * (A(grad[m * h + head]) - dot));
}

template <typename A, typename T>
SPTR_HD void softmax_backward_item(const T* grad, const T* y, T* dsrc, IntView indptr, int64_t M, int64_t h,
                                   int64_t e) {
  int64_t begin, end;
  clamped_range(indptr, e / h, M, begin, end);
  segment_softmax_backward<A>(grad, y, dsrc, begin, end, h, e % h);
}

}  // namespace sptr
