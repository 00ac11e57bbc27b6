// Autograd of the MoE ops in C++ (see sptr/autograd.h for why not register_autograd). Backwards made of
// differentiable ops (permute: an unpermute; the dual GEMM and the grouped linear's input gradient: GEMMs of
// the same kind) call them through the full dispatcher, so their double backward is real; the fused backward
// kernels (unpermute, SwiGLU, the grouped weight gradient) refuse create_graph=True. Sizes are SymInts where
// torch.compile may make them symbolic; int arguments of the ops guard them.
#include <torch/library.h>

#include <sptr/autograd.h>

#include <tuple>
#include <vector>

namespace sptr {
namespace {

int64_t guarded(const c10::SymInt& v) { return v.guard_int(__FILE__, __LINE__); }

using PermuteSignature = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, int64_t, int64_t,
                                                                   int64_t);
using UnpermuteSignature = Tensor(const Tensor&, const Tensor&, const OptTensor&, int64_t);
using UnpermuteBwdSignature = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                         const OptTensor&, bool);
using SwigluSignature = Tensor(const Tensor&, const Tensor&, at::IntArrayRef);
using SwigluBwdSignature = Tensor(const Tensor&, const Tensor&, const Tensor&, at::IntArrayRef);
using GroupedLinearSignature = Tensor(const Tensor&, at::TensorList, const Tensor&);
using WgradSignature = std::vector<Tensor>(const Tensor&, const Tensor&, const Tensor&, at::IntArrayRef,
                                           at::IntArrayRef);
using DualSignature = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool,
                                                 bool);

Tensor unpermute(const Tensor& x_perm, const Tensor& row_id_map, const OptTensor& probs, int64_t num_tokens) {
  static const auto op = typed_op<UnpermuteSignature>("sptr::moe_unpermute_fwd");
  return op.call(x_perm, row_id_map, probs, num_tokens);
}

Tensor grouped_linear(const Tensor& x, at::TensorList weights, const Tensor& offsets) {
  static const auto op = typed_op<GroupedLinearSignature>("sptr::moe_grouped_linear");
  return op.call(x, weights, offsets);
}

std::tuple<Tensor, Tensor> dual_gemm(const Tensor& a0, const Tensor& a1, const Tensor& w0, const Tensor& w1,
                                     bool trans_a, bool trans_b) {
  static const auto op = typed_op<DualSignature>("sptr::dual_gemm");
  return op.call(a0, a1, w0, w1, trans_a, trans_b);
}

// ------------------------------------------------------------------------------------------------- permute
class Permute : public torch::autograd::Function<Permute> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& ids, int64_t num_experts,
                               int64_t num_out_tokens, int64_t align) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<PermuteSignature>("sptr::moe_permute");
    auto [x_perm, row_id_map, tokens_per_expert, offsets] = op.call(x, ids, num_experts, num_out_tokens, align);
    ctx->save_for_backward({row_id_map});
    ctx->saved_data["num_tokens"] = x.sym_size(0);
    ctx->mark_non_differentiable({row_id_map, tokens_per_expert, offsets});
    return {x_perm, row_id_map, tokens_per_expert, offsets};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor row_id_map = ctx->get_saved_variables()[0];
    const Tensor dx = unpermute(grads[0].contiguous(), row_id_map, std::nullopt,
                                guarded(ctx->saved_data["num_tokens"].toSymInt()));
    return {dx, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor, Tensor> permute_autograd(const Tensor& x, const Tensor& ids, int64_t num_experts,
                                                            int64_t num_out_tokens, int64_t align) {
  variable_list o = Permute::apply(x, ids, num_experts, num_out_tokens, align);
  return {o[0], o[1], o[2], o[3]};
}

// ----------------------------------------------------------------------------------------------- unpermute
class Unpermute : public torch::autograd::Function<Unpermute> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x_perm, const Tensor& row_id_map,
                               const OptTensor& probs, int64_t num_tokens) {
    at::AutoDispatchBelowADInplaceOrView guard;
    Tensor out = unpermute(x_perm, row_id_map, probs, num_tokens);
    // x_perm's values are read only for the probs gradient: saved only then
    const bool probs_grad = probs.has_value() && probs->defined() && probs->requires_grad();
    const Tensor none;
    ctx->save_for_backward({probs_grad ? x_perm : none, row_id_map, probs.value_or(none)});
    ctx->saved_data["perm_sizes"] = c10::IValue(x_perm.sym_sizes());
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();  // x_perm (or none), row_id_map, probs (or none)
    refuse_double_backward("unpermute", {&grads[0], &s[0], &s[2]});
    at::AutoDispatchBelowADInplaceOrView guard;
    const bool probs_grad = s[0].defined();
    const Tensor grad = grads[0].contiguous();
    const Tensor y = probs_grad ? s[0] : grad.new_empty_symint(ctx->saved_data["perm_sizes"].toSymIntVector());
    static const auto op = typed_op<UnpermuteBwdSignature>("sptr::moe_unpermute_bwd");
    auto [d_perm, d_probs] = op.call(grad, y, s[1], optional(s[2]), probs_grad);
    return {d_perm, Tensor(), probs_grad ? d_probs.to(s[2].scalar_type()) : Tensor(), Tensor()};
  }
};

