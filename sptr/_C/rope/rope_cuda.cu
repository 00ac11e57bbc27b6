// mRoPE on CUDA: one thread per rotation pair; strided loads, so transposed views need no copies.
#include <torch/library.h>

#include <sptr/cuda_utils.cuh>

#include "rope_host.h"

namespace sptr {
namespace {

template <typename T, typename C>
__global__ void mrope_kernel(RopeArgs<T, C> p) {
  const int64_t half = p.D / 2, total = p.B * p.H * p.S * half;
  SPTR_GRID_STRIDE(e, total) {
    const int64_t j = e % half, r = e / half;
    rope_pair(p, r / (p.H * p.S), (r / p.S) % p.H, r % p.S, j);
  }
}

struct CudaRope {
  template <typename T, typename C>
  static void launch(const RopeArgs<T, C>& p) {
    const int64_t total = p.B * p.H * p.S * (p.D / 2);
    if (total == 0) return;
    mrope_kernel<T, C><<<grid_for(total, 256), 256, 0, at::cuda::getCurrentCUDAStream()>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};


}  // namespace

TORCH_LIBRARY_IMPL(sptr, CUDA, m) {
  m.impl("mrope_fwd", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& c, const at::Tensor& s,
                         at::IntArrayRef sec, bool hf) {
    c10::cuda::CUDAGuard guard(q.device());
    return mrope_fwd_impl<CudaRope>(q, k, c, s, sec, hf);
  });
  m.impl("mrope_fwd_out", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& c, const at::Tensor& s,
                             at::IntArrayRef sec, bool hf, const at::Tensor& qo, const at::Tensor& ko) {
    c10::cuda::CUDAGuard guard(q.device());
    mrope_fwd_out_impl<CudaRope>(q, k, c, s, sec, hf, qo, ko);
  });
  m.impl("mrope_", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& c, const at::Tensor& s,
                      at::IntArrayRef sec, bool hf) {
    c10::cuda::CUDAGuard guard(q.device());
    mrope_inplace_impl<CudaRope>(q, k, c, s, sec, hf);
  });
  m.impl("mrope_bwd", [](const at::Tensor& gq, const at::Tensor& gk, const at::Tensor& c, const at::Tensor& s,
                         at::IntArrayRef sec, bool hf) {
    c10::cuda::CUDAGuard guard(gq.device());
    return mrope_bwd_impl<CudaRope>(gq, gk, c, s, sec, hf);
  });
}

}  // namespace sptr
