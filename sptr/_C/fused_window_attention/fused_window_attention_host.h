// Host-side checks and operands of the fused window attention, shared by the CPU and CUDA implementations.
#pragma once
#include <ATen/OpMathType.h>
#include <sptr/checks.h>

#include <cmath>
#include <optional>
#include <vector>

#include "fused_window_attention_math.h"

namespace sptr {

struct FusedOperands {
  at::Tensor q, k, v, offsets, coords, radius, table_q, table_k, table_v;
  int64_t N = 0, H = 0, d = 0, W = 0, L = 0;
  int rel_shift = 0;
  double radial_a = 0.0;

  FusedOperands(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& offsets_,
                const std::optional<at::Tensor>& coords_, const std::optional<at::Tensor>& radius_,
                const std::optional<at::Tensor>& tq, const std::optional<at::Tensor>& tk,
                const std::optional<at::Tensor>& tv, int64_t rel_shift_, double radial_a_)
      : rel_shift(static_cast<int>(rel_shift_)), radial_a(radial_a_) {
    SPTR_CHECK_DIM(q_, 3);
    SPTR_CHECK_FLOATING(q_);
    for (const at::Tensor* t : {&k_, &v_}) {
      SPTR_CHECK_VALUE(t->sizes() == q_.sizes(), "q, k and v must have the same shape (N, h, d), got ", q_.sizes(),
                        ", ", k_.sizes(), ", ", v_.sizes());
      SPTR_CHECK_TYPE(t->scalar_type() == q_.scalar_type(), "q, k and v must have the same dtype, got ",
                       q_.scalar_type(), ", ", k_.scalar_type(), ", ", v_.scalar_type());
      SPTR_CHECK_VALUE(t->device() == q_.device(), "q, k and v must be on one device");
    }
    N = q_.size(0);
    H = q_.size(1);
    d = q_.size(2);
    SPTR_CHECK_VALUE(N < (int64_t(1) << 31), "at most 2^31 - 1 tokens, got ", N);
    SPTR_CHECK_VALUE(offsets_.dim() == 1 && offsets_.numel() >= 1, "window_offsets must be 1-D with W + 1 >= 1 "
                      "entries, got shape ", offsets_.sizes());
    SPTR_CHECK_INDEX_DTYPE(offsets_);
    SPTR_CHECK_SAME_DEVICE(offsets_, q_);
    W = offsets_.numel() - 1;
    SPTR_CHECK_VALUE(W >= 1 || N == 0, "window_offsets has no window (shape (1,)) but there are ", N, " tokens");
    q = q_.contiguous();
    k = k_.contiguous();
    v = v_.contiguous();
    offsets = offsets_.to(at::kInt).contiguous();
    int i = 0;
    for (const std::optional<at::Tensor>* t : {&tq, &tk, &tv}) {
      static const char* names[] = {"table_q", "table_k", "table_v"};
      at::Tensor& dst = i == 0 ? table_q : (i == 1 ? table_k : table_v);
      const char* name = names[i++];
      if (!t->has_value() || !(*t)->defined()) continue;
      const at::Tensor& tab = **t;
      SPTR_CHECK_VALUE(tab.dim() == 4 && tab.size(1) == 3 && tab.size(2) == H && tab.size(3) == d, name,
                        " must have shape (L, 3, ", H, ", ", d, "), got ", tab.sizes());
      SPTR_CHECK_TYPE(tab.scalar_type() == q.scalar_type(), name, " has dtype ", tab.scalar_type(),
                       " but q has ", q.scalar_type());
      SPTR_CHECK_SAME_DEVICE(tab, q);
      SPTR_CHECK_VALUE(L == 0 || tab.size(0) == L, "the tables must have one length L, got ", L, " and ",
                        tab.size(0));
      SPTR_CHECK_VALUE(tab.size(0) >= 1, name, " must have L >= 1 rows");
      L = tab.size(0);
      dst = tab.contiguous();
    }
    if (L > 0) {
      SPTR_CHECK_VALUE(coords_.has_value() && coords_->defined(), "coords are required with relative-position tables");
      const at::Tensor& c = *coords_;
      SPTR_CHECK_VALUE(c.dim() == 2 && c.size(0) == N && c.size(1) == 3, "coords must have shape (", N,
                        ", 3), got ", c.sizes());
      SPTR_CHECK_TYPE(c.scalar_type() == at::kInt, "coords must be int32, got ", c.scalar_type());
      SPTR_CHECK_SAME_DEVICE(c, q);
      coords = c.contiguous();
      if (radius_.has_value() && radius_->defined()) {
        const at::Tensor& r = *radius_;
        SPTR_CHECK_VALUE(r.dim() == 1 && r.size(0) == N, "radius must have shape (", N, ",), got ", r.sizes());
        SPTR_CHECK_TYPE(r.scalar_type() == at::kFloat, "radius must be float32, got ", r.scalar_type());
        SPTR_CHECK_SAME_DEVICE(r, q);
        SPTR_CHECK_VALUE(radial_a > 0.0, "radial_a must be > 0 with radius, got ", radial_a);
        radius = r.contiguous();
      }
    }
  }

