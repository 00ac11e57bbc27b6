// Dtype-erased read views for index tensors. Index and rel_idx tensors come in several integer widths;
// reading them through a width chosen at run time (a warp-uniform branch) keeps one kernel instantiation
// per floating dtype instead of one per (float, index, rel) combination.
#pragma once
#include <ATen/ATen.h>
#include <cstdint>

#if defined(__CUDACC__)
#define SPTR_HD __host__ __device__ __forceinline__
#else
#define SPTR_HD inline
#endif

namespace sptr {

struct IntView {
  const void* ptr = nullptr;
  int bytes = 4;

  SPTR_HD int64_t operator[](int64_t i) const {
    switch (bytes) {
      case 1: return static_cast<const int8_t*>(ptr)[i];
      case 2: return static_cast<const int16_t*>(ptr)[i];
      case 4: return static_cast<const int32_t*>(ptr)[i];
      default: return static_cast<const int64_t*>(ptr)[i];
    }
  }
};

// `t` must be contiguous and of an integral dtype; an undefined tensor gives a null view.
inline IntView int_view(const at::Tensor& t) {
  IntView v;
  if (t.defined()) {
    v.ptr = t.data_ptr();
    v.bytes = static_cast<int>(t.element_size());
  }
  return v;
}

}  // namespace sptr
