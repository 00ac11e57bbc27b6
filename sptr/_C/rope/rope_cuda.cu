// mRoPE on CUDA: one thread per (position, pair group) over the heads; strided loads, so transposed views
// need no copies.
#include <torch/library.h>

#include <sptr/cuda_utils.cuh>

#include "rope_host.h"

namespace sptr {
namespace {

constexpr int kThreads = 256;

// CTA = `positions` (b, s) positions × min(G, kThreads) threads (G = D / 2 / V pair groups per head) × one
// chunk of heads; the chunks of a tile are neighbouring CTAs, so the tables they share come from L2. A thread
// loads cos/sin of its pairs once (kept as stored), then rotates them for each head of its chunk, q heads
// first. Four CTAs per SM (64 registers, no spills) keep enough loads in flight; every pair belongs to one
// thread, which reads it before writing it, so in-place (out == x) stays exact.
template <int V, typename T, typename C, typename O, typename R>
__global__ void __launch_bounds__(kThreads, 4) mrope_rows_kernel(RopeArgs<T, C, O, R> p, int groups, int positions,
                                                                  int heads_per_chunk, int chunks) {
  const int lanes = groups < kThreads ? groups : kThreads;
  const int slot = threadIdx.x / lanes;
  const int64_t bs = static_cast<int64_t>(blockIdx.x / chunks) * positions + slot;
  if (slot >= positions || bs >= p.B * p.S) return;
  const int64_t b = bs / p.S, s = bs % p.S, half = p.D / 2;
  const int64_t heads = p.heads[0] + p.heads[1];
  const int64_t h_begin = static_cast<int64_t>(blockIdx.x % chunks) * heads_per_chunk;
  const int64_t h_end = h_begin + heads_per_chunk < heads ? h_begin + heads_per_chunk : heads;
  for (int g = threadIdx.x % lanes; g < groups; g += lanes) {
    const int64_t j0 = static_cast<int64_t>(g) * V;
    const auto tab = load_pair_tables<V>(p, b, s, j0);
    for (int64_t h = h_begin; h < h_end; ++h) {
      const int t = h < p.heads[0] ? 0 : 1;
      const T* x;
      O* out;
      head_rows(p, b, s, h, x, out);
      rotate_store<R>(load_pairs<V>(x, p.x_stride[t][3], j0, half), tab, p.backward, out, p.out_stride[t][3], j0,
                      half);
    }
  }
}

struct CudaRope {
  template <int V, typename T, typename C, typename O, typename R>
  static void run(const RopeArgs<T, C, O, R>& p) {
    const int64_t groups = p.D / 2 / V;
    SPTR_CHECK_VALUE(groups < (int64_t(1) << 31), "mRoPE on CUDA: head_dim ", p.D, " is too large");
    const int positions = static_cast<int>(std::max<int64_t>(1, kThreads / groups));
    const int64_t tiles = (p.B * p.S + positions - 1) / positions;
    // One head per chunk (each thread: one memory latency) unless the positions alone give ~8 waves of CTAs
    // (four per SM); then longer chunks share each table load between more heads.
    const int64_t heads = p.heads[0] + p.heads[1];
    const int64_t waves8 = 32 * static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
    const int64_t split = std::min<int64_t>(heads, std::max<int64_t>(1, (waves8 + tiles - 1) / tiles));
    const int64_t per_chunk = (heads + split - 1) / split, chunks = (heads + per_chunk - 1) / per_chunk;
    SPTR_CHECK_VALUE(tiles * chunks < (int64_t(1) << 31), "mRoPE on CUDA: B * S = ", p.B * p.S, " is too large");
    mrope_rows_kernel<V><<<static_cast<unsigned>(tiles * chunks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        p, static_cast<int>(groups), positions, static_cast<int>(per_chunk), static_cast<int>(chunks));
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
