#include <torch/library.h>

#include "layer_norm_host.h"

namespace sptr {

TORCH_LIBRARY_IMPL(sptr, CPU, m) {
  m.impl("layer_norm_fwd", [](const at::Tensor& x, const std::optional<at::Tensor>& w,
                              const std::optional<at::Tensor>& b, double eps) {
    check_layer_norm_args(x, w, b);
    return layer_norm_fwd_aten(x, w, b, eps);
  });
  m.impl("layer_norm_bwd", [](const at::Tensor& grad, const at::Tensor& x, const at::Tensor& mean,
                              const at::Tensor& rstd, const std::optional<at::Tensor>& w, bool has_bias) {
    check_layer_norm_bwd_args(grad, x, mean, rstd);
    return layer_norm_bwd_aten(grad, x, mean, rstd, w, has_bias);
  });
}

}  // namespace sptr
