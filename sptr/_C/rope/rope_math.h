// Multimodal RoPE element math shared by the CPU and CUDA kernels.
//
// Each work item owns one rotation pair (d, d + D/2) of one (batch, head, position), so reading both inputs
// before writing makes true in-place operation (out == x) safe. The arithmetic reproduces transformers'
// eager expression `x * cos + rotate_half(x) * sin` evaluated in x's dtype: each product and the sum are
// rounded to T (fp32 products of fp16/bf16 operands are exact, so this equals PyTorch's own rounding), with
// no fused multiply-add. The backward is the matching transpose, rounded the way autograd rounds it.
//
// Two roundings of the tables: R = T casts cos/sin to x's dtype first (transformers' low-precision models);
// R = float keeps fp32 tables as they are, for type promotion (autocast: fp16/bf16 x with fp32 tables gives an
// fp32 result, O = float; its backward takes the fp32 gradient and rounds each product to x's dtype, O = T).
#pragma once
#include <ATen/OpMathType.h>
#include <type_traits>
#include <sptr/views.h>

namespace sptr {

// Both operands (0: q, 1: k) of one call. Work item = (b, s, group of V rotation pairs): it loads cos/sin of
// its pairs once and rotates them for every q and k head.
template <typename T, typename C, typename O = T, typename R = T>
struct RopeArgs {
  const T* x[2] = {nullptr, nullptr};
  O* out[2] = {nullptr, nullptr};
  int64_t x_stride[2][4] = {};    // [B, H, S, D]
  int64_t out_stride[2][4] = {};
  int64_t heads[2] = {0, 0};
  const C* cos = nullptr;
  const C* sin = nullptr;
  int64_t cs_stride[4] = {0, 0, 0, 0};   // [stream, B, S, D]; stream stride 0 for composed tables
  int64_t B = 0, S = 0, D = 0;
  int64_t c1 = 0, c2 = 0;                // section ends (half-dim units): streams [0,c1), [c1,c2), [c2,D/2)
  bool hf_layout = true, composed = false, backward = false;
  bool table_vector = false;             // cos/sin rows allow V-wide aligned loads
};

// Products and sums rounded as written: no fused multiply-add, which would change the rounding.
template <typename A>
SPTR_HD A mul_rn(A a, A b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<A, double>) return __dmul_rn(a, b);
  else return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

template <typename A>
SPTR_HD A add_rn(A a, A b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<A, double>) return __dadd_rn(a, b);
  else return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// Table stream of dim d (0 <= d < D); no division (64-bit division is a long subroutine on the GPU).
template <class Args>
SPTR_HD int64_t rope_stream(const Args& p, int64_t d) {
  if (p.composed) return 0;
  const int64_t half = p.D / 2;
  const int64_t j = p.hf_layout ? (d < half ? d : d - half) : d >> 1;  // Wall-X: doubled sections over contiguous dims
  return j < p.c1 ? 0 : (j < p.c2 ? 1 : 2);
}

template <typename T, typename A>
SPTR_HD A round_to(A v) {
  return static_cast<A>(static_cast<T>(v));
}

// V consecutive elements, aligned to their size (the launcher checks pointers and strides before using V > 1).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// cos or sin of dims [d, d + V) at row offset `cb`, as stored (C): one vector load when the V dims share a
// stream and the table allows it, else per-element loads.
template <int V, typename T, typename C, typename O, typename R>
SPTR_HD void load_table(const RopeArgs<T, C, O, R>& p, const C* table, int64_t cb, int64_t d, Pack<C, V>& out) {
  const int64_t first = rope_stream(p, d);
  if (V > 1 && p.table_vector && first == rope_stream(p, d + V - 1)) {
    out = *reinterpret_cast<const Pack<C, V>*>(table + first * p.cs_stride[0] + cb + d);
    return;
  }
  for (int v = 0; v < V; ++v) out.v[v] = table[rope_stream(p, d + v) * p.cs_stride[0] + cb + (d + v) * p.cs_stride[3]];
}

// cos/sin of rotation pairs [j0, j0 + V) at position (b, s), both halves, as stored: loaded once and reused
// for every q and k head of that position (kept in C, not widened, so they take few registers).
template <int V, typename C>
struct PairTables {
  Pack<C, V> c0, s0, c1, s1;
};

template <int V, typename T, typename C, typename O, typename R>
SPTR_HD PairTables<V, C> load_pair_tables(const RopeArgs<T, C, O, R>& p, int64_t b, int64_t s, int64_t j0) {
  const int64_t cb = b * p.cs_stride[1] + s * p.cs_stride[2];
  PairTables<V, C> tab;
  load_table<V>(p, p.cos, cb, j0, tab.c0);
  load_table<V>(p, p.sin, cb, j0, tab.s0);
  load_table<V>(p, p.cos, cb, j0 + p.D / 2, tab.c1);
  load_table<V>(p, p.sin, cb, j0 + p.D / 2, tab.s1);
  return tab;
}

// A table value rounded to R, in the arithmetic type A.
template <typename R, typename A, typename C>
SPTR_HD A table_value(C c) {
  if constexpr (std::is_same_v<C, R>) return A(c);
  else return round_to<R>(A(c));
}

// Pairs [j0, j0 + V) of one row of operand t (0: q, 1: k): x (or out) + the (b, h, s) offset.
template <int V, typename T>
struct PairRow {
  Pack<T, V> lo, hi;
};

template <int V, typename T>
SPTR_HD PairRow<V, T> load_pairs(const T* x, int64_t step, int64_t j0, int64_t half) {
  PairRow<V, T> r;
  if (V > 1) {
    r.lo = *reinterpret_cast<const Pack<T, V>*>(x + j0);
    r.hi = *reinterpret_cast<const Pack<T, V>*>(x + j0 + half);
  } else {
    r.lo.v[0] = x[j0 * step];
    r.hi.v[0] = x[(j0 + half) * step];
  }
  return r;
}

// Rotates the loaded pairs and stores them. Products and the sum are rounded to the output dtype O (x's
// dtype, or the promoted one).
template <typename R, int V, typename T, typename O, typename C, typename A = at::opmath_type<T>>
SPTR_HD void rotate_store(const PairRow<V, T>& in, const PairTables<V, C>& tab, bool backward, O* out,
                          int64_t step, int64_t j0, int64_t half) {
  Pack<O, V> olo, ohi;
  for (int v = 0; v < V; ++v) {
    const A a = A(in.lo.v[v]), z = A(in.hi.v[v]);
    const A c0 = table_value<R, A>(tab.c0.v[v]), s0 = table_value<R, A>(tab.s0.v[v]);
    const A c1 = table_value<R, A>(tab.c1.v[v]), s1 = table_value<R, A>(tab.s1.v[v]);
    A o0, o1;
    if (!backward) {  // out = x*cos + rotate_half(x)*sin, rotate_half(x) = (-x2, x1)
      o0 = add_rn(round_to<O>(mul_rn(a, c0)), round_to<O>(mul_rn(-z, s0)));
      o1 = add_rn(round_to<O>(mul_rn(z, c1)), round_to<O>(mul_rn(a, s1)));
    } else {          // gx = g*cos + rotate_half^T(g*sin), rotate_half^T(y) = (y2, -y1)
      o0 = add_rn(round_to<O>(mul_rn(a, c0)), round_to<O>(mul_rn(z, s1)));
      o1 = add_rn(round_to<O>(mul_rn(z, c1)), -round_to<O>(mul_rn(a, s0)));
    }
    olo.v[v] = static_cast<O>(o0);
    ohi.v[v] = static_cast<O>(o1);
  }
  if (V > 1) {
    *reinterpret_cast<Pack<O, V>*>(out + j0) = olo;
    *reinterpret_cast<Pack<O, V>*>(out + j0 + half) = ohi;
  } else {
    out[j0 * step] = olo.v[0];
    out[(j0 + half) * step] = ohi.v[0];
  }
}

// Head hh (q heads first, then k heads) at (b, s): its input and output rows and their element steps.
template <typename T, typename O>
struct HeadRow {
  const T* x;
  O* out;
  int64_t x_step, out_step;
};

template <typename T, typename C, typename O, typename R>
SPTR_HD HeadRow<T, O> head_row(const RopeArgs<T, C, O, R>& p, int64_t b, int64_t s, int64_t hh) {
  const int t = hh < p.heads[0] ? 0 : 1;
  const int64_t h = t ? hh - p.heads[0] : hh;
  const int64_t* xs = p.x_stride[t];
  const int64_t* os = p.out_stride[t];
  return {p.x[t] + b * xs[0] + h * xs[1] + s * xs[2], p.out[t] + b * os[0] + h * os[1] + s * os[2], xs[3], os[3]};
}

// Work item e of the flat (b, s, head over q then k, pair group) space, pair groups fastest (coalesced).
template <int V, typename T, typename C, typename O, typename R>
SPTR_HD void rope_item(const RopeArgs<T, C, O, R>& p, int64_t e) {
  const int64_t groups = p.D / 2 / V, heads = p.heads[0] + p.heads[1];
  const int64_t g = e % groups, r = e / groups, hh = r % heads, bs = r / heads;
  const int64_t b = bs / p.S, s = bs % p.S, j0 = g * V;
  const HeadRow<T, O> row = head_row(p, b, s, hh);
  rotate_store<R>(load_pairs<V>(row.x, row.x_step, j0, p.D / 2), load_pair_tables<V>(p, b, s, j0), p.backward,
                  row.out, row.out_step, j0, p.D / 2);
}

}  // namespace sptr