Tensor unpermute_autograd(const Tensor& x_perm, const Tensor& row_id_map, const OptTensor& probs, int64_t num_tokens) {
  return Unpermute::apply(x_perm, row_id_map, probs, num_tokens)[0];
}

// ------------------------------------------------------------------------------------------ grouped SwiGLU
class Swiglu : public torch::autograd::Function<Swiglu> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& h, const Tensor& offsets, at::IntArrayRef widths) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<SwigluSignature>("sptr::moe_swiglu_fwd");
    Tensor out = op.call(h, offsets, widths);
    ctx->save_for_backward({h, offsets});
    ctx->saved_data["widths"] = widths.vec();
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    refuse_double_backward("grouped SwiGLU", {&grads[0], &s[0]});
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<SwigluBwdSignature>("sptr::moe_swiglu_bwd");
    const std::vector<int64_t> widths = ctx->saved_data["widths"].toIntVector();
    return {op.call(grads[0].contiguous(), s[0], s[1], widths), Tensor(), Tensor()};
  }
};

Tensor swiglu_autograd(const Tensor& h, const Tensor& offsets, at::IntArrayRef widths) {
  return Swiglu::apply(h, offsets, widths)[0];
}

// ------------------------------------------------------------------------------------------ grouped linear
class GroupedLinear : public torch::autograd::Function<GroupedLinear> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, at::TensorList weights, const Tensor& offsets) {
    at::AutoDispatchBelowADInplaceOrView guard;
    Tensor out = grouped_linear(x, weights, offsets);
    variable_list saved{x, offsets};
    saved.insert(saved.end(), weights.begin(), weights.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["x_cols"] = x.sym_size(1);
    return {out};
  }

