#pragma once
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <algorithm>
#include <cstdint>
#include <utility>

namespace sptr {

// Grid for a grid-stride loop over `n` items: enough blocks to fill the device, never zero.
inline unsigned int grid_for(int64_t n, int threads) {
  int64_t want = (n + threads - 1) / threads;
  int64_t cap = static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 32;
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min(want, cap)));
}

#define SPTR_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); i += (int64_t)blockDim.x * gridDim.x)

// Sum of v over the 32 lanes of a full warp, every lane gets it (a butterfly: the same order in every lane).
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
  return v;
}

// Programmatic dependent launch (sm_90+): a kernel started by launch_after_previous may begin while the kernel
// before it on the stream still runs, so it calls wait_for_previous_grid() before touching memory at all (the
// wait returns once that kernel has finished and its writes are visible; a no-op for an ordinary launch and
// before sm_90). allow_next_grid() lets the next such kernel be launched now instead of at this kernel's end:
// its launch then overlaps this kernel's work, which is what chains of small kernels lose most time to.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...) with a launch attribute (none if `attribute` is null).
template <typename... Params, typename... Args>
void launch_with(const cudaLaunchAttribute* attribute, void (*kernel)(Params...), dim3 grid, dim3 block,
                 size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attrs[1];
  if (attribute != nullptr) attrs[0] = *attribute;
  config.attrs = attrs;
  config.numAttrs = attribute != nullptr ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// kernel<<<grid, block, smem, stream>>>(args...) as a programmatic dependent of the previous kernel on the
// stream on sm_90+ (an ordinary launch elsewhere); the kernel must start with wait_for_previous_grid().
template <typename... Params, typename... Args>
void launch_after_previous(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                           Args&&... args) {
  cudaLaunchAttribute overlap{};
  overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap.val.programmaticStreamSerializationAllowed = 1;
  launch_with(at::cuda::getCurrentDeviceProperties()->major >= 9 ? &overlap : nullptr, kernel, grid, block, smem,
              stream, std::forward<Args>(args)...);
}

}  // namespace sptr
