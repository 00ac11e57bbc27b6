// Autograd of the fused window attention in C++ (see sptr/autograd.h for why not register_autograd). The
// forward saves q, k, v, out and lse; the backward recomputes the attention in one window_attention_bwd call.
#include <torch/library.h>

#include <sptr/autograd.h>

#include <tuple>

namespace sptr {
namespace {

using FwdSignature = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                const OptTensor&, const OptTensor&, const OptTensor&,
                                                const OptTensor&, const OptTensor&, int64_t, double, double, bool);
using BwdSignature = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
    const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, int64_t, double,
    double, bool);

class WindowAttention : public torch::autograd::Function<WindowAttention> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& offsets, const OptTensor& coords, const OptTensor& radius,
                               const OptTensor& table_q, const OptTensor& table_k, const OptTensor& table_v,
                               int64_t rel_shift, double radial_a, double scale, bool deterministic) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<FwdSignature>("sptr::window_attention_fwd");
    auto [out, lse] = op.call(q, k, v, offsets, coords, radius, table_q, table_k, table_v, rel_shift, radial_a,
                              scale, deterministic);
    const Tensor none;
    ctx->save_for_backward({q, k, v, out, lse, offsets, coords.value_or(none), radius.value_or(none),
                            table_q.value_or(none), table_k.value_or(none), table_v.value_or(none)});
    ctx->saved_data["rel_shift"] = rel_shift;
    ctx->saved_data["radial_a"] = radial_a;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["deterministic"] = deterministic;
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // q, k, v, out, lse, offsets, coords, radius, table_q, table_k, table_v (absent ones undefined)
    const variable_list s = ctx->get_saved_variables();
    const Tensor& grad_out = grads[0];
    refuse_double_backward("window_attention", {&grad_out, &s[0], &s[1], &s[2], &s[8], &s[9], &s[10]});
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<BwdSignature>("sptr::window_attention_bwd");
    auto [dq, dk, dv, dtq, dtk, dtv] = op.call(
        grad_out.contiguous(), s[0], s[1], s[2], s[3], s[4], s[5], optional(s[6]), optional(s[7]), optional(s[8]),
        optional(s[9]), optional(s[10]), ctx->saved_data["rel_shift"].toInt(), ctx->saved_data["radial_a"].toDouble(),
        ctx->saved_data["scale"].toDouble(), ctx->saved_data["deterministic"].toBool());
    // One entry per forward argument: none for the index tensors, the scalars and absent tables.
    const Tensor none;
    return {dq,   dk,   dv,   none, none, none, s[8].defined() ? dtq : none, s[9].defined() ? dtk : none,
            s[10].defined() ? dtv : none, none, none, none, none};
  }
};

std::tuple<Tensor, Tensor> window_attention_fwd_autograd(const Tensor& q, const Tensor& k, const Tensor& v,
                                                         const Tensor& offsets, const OptTensor& coords,
                                                         const OptTensor& radius, const OptTensor& table_q,
                                                         const OptTensor& table_k, const OptTensor& table_v,
                                                         int64_t rel_shift, double radial_a, double scale,
                                                         bool deterministic) {
  variable_list outs = WindowAttention::apply(q, k, v, offsets, coords, radius, table_q, table_k, table_v,
                                              rel_shift, radial_a, scale, deterministic);
  return {outs[0], outs[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(sptr, Autograd, m) { m.impl("window_attention_fwd", &window_attention_fwd_autograd); }

}  // namespace sptr
