// The points' check shared by the window-cell and spherical-coordinate ops: floating (N, 3).
#pragma once
#include <ATen/ATen.h>
#include <sptr/checks.h>

namespace sptr {

inline void check_xyz(const at::Tensor& xyz) {
  SPTR_CHECK_VALUE(xyz.dim() == 2 && xyz.size(1) == 3, "xyz must have shape (N, 3), got ", xyz.sizes());
  SPTR_CHECK_TYPE(at::isFloatingType(xyz.scalar_type()), "xyz must be a floating tensor, got ", xyz.scalar_type());
}

}  // namespace sptr
