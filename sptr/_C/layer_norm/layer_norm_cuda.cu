// LayerNorm on CUDA for rows of at most kMaxRow elements: one warp per row, a lane holding EPL of the row's
// elements (columns lane, lane + 32, ...) in registers, fp32 arithmetic. ATen's LayerNorm kernels run one
// thread block per row, which at SphereFormer's 32-64 channels leaves the GPU waiting on block scheduling
// (0.41 ms per forward at 270k rows of 32 on an H100, where the bytes take ~25 µs). Longer rows and fp64 take
// the ATen form of layer_norm_host.h.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <sptr/cuda_utils.cuh>
#include <sptr/dispatch.h>

#include "layer_norm_host.h"

namespace sptr {
namespace {

constexpr int kMaxRow = 1024;
constexpr int kWarpsPerBlock = 8;
// The backward's weight and bias gradients are sums over rows: each warp sums its rows in order, then the
// per-warp partials are summed by ATen. A fixed warp count (not one from the device's SM count) keeps the
// order, and so the bits, the same on every GPU.
constexpr int64_t kBackwardWarps = 4096;

template <typename T, int EPL>
__global__ void layer_norm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                                      int64_t rows, int C, float eps, T* __restrict__ y, float* __restrict__ mean,
                                      float* __restrict__ rstd) {
  const int lane = threadIdx.x & 31;
  const int64_t first = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = ((int64_t)gridDim.x * blockDim.x) >> 5;
  float wv[EPL], bv[EPL];
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int c = lane + 32 * i;
    wv[i] = c < C && w ? static_cast<float>(w[c]) : 1.f;
    bv[i] = c < C && b ? static_cast<float>(b[c]) : 0.f;
  }
  for (int64_t r = first; r < rows; r += warps) {
    const T* xr = x + r * C;
    float v[EPL], s = 0.f;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const int c = lane + 32 * i;
      v[i] = c < C ? static_cast<float>(xr[c]) : 0.f;
      s += v[i];
    }
    const float mu = warp_sum(s) / C;
    float q = 0.f;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const float d = lane + 32 * i < C ? v[i] - mu : 0.f;
      q += d * d;
    }
    const float rs = rsqrtf(warp_sum(q) / C + eps);
    T* yr = y + r * C;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const int c = lane + 32 * i;
      if (c < C) yr[c] = static_cast<T>((v[i] - mu) * rs * wv[i] + bv[i]);
    }
    if (lane == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

// dx = rstd (g w - mean(g w) - xhat mean(g w xhat)); warp k of `warps` takes rows k, k + warps, ..., and its
// sums of g xhat and g over them go to row k of dw_part / db_part ([warps, C]).
template <typename T, int EPL>
__global__ void layer_norm_bwd_kernel(const T* __restrict__ g, const T* __restrict__ x, const float* __restrict__ mean,
                                      const float* __restrict__ rstd, const T* __restrict__ w, int64_t rows, int C,
                                      int64_t warps, T* __restrict__ dx, float* __restrict__ dw_part,
                                      float* __restrict__ db_part) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  if (warp >= warps) return;
  float wv[EPL], dw[EPL], db[EPL];
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int c = lane + 32 * i;
    wv[i] = c < C && w ? static_cast<float>(w[c]) : 1.f;
    dw[i] = db[i] = 0.f;
  }
  for (int64_t r = warp; r < rows; r += warps) {
    const float mu = mean[r], rs = rstd[r];
    float xh[EPL], gw[EPL], s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const int c = lane + 32 * i;
      const float gv = c < C ? static_cast<float>(g[r * C + c]) : 0.f;
      xh[i] = c < C ? (static_cast<float>(x[r * C + c]) - mu) * rs : 0.f;
      gw[i] = gv * wv[i];
      s1 += gw[i];
      s2 += gw[i] * xh[i];
      dw[i] += gv * xh[i];
      db[i] += gv;
    }
    s1 = warp_sum(s1) / C;
    s2 = warp_sum(s2) / C;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const int c = lane + 32 * i;
      if (c < C) dx[r * C + c] = static_cast<T>(rs * (gw[i] - s1 - xh[i] * s2));
    }
  }
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int c = lane + 32 * i;
    if (c < C) {
      dw_part[warp * C + c] = dw[i];
      db_part[warp * C + c] = db[i];
    }
  }
}

// Elements per lane: the smallest of 1, 2, 4, ..., 32 that covers C.
template <typename F>
void with_epl(int C, F&& f) {
  if (C <= 32) f(std::integral_constant<int, 1>());
  else if (C <= 64) f(std::integral_constant<int, 2>());
  else if (C <= 128) f(std::integral_constant<int, 4>());
  else if (C <= 256) f(std::integral_constant<int, 8>());
  else if (C <= 512) f(std::integral_constant<int, 16>());
  else f(std::integral_constant<int, 32>());
}

