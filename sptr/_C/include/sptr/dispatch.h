// One dtype switch for all floating kernels: fp32, fp64, fp16, bf16. Accumulation type is
// at::opmath_type<scalar_t> (fp32 for the 16-bit types, else the type itself).
#pragma once
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#define SPTR_DISPATCH_FLOATING(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)
