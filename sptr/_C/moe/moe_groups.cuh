// How the grouped MoE kernels read device-side group offsets (int64 [G + 1]; group g owns [off[g], off[g+1])
// of a dimension of length `end`): each offset clamped into [0, end], an inverted range empty, so unchecked
// offsets stay memory-safe.
#pragma once
#include <cstdint>

namespace sptr {

__device__ __forceinline__ int64_t clamped_offset(const int64_t* offsets, int64_t i, int64_t end) {
  return min(max(offsets[i], (int64_t)0), end);
}

__device__ __forceinline__ void group_range(const int64_t* offsets, int64_t g, int64_t end, int64_t& lo, int64_t& hi) {
  lo = clamped_offset(offsets, g, end);
  hi = max(clamped_offset(offsets, g + 1, end), lo);
}

// The group of index r in [0, end), or -1: the same groups as group_range gives, read from the raw offsets
// (callers keep a copy in shared memory).
__device__ __forceinline__ int find_group(const int64_t* off, int G, int64_t r) {
  for (int g = 0; g < G; ++g)
    if (r >= off[g] && r < off[g + 1]) return g;
  return -1;
}

}  // namespace sptr
