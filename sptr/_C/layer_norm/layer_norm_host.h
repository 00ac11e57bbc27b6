// LayerNorm over the last dimension: argument checks and the device-generic ATen form (the CPU kernel, and the
// CUDA fallback for rows longer than the warp kernel takes and for fp64). Statistics in the op-math type
// (fp32 for fp16/bf16), variance by two passes over the row: mean, then the mean squared deviation.
#pragma once
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <sptr/checks.h>

#include <optional>
#include <tuple>
#include <utility>

namespace sptr {

inline void check_layer_norm_args(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                  const std::optional<at::Tensor>& bias) {
  SPTR_CHECK_VALUE(x.dim() >= 1, "x must have at least one dimension, got a scalar");
  SPTR_CHECK_TYPE(at::isFloatingType(x.scalar_type()), "x must be a floating tensor, got ", x.scalar_type());
  const int64_t C = x.size(-1);
  SPTR_CHECK_VALUE(C > 0, "x's last dimension (the normalised one) must not be empty, got shape ", x.sizes());
  for (const auto& [name, t] : {std::pair<const char*, const std::optional<at::Tensor>&>{"weight", weight},
                                {"bias", bias}}) {
    if (!t.has_value()) continue;
    SPTR_CHECK_VALUE(t->dim() == 1 && t->size(0) == C, name, " must be a 1-D tensor of x.shape[-1] = ", C,
                     " entries, got shape ", t->sizes());
    SPTR_CHECK_TYPE(t->scalar_type() == x.scalar_type(), name, " must have x's dtype ", x.scalar_type(), ", got ",
                    t->scalar_type());
    SPTR_CHECK_VALUE(t->device() == x.device(), name, " must be on x's device ", x.device(), ", got ",
                     t->device());
  }
}

// (y, mean, rstd): y of x's shape and dtype, mean and rstd [rows] in the op-math type.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_aten(const at::Tensor& x,
                                                                          const std::optional<at::Tensor>& weight,
                                                                          const std::optional<at::Tensor>& bias,
                                                                          double eps) {
  const auto acc = at::toOpMathType(x.scalar_type());
  const at::Tensor xf = x.reshape({-1, x.size(-1)}).to(acc);
  const at::Tensor mean = xf.mean(-1, true);
  const at::Tensor centred = xf - mean;
  const at::Tensor rstd = at::rsqrt(centred.square().mean(-1, true) + eps);
  at::Tensor y = centred * rstd;
  if (weight) y = y * weight->to(acc);
  if (bias) y = y + bias->to(acc);
  return {y.to(x.scalar_type()).reshape(x.sizes()), mean.squeeze(-1), rstd.squeeze(-1)};
}

// (dx, dweight, dbias); dweight / dbias empty where there is no weight / bias.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_aten(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, bool has_bias) {
  const auto acc = at::toOpMathType(x.scalar_type());
  const int64_t C = x.size(-1);
  const at::Tensor g = grad.reshape({-1, C}).to(acc);
  const at::Tensor xhat = (x.reshape({-1, C}).to(acc) - mean.unsqueeze(-1)) * rstd.unsqueeze(-1);
  const at::Tensor gw = weight ? g * weight->to(acc) : g;
  const at::Tensor dx = rstd.unsqueeze(-1) * (gw - gw.mean(-1, true) - xhat * (gw * xhat).mean(-1, true));
  const at::Tensor dw = weight ? (g * xhat).sum(0).to(x.scalar_type()) : x.new_empty({0});
  const at::Tensor db = has_bias ? g.sum(0).to(x.scalar_type()) : x.new_empty({0});
  return {dx.to(x.scalar_type()).reshape(x.sizes()), dw, db};
}

inline void check_layer_norm_bwd_args(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& mean,
                                      const at::Tensor& rstd) {
  SPTR_CHECK_VALUE(grad.sizes() == x.sizes(), "grad must have x's shape ", x.sizes(), ", got ", grad.sizes());
  SPTR_CHECK_TYPE(grad.scalar_type() == x.scalar_type(), "grad must have x's dtype ", x.scalar_type());
  SPTR_CHECK_VALUE(x.dim() >= 1 && x.size(-1) > 0, "x must have a non-empty last dimension, got shape ", x.sizes());
  const int64_t rows = x.numel() / x.size(-1);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"mean", mean}, {"rstd", rstd}})
    SPTR_CHECK_VALUE(t.dim() == 1 && t.size(0) == rows && t.scalar_type() == at::toOpMathType(x.scalar_type()),
                     name, " must be a 1-D ", at::toOpMathType(x.scalar_type()), " tensor of ", rows,
                     " rows, got ", t.scalar_type(), " ", t.sizes());
}

}  // namespace sptr
