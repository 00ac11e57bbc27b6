// Autograd of LayerNorm in C++ (see sptr/autograd.h for why not register_autograd). The backward kernel is not
// itself differentiable.
#include <torch/library.h>

#include <sptr/autograd.h>

#include <tuple>

namespace sptr {
namespace {

using FwdSignature = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const OptTensor&, const OptTensor&, double);
using BwdSignature = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                        const OptTensor&, bool);

class LayerNorm : public torch::autograd::Function<LayerNorm> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                               double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<FwdSignature>("sptr::layer_norm_fwd");
    auto [y, mean, rstd] = op.call(x, weight, bias, eps);
    ctx->save_for_backward({x, weight.value_or(Tensor()), mean, rstd});
    ctx->saved_data["has_bias"] = bias.has_value();
    ctx->mark_non_differentiable({mean, rstd});
    return {y, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();  // x, weight, mean, rstd
    refuse_double_backward("layer_norm", {&grads[0], &s[0], &s[1]});
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<BwdSignature>("sptr::layer_norm_bwd");
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    auto [dx, dw, db] = op.call(grads[0], s[0], s[2], s[3], optional(s[1]), has_bias);
    return {dx, s[1].defined() ? dw : Tensor(), has_bias ? db : Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor> layer_norm_autograd(const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                                                       double eps) {
  variable_list outs = LayerNorm::apply(x, weight, bias, eps);
  return {outs[0], outs[1], outs[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(sptr, Autograd, m) { m.impl("layer_norm_fwd", &layer_norm_autograd); }

}  // namespace sptr
