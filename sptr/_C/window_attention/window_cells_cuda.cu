// window_cells and window_quantised_coords on CUDA: one thread per point after the frame's reduction (the rules
// and their checks: window_cells.h). The frame stays on the device: no host sync.
#include <torch/library.h>

#include <sptr/cuda_utils.cuh>
#include <sptr/dispatch.h>

#include "window_cells.h"

namespace sptr {
namespace {

template <typename T>
__global__ void window_cells_kernel(CellArgs<T> a, int64_t n, int64_t* __restrict__ keys) {
  SPTR_GRID_STRIDE(i, n) keys[i] = window_cell_key(a, i);
}

template <typename T>
__global__ void window_quantised_coords_kernel(QuantArgs<T> a, int64_t n, int32_t* __restrict__ coords) {
  SPTR_GRID_STRIDE(j, n) quantised_cells(a, j, coords);
}

constexpr int kThreads = 256;

at::Tensor window_cells_cuda(const at::Tensor& xyz, const at::Tensor& batch, const at::Tensor& size,
                             const std::optional<at::Tensor>& start, bool shift) {
  const c10::cuda::CUDAGuard guard(xyz.device());
  const CellFrame f = window_cell_frame(xyz, batch, size, start, shift);
  auto keys = at::empty({xyz.size(0)}, xyz.options().dtype(at::kLong));
  if (xyz.size(0) == 0) return keys;
  SPTR_DISPATCH_FLOATING(xyz.scalar_type(), "window_cells_cuda", [&] {
    window_cells_kernel<scalar_t><<<grid_for(xyz.size(0), kThreads), kThreads, 0,
                                    at::cuda::getCurrentCUDAStream()>>>(cell_args<scalar_t>(f, shift), xyz.size(0),
                                                                        keys.mutable_data_ptr<int64_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return keys;
}

at::Tensor window_quantised_coords_cuda(const at::Tensor& xyz, const std::optional<at::Tensor>& order,
                                        const at::Tensor& window, const at::Tensor& quant, bool shift) {
  const c10::cuda::CUDAGuard guard(xyz.device());
  const QuantFrame f = quantised_cell_frame(xyz, order, window, quant);
  auto coords = at::empty({xyz.size(0), 3}, xyz.options().dtype(at::kInt));
  if (xyz.size(0) == 0) return coords;
  SPTR_DISPATCH_FLOATING(xyz.scalar_type(), "window_quantised_coords_cuda", [&] {
    window_quantised_coords_kernel<scalar_t><<<grid_for(xyz.size(0), kThreads), kThreads, 0,
                                               at::cuda::getCurrentCUDAStream()>>>(
        quant_args<scalar_t>(f, shift), xyz.size(0), coords.mutable_data_ptr<int32_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return coords;
}

}  // namespace

TORCH_LIBRARY_IMPL(sptr, CUDA, m) {
  m.impl("window_cells", &window_cells_cuda);
  m.impl("window_quantised_coords", &window_quantised_coords_cuda);
}

}  // namespace sptr
