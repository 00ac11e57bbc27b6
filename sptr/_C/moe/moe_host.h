// Argument checks and problem descriptions of the MoE ops (routing, SwiGLU, grouped GEMMs), shared by the CPU
// and CUDA implementations.
#pragma once
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <sptr/checks.h>

#include <vector>

namespace sptr {

inline void check_moe_float(const at::Tensor& t, const char* name) {
  SPTR_CHECK_TYPE(at::isFloatingType(t.scalar_type()) && t.element_size() >= 2, name,
                   " must be float16, bfloat16, float32 or float64, got ", t.scalar_type());
}

// expert_ids [T] or [T, K]; returns K.
inline int64_t check_permute_args(const at::Tensor& x, const at::Tensor& ids, int64_t num_experts,
                                  int64_t num_out_tokens, int64_t align) {
  SPTR_CHECK_DIM(x, 2);
  check_moe_float(x, "x");
  SPTR_CHECK_INDEX_DTYPE(ids);
  SPTR_CHECK_SAME_DEVICE(ids, x);
  SPTR_CHECK_VALUE(ids.dim() == 2 && ids.size(0) == x.size(0), "expert_ids must be [T, K] with T = ", x.size(0),
                    ", got shape ", ids.sizes());
  const int64_t slots = ids.numel();
  SPTR_CHECK_VALUE(slots < (int64_t(1) << 31), "T * K must be below 2^31, got ", slots);
  SPTR_CHECK_VALUE(num_experts >= 1, "num_experts must be >= 1, got ", num_experts);
  SPTR_CHECK_VALUE(num_out_tokens >= 0 && num_out_tokens <= slots, "num_out_tokens must be in [0, T * K = ",
                    slots, "], got ", num_out_tokens);
  SPTR_CHECK_VALUE(align >= 1 && align <= 1024, "align must be in [1, 1024], got ", align);
  return ids.size(1);
}

// Rows of x_perm: the kept slots plus up to align - 1 padding rows per expert.
inline int64_t permuted_rows(int64_t num_out_tokens, int64_t num_experts, int64_t align) {
  return align > 1 ? num_out_tokens + num_experts * (align - 1) : num_out_tokens;
}

// Returns K (copies per token).
inline int64_t check_unpermute_args(const at::Tensor& x_perm, const at::Tensor& row_id_map,
                                    const c10::optional<at::Tensor>& probs, int64_t num_tokens) {
  SPTR_CHECK_DIM(x_perm, 2);
  check_moe_float(x_perm, "x_perm");
  SPTR_CHECK_VALUE(row_id_map.dim() == 1 && row_id_map.scalar_type() == at::kInt,
                    "row_id_map must be a 1-D int32 tensor, got ", row_id_map.scalar_type(), " of shape ",
                    row_id_map.sizes());
  SPTR_CHECK_SAME_DEVICE(row_id_map, x_perm);
  SPTR_CHECK_VALUE(num_tokens >= 0, "num_tokens must be >= 0, got ", num_tokens);
  SPTR_CHECK_VALUE(num_tokens == 0 ? row_id_map.numel() == 0 : row_id_map.numel() % num_tokens == 0,
                    "row_id_map must hold K * num_tokens entries (num_tokens = ", num_tokens, "), got ",
                    row_id_map.numel());
  const int64_t K = num_tokens ? row_id_map.numel() / num_tokens : 0;
  if (probs.has_value()) {
    check_moe_float(*probs, "probs");
    SPTR_CHECK_SAME_DEVICE((*probs), x_perm);
    SPTR_CHECK_VALUE(probs->dim() == 2 && probs->size(0) == num_tokens && probs->size(1) == K,
                      "probs must be [T, K] = [", num_tokens, ", ", K, "], got ", probs->sizes());
  }
  return K;
}

inline void check_group_offsets(const at::Tensor& offsets, const at::Tensor& x) {
  SPTR_CHECK_VALUE(offsets.dim() == 1 && offsets.numel() >= 2 && offsets.scalar_type() == at::kLong,
                    "group_offsets must be a 1-D int64 tensor of G + 1 >= 2 entries, got ", offsets.scalar_type(),
                    " of shape ", offsets.sizes());
  SPTR_CHECK_SAME_DEVICE(offsets, x);
}

// SwiGLU on grouped rows: group g (rows [off[g], off[g+1])) has gate columns [0, w_g) and up [w_g, 2 w_g).
inline void check_swiglu_args(const at::Tensor& h, const at::Tensor& offsets, at::IntArrayRef widths) {
  SPTR_CHECK_DIM(h, 2);
  check_moe_float(h, "h");
  check_group_offsets(offsets, h);
  SPTR_CHECK_VALUE(static_cast<int64_t>(widths.size()) == offsets.numel() - 1,
                    "widths must have one entry per group (", offsets.numel() - 1, "), got ", widths.size());
  int64_t wmax = 0;
  for (int64_t w : widths) {
    SPTR_CHECK_VALUE(w >= 0, "widths must be >= 0, got ", widths);
    wmax = std::max(wmax, w);
  }
  SPTR_CHECK_VALUE(h.size(1) >= 2 * wmax, "h must have at least 2 * max(widths) = ", 2 * wmax, " columns, got ",
                    h.size(1));
}

inline int64_t max_width(at::IntArrayRef widths) {
  int64_t w = 0;
  for (int64_t v : widths) w = std::max(w, v);
  return w;
}

// The grouped linear: weights[g * P + p] is part p ([n_gp, k_g]) of group g; the parts' outputs are
// concatenated along the columns. Returns the output width max_g sum_p n_gp.
inline int64_t check_grouped_linear_args(const at::Tensor& x, at::TensorList weights, const at::Tensor& offsets) {
  SPTR_CHECK_DIM(x, 2);
  check_moe_float(x, "x");
  check_group_offsets(offsets, x);
  const int64_t G = offsets.numel() - 1;
  SPTR_CHECK_VALUE(!weights.empty() && static_cast<int64_t>(weights.size()) % G == 0,
                    "weights must hold P entries per group (G = ", G, "), got ", weights.size());
  const int64_t P = weights.size() / G;
  int64_t width = 0;
  for (int64_t g = 0; g < G; ++g) {
    int64_t n = 0;
    for (int64_t p = 0; p < P; ++p) {
      const at::Tensor& w = weights[g * P + p];
      SPTR_CHECK_VALUE(w.dim() == 2, "weights[", g * P + p, "] must be 2-D [out, in], got ", w.sizes());
      SPTR_CHECK_TYPE(w.scalar_type() == x.scalar_type(), "weights[", g * P + p, "] has dtype ", w.scalar_type(),
                       " but x has ", x.scalar_type());
      SPTR_CHECK_VALUE(w.device() == x.device(), "weights[", g * P + p, "] is on ", w.device(), " but x is on ",
                        x.device());
      SPTR_CHECK_VALUE(w.size(1) <= x.size(1), "weights[", g * P + p, "] has ", w.size(1),
                        " input features but x has only ", x.size(1), " columns");
      SPTR_CHECK_VALUE(w.size(1) == weights[g * P].size(1), "the parts of group ", g,
                        " must share in_features, got ", w.size(1), " and ", weights[g * P].size(1));
      n += w.size(0);
    }
    width = std::max(width, n);
  }
  return width;
}

inline void check_wgrad_args(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& offsets,
                             at::IntArrayRef out_features, at::IntArrayRef in_features) {
  SPTR_CHECK_DIM(grad, 2);
  SPTR_CHECK_DIM(x, 2);
  check_moe_float(x, "x");
  SPTR_CHECK_SAME_DTYPE(grad, x);
  SPTR_CHECK_SAME_DEVICE(grad, x);
  SPTR_CHECK_VALUE(grad.size(0) == x.size(0), "grad and x must have the same rows, got ", grad.size(0), " and ",
                    x.size(0));
  check_group_offsets(offsets, x);
  const int64_t G = offsets.numel() - 1;
  SPTR_CHECK_VALUE(static_cast<int64_t>(out_features.size()) == G && static_cast<int64_t>(in_features.size()) == G,
                    "out_features and in_features need one entry per group (", G, ")");
  for (int64_t g = 0; g < G; ++g) {
    SPTR_CHECK_VALUE(out_features[g] >= 0 && out_features[g] <= grad.size(1), "out_features[", g, "] = ",
                      out_features[g], " must be in [0, ", grad.size(1), "]");
    SPTR_CHECK_VALUE(in_features[g] >= 0 && in_features[g] <= x.size(1), "in_features[", g, "] = ",
                      in_features[g], " must be in [0, ", x.size(1), "]");
  }
}

// One expert of the dual GEMM: A = op(a) [m, k], B = op(w) [k, n].
struct DualShape {
  int64_t m, k, n;
};

inline DualShape dual_shape(const at::Tensor& a, const at::Tensor& w, bool trans_a, bool trans_b, int e) {
  SPTR_CHECK_VALUE(a.dim() == 2, "input_expert", e, " must be 2-D, got shape ", a.sizes());
  SPTR_CHECK_VALUE(w.dim() == 2, "weight_expert", e, " must be 2-D, got shape ", w.sizes());
  DualShape s{trans_a ? a.size(1) : a.size(0), trans_a ? a.size(0) : a.size(1), trans_b ? w.size(0) : w.size(1)};
  const int64_t wk = trans_b ? w.size(1) : w.size(0);
  SPTR_CHECK_VALUE(wk == s.k, "weight_expert", e, " has k = ", wk, " but input_expert", e, " has k = ", s.k,
                    " (trans_a = ", trans_a ? 1 : 0, ", trans_b = ", trans_b ? 1 : 0, ")");
  return s;
}

inline void check_dual_args(const at::Tensor& a0, const at::Tensor& a1, const at::Tensor& w0, const at::Tensor& w1) {
  check_moe_float(a0, "input_expert0");
  const at::Tensor* ts[3] = {&a1, &w0, &w1};
  const char* names[3] = {"input_expert1", "weight_expert0", "weight_expert1"};
  for (int i = 0; i < 3; ++i) {
    SPTR_CHECK_TYPE(ts[i]->scalar_type() == a0.scalar_type(), names[i], " has dtype ", ts[i]->scalar_type(),
                     " but input_expert0 has ", a0.scalar_type());
    SPTR_CHECK_VALUE(ts[i]->device() == a0.device(), names[i], " is on ", ts[i]->device(),
                      " but input_expert0 is on ", a0.device());
  }
}

inline void check_dual_out(const at::Tensor& c, const DualShape& s, const at::Tensor& a, int e,
                           std::initializer_list<const at::Tensor*> inputs) {
  SPTR_CHECK_VALUE(c.dim() == 2 && c.size(0) == s.m && c.size(1) == s.n, "output_expert", e, " must be [", s.m,
                    ", ", s.n, "], got ", c.sizes());
  SPTR_CHECK_TYPE(c.scalar_type() == a.scalar_type(), "output_expert", e, " must have dtype ", a.scalar_type());
  SPTR_CHECK_VALUE(c.device() == a.device(), "output_expert", e, " must be on ", a.device());
  at::assert_no_internal_overlap(c);
  for (const at::Tensor* t : inputs) at::assert_no_overlap(c, *t);
}

// dual_gemm from a device's dual_gemm_out: the outputs allocated with the shapes of the flags.
using DualGemmOut = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, bool, bool,
                             const at::Tensor&, const at::Tensor&);

template <DualGemmOut out_fn>
std::tuple<at::Tensor, at::Tensor> dual_gemm_alloc(const at::Tensor& a0, const at::Tensor& a1, const at::Tensor& w0,
                                                   const at::Tensor& w1, bool trans_a, bool trans_b) {
  check_dual_args(a0, a1, w0, w1);
  const DualShape s0 = dual_shape(a0, w0, trans_a, trans_b, 0), s1 = dual_shape(a1, w1, trans_a, trans_b, 1);
  auto c0 = at::empty({s0.m, s0.n}, a0.options()), c1 = at::empty({s1.m, s1.n}, a0.options());
  out_fn(a0, a1, w0, w1, trans_a, trans_b, c0, c1);
  return {c0, c1};
}

// probs as a contiguous [T, K] tensor of the accumulation dtype (fp32; fp64 for fp64 activations), or undefined.
inline at::Tensor combine_weights(const c10::optional<at::Tensor>& probs, const at::Tensor& x) {
  if (!probs.has_value()) return at::Tensor();
  return probs->to(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat).contiguous();
}

}  // namespace sptr
