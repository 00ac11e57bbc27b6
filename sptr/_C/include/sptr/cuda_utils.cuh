#pragma once
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <algorithm>
#include <cstdint>

namespace sptr {

// Grid for a grid-stride loop over `n` items: enough blocks to fill the device, never zero.
inline unsigned int grid_for(int64_t n, int threads) {
  int64_t want = (n + threads - 1) / threads;
  int64_t cap = static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 32;
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min(want, cap)));
}

#define SPTR_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); i += (int64_t)blockDim.x * gridDim.x)

}  // namespace sptr