  // Group g's parts stacked into one [n_g, k_g] weight; dx = grouped GEMM with the transposed weights (padded
  // to x's columns), dW = the grouped weight-gradient kernel, split back into the parts.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();  // x, offsets, weights...
    const Tensor &x = s[0], &offsets = s[1];
    const std::vector<Tensor> weights(s.begin() + 2, s.end());
    const int64_t W = static_cast<int64_t>(weights.size());
    const int64_t G = guarded(offsets.sym_size(0)) - 1, P = W / G;
    std::vector<Tensor> stacked;
    for (int64_t g = 0; g < G; ++g)
      stacked.push_back(P > 1 ? at::cat(at::TensorList(weights).slice(g * P, P)) : weights[g]);
    const Tensor grad = grads[0].contiguous();
    variable_list out(W + 2);
    if (ctx->needs_input_grad(0)) {
      std::vector<Tensor> transposed;
      for (const Tensor& w : stacked) transposed.push_back(w.t());  // views: the sm90 kernels read them as they are
      Tensor dx = grouped_linear(grad, transposed, offsets);
      const int64_t x_cols = guarded(ctx->saved_data["x_cols"].toSymInt()), dx_cols = guarded(dx.sym_size(1));
      out[0] = dx_cols < x_cols ? at::constant_pad_nd(dx, {0, x_cols - dx_cols}) : dx;
    }
    bool weight_grad = false;
    for (int64_t i = 0; i < W; ++i) weight_grad = weight_grad || ctx->needs_input_grad(1 + i);
    if (weight_grad) {
      refuse_double_backward("grouped linear (weight gradient)", {&grad, &x});
      at::AutoDispatchBelowADInplaceOrView guard;
      std::vector<int64_t> out_features, in_features;
      for (const Tensor& w : stacked) {
        out_features.push_back(guarded(w.sym_size(0)));
        in_features.push_back(guarded(w.sym_size(1)));
      }
      static const auto op = typed_op<WgradSignature>("sptr::moe_grouped_linear_wgrad");
      const std::vector<Tensor> dw = op.call(grad, x, offsets, out_features, in_features);
      for (int64_t g = 0; g < G; ++g) {
        std::vector<int64_t> rows;
        for (int64_t p = 0; p < P; ++p) rows.push_back(guarded(weights[g * P + p].sym_size(0)));
        const std::vector<Tensor> parts = dw[g].split_with_sizes(rows);
        for (int64_t p = 0; p < P; ++p) out[1 + g * P + p] = parts[p];
      }
    }
    return out;  // the last entry (offsets) stays undefined
  }
};

Tensor grouped_linear_autograd(const Tensor& x, at::TensorList weights, const Tensor& offsets) {
  return GroupedLinear::apply(x, weights, offsets)[0];
}

// ---------------------------------------------------------------------------------------------- dual GEMM
class DualGemm : public torch::autograd::Function<DualGemm> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& a0, const Tensor& a1, const Tensor& w0,
                               const Tensor& w1, bool trans_a, bool trans_b) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [c0, c1] = dual_gemm(a0, a1, w0, w1, trans_a, trans_b);
    ctx->save_for_backward({a0, a1, w0, w1});
    ctx->saved_data["trans_a"] = trans_a;
    ctx->saved_data["trans_b"] = trans_b;
    return {c0, c1};
  }

  // c = op(a)·op(w): d op(a) = g·op(w)ᵀ, d op(w) = op(a)ᵀ·g, each a dual GEMM (transposed back under trans_*).
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const Tensor &a0 = s[0], &a1 = s[1], &w0 = s[2], &w1 = s[3], &g0 = grads[0], &g1 = grads[1];
    const bool ta = ctx->saved_data["trans_a"].toBool(), tb = ctx->saved_data["trans_b"].toBool();
    Tensor da0, da1, dw0, dw1;
    if (ctx->needs_input_grad(0) || ctx->needs_input_grad(1))
      std::tie(da0, da1) = ta ? dual_gemm(w0, w1, g0, g1, tb, true) : dual_gemm(g0, g1, w0, w1, false, !tb);
    if (ctx->needs_input_grad(2) || ctx->needs_input_grad(3))
      std::tie(dw0, dw1) = tb ? dual_gemm(g0, g1, a0, a1, true, ta) : dual_gemm(a0, a1, g0, g1, !ta, false);
    return {da0, da1, dw0, dw1, Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> dual_gemm_autograd(const Tensor& a0, const Tensor& a1, const Tensor& w0, const Tensor& w1,
                                              bool trans_a, bool trans_b) {
  variable_list o = DualGemm::apply(a0, a1, w0, w1, trans_a, trans_b);
  return {o[0], o[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(sptr, Autograd, m) {
  m.impl("moe_permute", &permute_autograd);
  m.impl("moe_unpermute_fwd", &unpermute_autograd);
  m.impl("moe_swiglu_fwd", &swiglu_autograd);
  m.impl("moe_grouped_linear", &grouped_linear_autograd);
  m.impl("dual_gemm", &dual_gemm_autograd);
}

}  // namespace sptr
