#include <ATen/Parallel.h>
#include <torch/library.h>

#include "rope_host.h"

namespace sptr {
namespace {

struct CpuRope {
  template <typename Args>
  static void launch(const Args& p) {
    const int64_t half = p.D / 2, rows = p.B * p.H * p.S;
    at::parallel_for(0, rows * half, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) {
        const int64_t j = e % half, r = e / half;
        rope_pair(p, r / (p.H * p.S), (r / p.S) % p.H, r % p.S, j);
      }
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(sptr, CPU, m) {
  m.impl("mrope_fwd", &mrope_fwd_impl<CpuRope>);
  m.impl("mrope_fwd_out", &mrope_fwd_out_impl<CpuRope>);
  m.impl("mrope_", &mrope_inplace_impl<CpuRope>);
  m.impl("mrope_bwd", &mrope_bwd_impl<CpuRope>);
}

}  // namespace sptr
