// Host-side argument checking and kernel-argument assembly shared by the CPU and CUDA implementations.
#pragma once
#include <sptr/checks.h>
#include <sptr/views.h>

#include <optional>
#include <utility>

#include "window_attention_math.h"

namespace sptr {

inline at::Tensor contiguous_or_undefined(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->contiguous() : at::Tensor();
}

// Checks of one (L,3,h,d) table against (h,d) and the (M,3) rel_idx it is indexed with.
inline void check_table(const at::Tensor& table, const char* name, const at::Tensor& ref, int64_t h, int64_t d) {
  SPTR_CHECK_VALUE(table.dim() == 4 && table.size(1) == 3 && table.size(2) == h && table.size(3) == d, name,
                    " must have shape (L, 3, ", h, ", ", d, "), got ", table.sizes());
  SPTR_CHECK_TYPE(table.scalar_type() == ref.scalar_type(), name, " has dtype ", table.scalar_type(),
                   " but the features have ", ref.scalar_type());
  SPTR_CHECK_VALUE(table.device() == ref.device(), name, " is on ", table.device(), " but the features on ",
                    ref.device());
}

inline void check_rel(const at::Tensor& rel, int64_t M, const at::Tensor& ref) {
  SPTR_CHECK_VALUE(rel.dim() == 2 && rel.size(0) == M && rel.size(1) == 3, "rel_idx must have shape (", M,
                    ", 3), got ", rel.sizes());
  // Exactly the widths IntView reads as signed: uint8 would be read as int8 (values >= 128 lost).
  const auto t = rel.scalar_type();
  SPTR_CHECK_TYPE(t == at::kChar || t == at::kShort || t == at::kInt || t == at::kLong,
                   "rel_idx must be int8, int16, int32 or int64, got ", t);
  SPTR_CHECK_VALUE(rel.device() == ref.device(), "rel_idx is on ", rel.device(), " but the features on ",
                    ref.device());
}

inline void check_pair_index(const at::Tensor& idx, const char* name, const at::Tensor& ref) {
  SPTR_CHECK_VALUE(idx.dim() == 1, name, " must be 1-D, got shape ", idx.sizes());
  SPTR_CHECK_TYPE(idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong, name,
                   " must be int32 or int64, got ", idx.scalar_type());
  SPTR_CHECK_VALUE(idx.device() == ref.device(), name, " is on ", idx.device(), " but the features on ",
                    ref.device());
}

// Contiguous operands of the pair-logit op, kept alive for the duration of the kernel.
struct PairLogitOperands {
  at::Tensor q, k, index_0, index_1, table_q, table_k, rel;
  int64_t M, h, d;

  PairLogitOperands(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& i0, const at::Tensor& i1,
                    const std::optional<at::Tensor>& tq, const std::optional<at::Tensor>& tk,
                    const std::optional<at::Tensor>& rel_) {
    SPTR_CHECK_DIM(q_, 3);
    SPTR_CHECK_DIM(k_, 3);
    SPTR_CHECK_FLOATING(q_);
    SPTR_CHECK_SAME_DTYPE(k_, q_);
    SPTR_CHECK_SAME_DEVICE(k_, q_);
    SPTR_CHECK_VALUE(q_.size(1) == k_.size(1) && q_.size(2) == k_.size(2), "q and k must agree in (h, d), got ",
                      q_.sizes(), " and ", k_.sizes());
    check_pair_index(i0, "index_0", q_);
    check_pair_index(i1, "index_1", q_);
    SPTR_CHECK_VALUE(i0.numel() == i1.numel(), "index_0 and index_1 must have the same length, got ", i0.numel(),
                      " and ", i1.numel());
    M = i0.numel();
    h = q_.size(1);
    d = q_.size(2);
    q = q_.contiguous();
    k = k_.contiguous();
    index_0 = i0.contiguous();
    index_1 = i1.contiguous();
    table_q = contiguous_or_undefined(tq);
    table_k = contiguous_or_undefined(tk);
    if (table_q.defined()) check_table(table_q, "table_q", q, h, d);
    if (table_k.defined()) check_table(table_k, "table_k", q, h, d);
    if (table_q.defined() && table_k.defined())
      SPTR_CHECK_VALUE(table_q.size(0) == table_k.size(0), "table_q and table_k must have the same length L, got ",
                        table_q.size(0), " and ", table_k.size(0));
    if (table_q.defined() || table_k.defined()) {
      SPTR_CHECK_VALUE(rel_.has_value() && rel_->defined(), "rel_idx is required when a table is given");
      check_rel(*rel_, M, q);
      rel = rel_->contiguous();
    }
  }

