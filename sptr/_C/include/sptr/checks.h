// Argument checks shared by every op: TORCH_CHECK with the argument's name, so a bad call reads as a
// Python error naming what was wrong (the Python wrappers check first; these guard direct op calls).
#pragma once
#include <ATen/ATen.h>

#define SPTR_CHECK_DIM(x, n) \
  TORCH_CHECK_VALUE((x).dim() == (n), #x " must be a ", (n), "-D tensor, got shape ", (x).sizes())
#define SPTR_CHECK_SAME_DEVICE(x, y) \
  TORCH_CHECK_VALUE((x).device() == (y).device(), #x " is on ", (x).device(), " but " #y " is on ", (y).device())
#define SPTR_CHECK_SAME_DTYPE(x, y) \
  TORCH_CHECK_TYPE((x).scalar_type() == (y).scalar_type(), #x " has dtype ", (x).scalar_type(), \
                   " but " #y " has dtype ", (y).scalar_type())
#define SPTR_CHECK_INDEX_DTYPE(x)                                                              \
  TORCH_CHECK_TYPE((x).scalar_type() == at::kInt || (x).scalar_type() == at::kLong, #x        \
                   " must be int32 or int64, got ", (x).scalar_type())
#define SPTR_CHECK_FLOATING(x)                                                                     \
  TORCH_CHECK_TYPE(at::isFloatingType((x).scalar_type()) && (x).scalar_type() != at::kFloat8_e4m3fn, \
                   #x " must be float16, bfloat16, float32 or float64, got ", (x).scalar_type())
