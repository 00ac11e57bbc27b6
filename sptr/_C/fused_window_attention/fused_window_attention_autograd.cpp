// Autograd of the fused window attention, in C++ rather than torch.library.register_autograd: the Python
// autograd.Function that register_autograd builds costs ~40 µs of host time per call with gradients on (and
// ~5 µs without), several times this op's whole host budget (measured in benchmarks/RESULTS.md). The forward
// saves q, k, v, out and lse; the backward recomputes the attention in one window_attention_bwd call.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <sptr/checks.h>

#include <optional>
#include <tuple>

namespace sptr {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using FwdSignature = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                const OptTensor&, const OptTensor&, const OptTensor&,
                                                const OptTensor&, const OptTensor&, int64_t, double, double, bool);
using BwdSignature = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
    const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, int64_t, double,
    double, bool);

const c10::TypedOperatorHandle<FwdSignature>& forward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("sptr::window_attention_fwd", "").typed<FwdSignature>();
  return op;
}

const c10::TypedOperatorHandle<BwdSignature>& backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("sptr::window_attention_bwd", "").typed<BwdSignature>();
  return op;
}

OptTensor optional(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

class WindowAttention : public torch::autograd::Function<WindowAttention> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& offsets, const OptTensor& coords, const OptTensor& radius,
                               const OptTensor& table_q, const OptTensor& table_k, const OptTensor& table_v,
                               int64_t rel_shift, double radial_a, double scale, bool deterministic) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = forward_op().call(q, k, v, offsets, coords, radius, table_q, table_k, table_v, rel_shift,
                                        radial_a, scale, deterministic);
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
    const variable_list s = ctx->get_saved_variables();
    const Tensor& grad_out = grads[0];
    // The backward kernel is not differentiable; PyTorch would otherwise only warn and return zeros as the
    // second-order gradient (same refusal as the Python ops' refuse_double_backward).
    if (at::GradMode::is_enabled()) {
      bool any = grad_out.requires_grad();
      for (int i : {0, 1, 2, 8, 9, 10}) any = any || (s[i].defined() && s[i].requires_grad());
      TORCH_CHECK(!any, msg("window_attention has no second-order gradient: its backward is a fused kernel that is "
                            "not differentiable. Call torch.autograd.grad / backward without create_graph=True "
                            "through it (double backward, Hessian-vector products and gradient penalties are not "
                            "supported by this op)"));
    }
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [dq, dk, dv, dtq, dtk, dtv] = backward_op().call(
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