  int64_t L() const { return table_q.defined() ? table_q.size(0) : (table_k.defined() ? table_k.size(0) : 0); }

  template <typename T>
  PairLogitArgs<T> args(bool with_qk) const {
    PairLogitArgs<T> a;
    a.q = q.const_data_ptr<T>();
    a.k = k.const_data_ptr<T>();
    a.table_q = table_q.defined() ? table_q.const_data_ptr<T>() : nullptr;
    a.table_k = table_k.defined() ? table_k.const_data_ptr<T>() : nullptr;
    a.index_0 = int_view(index_0);
    a.index_1 = int_view(index_1);
    a.rel = int_view(rel);
    a.num_q = q.size(0);
    a.num_k = k.size(0);
    a.num_pairs = M;
    a.L = L();
    a.h = h;
    a.d = d;
    a.with_qk = with_qk;
    return a;
  }
};

struct AggregateOperands {
  at::Tensor attn, v, offsets, index_0, index_1, table_v, rel;
  int64_t N, M, h, d;

  AggregateOperands(const at::Tensor& attn_, const at::Tensor& v_, const at::Tensor& offsets_,
                    const std::optional<at::Tensor>& i0, const at::Tensor& i1, const std::optional<at::Tensor>& tv,
                    const std::optional<at::Tensor>& rel_) {
    SPTR_CHECK_DIM(attn_, 2);
    SPTR_CHECK_DIM(v_, 3);
    SPTR_CHECK_FLOATING(v_);
    SPTR_CHECK_SAME_DTYPE(attn_, v_);
    SPTR_CHECK_SAME_DEVICE(attn_, v_);
    check_pair_index(offsets_, "index_0_offsets", v_);
    check_pair_index(i1, "index_1", v_);
    M = i1.numel();
    h = v_.size(1);
    d = v_.size(2);
    SPTR_CHECK_VALUE(attn_.size(0) == M && attn_.size(1) == h, "attn must have shape (", M, ", ", h, "), got ",
                      attn_.sizes());
    SPTR_CHECK_VALUE(offsets_.numel() >= 1, "index_0_offsets must have N + 1 >= 1 entries");
    N = offsets_.numel() - 1;
    attn = attn_.contiguous();
    v = v_.contiguous();
    offsets = offsets_.contiguous();
    index_1 = i1.contiguous();
    if (i0.has_value() && i0->defined()) {
      check_pair_index(*i0, "index_0", v_);
      SPTR_CHECK_VALUE(i0->numel() == M, "index_0 must have length ", M, ", got ", i0->numel());
      index_0 = i0->contiguous();
    }
    table_v = contiguous_or_undefined(tv);
    if (table_v.defined()) {
      check_table(table_v, "table", v, h, d);
      SPTR_CHECK_VALUE(rel_.has_value() && rel_->defined(), "rel_idx is required when a table is given");
      check_rel(*rel_, M, v);
      rel = rel_->contiguous();
    }
  }

