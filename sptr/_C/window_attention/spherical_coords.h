// cart2sphere: SphereFormer's spherical coordinates (θ, β, r) of each point, θ = (atan2(y, x) + π)·180/π,
// β = atan2(√(x² + y²), z)·180/π, r = √(x² + y² + z²) (degrees, metres). The published rule is a chain of
// elementwise torch ops; `cart2sphere_ops` is that chain (the CPU kernel, the CUDA kernel's other dtypes, and
// the differentiable path), and CUDA's float32 kernel computes the same chain in one pass, each step rounded as
// the CUDA op rounds it.
#pragma once
#include <ATen/ATen.h>
#include "check_xyz.h"

#include <cmath>

namespace sptr {

// The published chain, op by op (x² + y² once for both uses: r's x² + y² + z² adds in the same order).
inline at::Tensor cart2sphere_ops(const at::Tensor& xyz) {
  check_xyz(xyz);
  const at::Tensor x = xyz.select(1, 0), y = xyz.select(1, 1), z = xyz.select(1, 2);
  const at::Tensor xy2 = x.pow(2) + y.pow(2);
  const at::Tensor theta = (at::atan2(y, x) + M_PI) * 180 / M_PI;
  const at::Tensor beta = at::atan2(xy2.sqrt(), z) * 180 / M_PI;
  const at::Tensor r = (xy2 + z.pow(2)).sqrt();
  return at::stack({theta, beta, r}, -1);
}

}  // namespace sptr