bool warp_kernel_takes(const at::Tensor& x) {
  return x.size(-1) <= kMaxRow && x.scalar_type() != at::kDouble;
}

template <typename T>
const T* optional_ptr(const std::optional<at::Tensor>& t) {
  return t ? t->const_data_ptr<T>() : nullptr;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_cuda(const at::Tensor& x_in,
                                                                   const std::optional<at::Tensor>& w_in,
                                                                   const std::optional<at::Tensor>& b_in,
                                                                   double eps) {
  c10::cuda::CUDAGuard guard(x_in.device());
  check_layer_norm_args(x_in, w_in, b_in);
  if (!warp_kernel_takes(x_in)) return layer_norm_fwd_aten(x_in, w_in, b_in, eps);
  const at::Tensor x = x_in.contiguous();
  const std::optional<at::Tensor> w = w_in ? std::optional(w_in->contiguous()) : std::nullopt;
  const std::optional<at::Tensor> b = b_in ? std::optional(b_in->contiguous()) : std::nullopt;
  const int C = static_cast<int>(x.size(-1));
  const int64_t rows = x.numel() / C;
  auto y = at::empty_like(x);
  auto mean = at::empty({rows}, x.options().dtype(at::kFloat)), rstd = at::empty({rows}, mean.options());
  if (rows == 0) return {y, mean, rstd};
  const unsigned blocks = grid_for(rows, kWarpsPerBlock);
  SPTR_DISPATCH_FLOATING(x.scalar_type(), "layer_norm_fwd_cuda", [&] {
    with_epl(C, [&](auto epl) {
      layer_norm_fwd_kernel<scalar_t, decltype(epl)::value><<<blocks, 32 * kWarpsPerBlock, 0,
                                                              at::cuda::getCurrentCUDAStream()>>>(
          x.const_data_ptr<scalar_t>(), optional_ptr<scalar_t>(w), optional_ptr<scalar_t>(b), rows, C,
          static_cast<float>(eps), y.mutable_data_ptr<scalar_t>(), mean.mutable_data_ptr<float>(),
          rstd.mutable_data_ptr<float>());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_cuda(const at::Tensor& grad_in, const at::Tensor& x_in,
                                                                   const at::Tensor& mean, const at::Tensor& rstd,
                                                                   const std::optional<at::Tensor>& w_in,
                                                                   bool has_bias) {
  c10::cuda::CUDAGuard guard(x_in.device());
  check_layer_norm_bwd_args(grad_in, x_in, mean, rstd);
  if (!warp_kernel_takes(x_in) || x_in.numel() == 0) return layer_norm_bwd_aten(grad_in, x_in, mean, rstd, w_in, has_bias);
  const at::Tensor x = x_in.contiguous(), g = grad_in.contiguous(), mu = mean.contiguous(), rs = rstd.contiguous();
  const std::optional<at::Tensor> w = w_in ? std::optional(w_in->contiguous()) : std::nullopt;
  const int C = static_cast<int>(x.size(-1));
  const int64_t rows = x.numel() / C;
  const int64_t warps = std::min(rows, kBackwardWarps);
  auto dx = at::empty_like(x);
  auto part = at::empty({2, warps, C}, x.options().dtype(at::kFloat));
  SPTR_DISPATCH_FLOATING(x.scalar_type(), "layer_norm_bwd_cuda", [&] {
    with_epl(C, [&](auto epl) {
      const unsigned blocks = static_cast<unsigned>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
      layer_norm_bwd_kernel<scalar_t, decltype(epl)::value><<<blocks, 32 * kWarpsPerBlock, 0,
                                                              at::cuda::getCurrentCUDAStream()>>>(
          g.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), mu.const_data_ptr<float>(),
          rs.const_data_ptr<float>(), optional_ptr<scalar_t>(w), rows, C, warps, dx.mutable_data_ptr<scalar_t>(),
          part[0].mutable_data_ptr<float>(), part[1].mutable_data_ptr<float>());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  const at::Tensor dw = w ? part[0].sum(0).to(x.scalar_type()) : x.new_empty({0});
  const at::Tensor db = has_bias ? part[1].sum(0).to(x.scalar_type()) : x.new_empty({0});
  return {dx, dw, db};
}

}  // namespace

TORCH_LIBRARY_IMPL(sptr, CUDA, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_cuda);
  m.impl("layer_norm_bwd", &layer_norm_bwd_cuda);
}

}  // namespace sptr