  template <typename T>
  AggregateArgs<T> args() const {
    AggregateArgs<T> a;
    a.attn = attn.const_data_ptr<T>();
    a.v = v.const_data_ptr<T>();
    a.table_v = table_v.defined() ? table_v.const_data_ptr<T>() : nullptr;
    a.offsets = int_view(offsets);
    a.index_0 = int_view(index_0);
    a.index_1 = int_view(index_1);
    a.rel = int_view(rel);
    a.num_out = N;
    a.num_v = v.size(0);
    a.num_pairs = M;
    a.L = table_v.defined() ? table_v.size(0) : 0;
    a.h = h;
    a.d = d;
    return a;
  }
};

// Operands of the CSR softmax (forward: src; backward: the forward output) and its upstream gradient.
struct SoftmaxOperands {
  at::Tensor x, grad, indptr;
  int64_t segments, M, h;

  SoftmaxOperands(const at::Tensor& x_, const at::Tensor& indptr_, const std::optional<at::Tensor>& grad_) {
    SPTR_CHECK_DIM(x_, 2);
    SPTR_CHECK_FLOATING(x_);
    check_pair_index(indptr_, "indptr", x_);
    SPTR_CHECK_VALUE(indptr_.numel() >= 1, "indptr must have at least one entry");
    x = x_.contiguous();
    indptr = indptr_.contiguous();
    if (grad_.has_value()) {
      SPTR_CHECK_VALUE(grad_->sizes() == x_.sizes(), "grad must have shape ", x_.sizes(), ", got ", grad_->sizes());
      grad = grad_->to(x.scalar_type()).contiguous();
    }
    segments = indptr.numel() - 1;
    M = x.size(0);
    h = x.size(1);
  }
};

// Zeroed accumulation buffers (fp32, or fp64 for fp64) for scatter-style gradients, one per operand; an
// undefined operand (absent table) gets no buffer and yields an empty gradient, so schemas stay Tensor-typed.
class GradBuffers {
 public:
  // `ref` gives dtype and device of the empty gradients of absent operands.
  GradBuffers(const at::Tensor& ref, std::initializer_list<at::Tensor> operands) {
    for (const auto& t : operands) {
      dtypes_.push_back(t.defined() ? t.scalar_type() : ref.scalar_type());
      devices_.push_back(t.defined() ? t.device() : ref.device());
      const auto acc = t.defined() && t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
      buffers_.push_back(t.defined() ? at::zeros(t.sizes(), t.options().dtype(acc)) : at::Tensor());
    }
  }

  template <typename A>
  A* ptr(size_t i) {
    return buffers_[i].defined() ? buffers_[i].mutable_data_ptr<A>() : nullptr;
  }

  // The gradient rounded once to its operand's dtype.
  at::Tensor result(size_t i) const {
    if (!buffers_[i].defined()) return at::empty({0}, at::TensorOptions().dtype(dtypes_[i]).device(devices_[i]));
    return buffers_[i].to(dtypes_[i]);
  }

  const at::Tensor& buffer(size_t i) const { return buffers_[i]; }

