#include <ATen/Parallel.h>
#include <torch/library.h>

#include "rope_host.h"

namespace sptr {
namespace {

struct CpuRope {
  template <typename Args>
  static void launch(const Args& p) {
    const int64_t items = p.B * p.S * (p.heads[0] + p.heads[1]) * (p.D / 2);
    at::parallel_for(0, items, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) rope_item<1>(p, e);
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(sptr, CPU, m) {
  m.impl("mrope_fwd", &mrope_fwd_impl<CpuRope>);
  m.impl("mrope_fwd_out", &mrope_fwd_out_impl<CpuRope>);
  m.impl("mrope_", &mrope_inplace_impl<CpuRope>);
  m.impl("mrope_rebased_", &mrope_rebased_impl<CpuRope>);
  m.impl("mrope_bwd", &mrope_bwd_impl<CpuRope>);
  m.impl("mrope_bwd_", &mrope_inplace_impl<CpuRope, true>);
}

}  // namespace sptr
