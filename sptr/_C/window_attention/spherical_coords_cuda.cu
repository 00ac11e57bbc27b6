// cart2sphere on CUDA: float32 (what the SphereFormer block runs) in one kernel instead of 16 elementwise ops and
// a stack; other dtypes take the chain of ATen ops (spherical_coords.h). The float32 kernel rounds each step as
// ATen's CUDA op does: x ** 2 is x · x; a tensor plus or times a Python number computes in float with the number
// rounded to float; a tensor divided by a number is multiplied by the number's float reciprocal (ATen's CUDA
// division by a CPU scalar); atan2 and sqrt are CUDA's atan2f and sqrtf. The _rn intrinsics keep the compiler
// from fusing a product and a sum into one FMA, which the separate ops never do.
#include <torch/library.h>

#include <sptr/cuda_utils.cuh>

#include "spherical_coords.h"

namespace sptr {
namespace {

struct SphereConstants {
  float pi, inv_pi;  // float(π) and ATen's float reciprocal 1 / float(π)
};

__global__ void cart2sphere_kernel(const float* __restrict__ xyz, int64_t n, int64_t row_stride, int64_t col_stride,
                                   SphereConstants k, float* __restrict__ out) {
  SPTR_GRID_STRIDE(i, n) {
    const float* p = xyz + i * row_stride;
    const float x = p[0], y = p[col_stride], z = p[2 * col_stride];
    const float xy2 = __fadd_rn(__fmul_rn(x, x), __fmul_rn(y, y));
    out[3 * i] = __fmul_rn(__fmul_rn(__fadd_rn(atan2f(y, x), k.pi), 180.f), k.inv_pi);
    out[3 * i + 1] = __fmul_rn(__fmul_rn(atan2f(sqrtf(xy2), z), 180.f), k.inv_pi);
    out[3 * i + 2] = sqrtf(__fadd_rn(xy2, __fmul_rn(z, z)));
  }
}

at::Tensor cart2sphere_cuda(const at::Tensor& xyz) {
  check_xyz(xyz);
  if (xyz.scalar_type() != at::kFloat) return cart2sphere_ops(xyz);
  const c10::cuda::CUDAGuard guard(xyz.device());
  auto out = at::empty({xyz.size(0), 3}, xyz.options());
  if (xyz.size(0) == 0) return out;
  const float pi = static_cast<float>(M_PI);
  constexpr int kThreads = 256;
  cart2sphere_kernel<<<grid_for(xyz.size(0), kThreads), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      xyz.const_data_ptr<float>(), xyz.size(0), xyz.stride(0), xyz.stride(1), SphereConstants{pi, 1.0f / pi},
      out.mutable_data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(sptr, CUDA, m) { m.impl("cart2sphere", &cart2sphere_cuda); }

}  // namespace sptr