 private:
  std::vector<at::Tensor> buffers_;
  std::vector<at::ScalarType> dtypes_;
  std::vector<at::Device> devices_;
};

// The fused path's window layout from each point's window cell key: the stable window-major point order and
// the int32 CSR offsets of the windows (cells in ascending key order). Device-generic ATen code: one stable sort
// and the run lengths of the sorted keys (unique_consecutive; torch.unique would sort the keys a second time);
// the window count is data-dependent (the fake kernel declares it to the compiler).
inline std::tuple<at::Tensor, at::Tensor> window_sort(const at::Tensor& cells) {
  SPTR_CHECK_DIM(cells, 1);
  SPTR_CHECK_TYPE(cells.scalar_type() == at::kLong, "cells must be int64, got ", cells.scalar_type());
  auto [sorted, sort_idx] = at::sort(cells, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  auto counts = std::get<2>(at::unique_consecutive(sorted, /*return_inverse=*/false, /*return_counts=*/true));
  auto offsets = at::zeros({counts.numel() + 1}, cells.options().dtype(at::kInt));
  if (counts.numel() > 0) offsets.slice(0, 1).copy_(at::cumsum(counts, 0));
  return {sort_idx, offsets};
}

// window_permute_rows: out[dest[i]] = x[i] (x's rows in window order, or back), a scatter into a new contiguous
// tensor, optionally cast to `dtype` on the way (the attention's compute dtype: one pass instead of a cast and a
// permute; a cast commutes with a permute, so the bits are those of x.to(dtype) permuted). A scatter, not a
// gather, on purpose: ATen's CUDA gather of rows (index_select) runs one thread block per row. `source` (the
// inverse permutation) is the backward's `dest`. Its argument checks and output dtype, then its CPU kernel
// (ATen's index_copy_; CUDA has its own row copy in window_attention_cuda.cu).
inline at::ScalarType check_permute_rows(const at::Tensor& x, const at::Tensor& dest, const at::Tensor& source,
                                         std::optional<at::ScalarType> dtype) {
  SPTR_CHECK_VALUE(x.dim() >= 1, "x must have at least one dimension, got ", x.sizes());
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"dest", dest}, {"source", source}}) {
    SPTR_CHECK_VALUE(t.dim() == 1 && t.size(0) == x.size(0), name, " must be a 1-D tensor of x.shape[0] = ",
                     x.size(0), " entries, got shape ", t.sizes());
    SPTR_CHECK_TYPE(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
    SPTR_CHECK_VALUE(t.device() == x.device(), name, " must be on x's device ", x.device(), ", got ", t.device());
  }
  if (!dtype.has_value() || *dtype == x.scalar_type()) return x.scalar_type();
  SPTR_CHECK_TYPE(at::isFloatingType(x.scalar_type()) && at::isFloatingType(*dtype), "dtype casts floating x to "
                  "another floating dtype, got x of ", x.scalar_type(), " and dtype ", *dtype);
  return *dtype;
}

inline at::Tensor window_permute_rows_cpu(const at::Tensor& x, const at::Tensor& dest, const at::Tensor& source,
                                          std::optional<at::ScalarType> dtype) {
  const at::ScalarType out_dtype = check_permute_rows(x, dest, source, dtype);
  return at::empty(x.sizes(), x.options().dtype(out_dtype)).index_copy_(0, dest, x.to(out_dtype));
}

// Per-window starts for precompute_all: window of each point, first point and first pair of each window.
struct WindowLayout {
  at::Tensor counts, point_window, first_point, first_pair;
  int64_t num_pairs;
};

inline WindowLayout window_layout(const at::Tensor& counts_, int64_t N) {
  SPTR_CHECK_DIM(counts_, 1);
  SPTR_CHECK_TYPE(at::isIntegralType(counts_.scalar_type(), false), "counts must be an integer tensor, got ",
                   counts_.scalar_type());
  WindowLayout w;
  w.counts = counts_.to(at::kLong).contiguous();
  const int64_t n = w.counts.numel();
  auto square = w.counts * w.counts;
  w.first_point = (at::cumsum(w.counts, 0) - w.counts).contiguous();
  w.first_pair = (at::cumsum(square, 0) - square).contiguous();
  // One host synchronisation: the number of pairs sizes the outputs.
  const int64_t total_points = n ? w.counts.sum().item<int64_t>() : 0;
  SPTR_CHECK_VALUE(total_points == N, "counts must sum to N = ", N, ", got ", total_points);
  w.num_pairs = n ? square.sum().item<int64_t>() : 0;
  SPTR_CHECK_VALUE(w.num_pairs < (int64_t(1) << 31), "precompute_all: M = ", w.num_pairs,
                    " pairs does not fit int32 indices");
  w.point_window = at::repeat_interleave(at::arange(n, w.counts.options()), w.counts, 0, N).contiguous();
  return w;
}

}  // namespace sptr