  bool has_rel() const { return L > 0; }

  RelPosParams rel_params() const {
    RelPosParams p;
    if (!has_rel()) return p;
    p.coords = coords.const_data_ptr<int32_t>();
    p.radius = radius.defined() ? radius.const_data_ptr<float>() : nullptr;
    p.L = static_cast<int>(L);
    p.rel_shift = rel_shift;
    p.a = static_cast<float>(radial_a);
    p.two_a = static_cast<float>(2.0 * radial_a);
    p.inv_a = radial_a > 0.0 ? 1.0f / p.a : 0.f;
    p.inv_ln2 = 1.0f / static_cast<float>(std::log(2.0));
    return p;
  }

  // Gradient of a table, in the accumulation dtype (fp32 for 16-bit inputs), or empty without the table.
  // With slots > 0 it holds that many partial gradients (slots, L, 3, H, d), one per CUDA block.
  at::Tensor table_grad_buffer(const at::Tensor& table, int64_t slots = 0) const {
    if (!table.defined()) return q.new_empty({0});
    std::vector<int64_t> shape;
    if (slots > 0) shape.push_back(slots);
    shape.insert(shape.end(), table.sizes().begin(), table.sizes().end());
    return at::zeros(shape, table.options().dtype(at::toOpMathType(table.scalar_type())));
  }
};

inline void check_backward_operands(const FusedOperands& o, const at::Tensor& grad, const at::Tensor& out,
                                    const at::Tensor& lse) {
  for (const at::Tensor* t : {&grad, &out}) {
    SPTR_CHECK_VALUE(t->sizes() == o.q.sizes(), "grad_out and out must have q's shape ", o.q.sizes(), ", got ",
                      t->sizes());
    SPTR_CHECK_TYPE(t->scalar_type() == o.q.scalar_type(), "grad_out and out must have q's dtype ",
                     o.q.scalar_type(), ", got ", t->scalar_type());
    SPTR_CHECK_SAME_DEVICE((*t), o.q);
  }
  SPTR_CHECK_VALUE(lse.dim() == 2 && lse.size(0) == o.N && lse.size(1) == o.H, "lse must have shape (", o.N, ", ",
                    o.H, "), got ", lse.sizes());
  SPTR_CHECK_TYPE(lse.scalar_type() == at::toOpMathType(o.q.scalar_type()), "lse must be ",
                   at::toOpMathType(o.q.scalar_type()), ", got ", lse.scalar_type());
  SPTR_CHECK_SAME_DEVICE(lse, o.q);
}

inline at::Tensor table_grad_result(const at::Tensor& grad, const at::Tensor& table) {
  return table.defined() ? grad.to(table.scalar_type()) : grad;
}

}  // namespace sptr
