// mRoPE on CUDA: one thread per rotation pair; strided loads, so transposed views need no copies.
#include <torch/library.h>

#include <sptr/cuda_utils.cuh>

#include "rope_host.h"

namespace sptr {
namespace {

// One thread per (b, s, head, group of V pairs); neighbouring threads take neighbouring 16-byte chunks.
template <int V, class Args>
__global__ void mrope_kernel(Args p) {
  SPTR_GRID_STRIDE(e, p.B * p.S * (p.heads[0] + p.heads[1]) * (p.D / 2 / V)) { rope_item<V>(p, e); }
}

struct CudaRope {
  template <int V, class Args>
  static void run(const Args& p) {
    const int64_t total = p.B * p.S * (p.heads[0] + p.heads[1]) * (p.D / 2 / V);
    mrope_kernel<V, Args><<<grid_for(total, 256), 256, 0, at::cuda::getCurrentCUDAStream()>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  template <typename T, typename C, typename O, typename R>
  static void launch(RopeArgs<T, C, O, R> p) {
    if (p.B * p.S * p.D * (p.heads[0] + p.heads[1]) == 0) return;
    constexpr int kWide = 16 / sizeof(T) > 1 ? 16 / sizeof(T) : 1;
    if (kWide > 1 && rope_vector_width(p) == kWide) run<kWide>(p);
    else run<1>(p);
  }
};


}  // namespace

TORCH_LIBRARY_IMPL(sptr, CUDA, m) {
  m.impl("mrope_fwd", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& c, const at::Tensor& s,
                         at::IntArrayRef sec, bool hf, bool promote) {
    c10::cuda::CUDAGuard guard(q.device());
    return mrope_fwd_impl<CudaRope>(q, k, c, s, sec, hf, promote);
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
                         at::IntArrayRef sec, bool hf, std::optional<at::ScalarType> input_dtype) {
    c10::cuda::CUDAGuard guard(gq.device());
    return mrope_bwd_impl<CudaRope>(gq, gk, c, s, sec, hf, input_dtype);
  });
}

}  // namespace sptr
