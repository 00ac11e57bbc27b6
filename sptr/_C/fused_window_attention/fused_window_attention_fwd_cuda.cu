// CUDA forward of the fused window attention (flash-attention style over variable-size windows): the
// operands' checks and the head-dim dispatch; the kernels are in fused_window_attention_fwd.cuh, compiled per
// head-dim bucket by fused_window_attention_fwd_d<DP>.cu.
#include <torch/library.h>

#include "fused_window_attention_cuda.h"
#include "fused_window_attention_tiles.cuh"

namespace sptr {
namespace {

std::tuple<at::Tensor, at::Tensor> window_attention_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& offsets,
    const std::optional<at::Tensor>& coords, const std::optional<at::Tensor>& radius,
    const std::optional<at::Tensor>& table_q, const std::optional<at::Tensor>& table_k,
    const std::optional<at::Tensor>& table_v, int64_t rel_shift, double radial_a, double scale,
    bool /*deterministic: used by the backward*/) {
  const c10::cuda::CUDAGuard guard(q.device());
  FusedOperands o(q, k, v, offsets, coords, radius, table_q, table_k, table_v, rel_shift, radial_a);
  at::Tensor out = at::empty_like(o.q);
  at::Tensor lse = at::empty({o.N, o.H}, o.q.options().dtype(at::toOpMathType(o.q.scalar_type())));
  if (o.N == 0) return {out, lse};
  const at::Tensor bounds = token_bounds(o);
  dispatch_head_dim(o.d, [&](auto dp) {
    window_attention_fwd_head_dim<decltype(dp)::value>(o, scale, bounds, out, lse);
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(sptr, CUDA, m) { m.impl("window_attention_fwd", &window_attention_fwd_cuda); }

}  // namespace sptr
