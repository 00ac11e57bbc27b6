// CUDA backward of the fused window attention: the operands' checks, the buffers and the head-dim dispatch;
// the kernels are in fused_window_attention_bwd.cuh, compiled per head-dim bucket by
// fused_window_attention_bwd_d<DP>.cu.
#include <torch/library.h>

#include "fused_window_attention_cuda.h"
#include "fused_window_attention_tiles.cuh"

namespace sptr {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> window_attention_bwd_cuda(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& offsets, const std::optional<at::Tensor>& coords,
    const std::optional<at::Tensor>& radius, const std::optional<at::Tensor>& table_q,
    const std::optional<at::Tensor>& table_k, const std::optional<at::Tensor>& table_v, int64_t rel_shift,
    double radial_a, double scale, bool deterministic) {
  const c10::cuda::CUDAGuard guard(q.device());
  FusedOperands o(q, k, v, offsets, coords, radius, table_q, table_k, table_v, rel_shift, radial_a);
  check_backward_operands(o, grad, out, lse);
  BackwardTensors t;
  t.grad = grad.contiguous();
  t.out = out.contiguous();
  t.lse = lse.contiguous();
  t.dq = at::empty_like(o.q);
  t.dk = at::empty_like(o.k);
  t.dv = at::empty_like(o.v);
  // Table gradients: one partial per CTA (slot), summed by finish in slot order.
  auto finish = [&](const at::Tensor& partials, const at::Tensor& table) {
    return table.defined() ? table_grad_result(partials.sum(0), table) : partials;
  };
  if (o.N == 0) {  // zero table gradients: one zero slot each
    return {t.dq, t.dk, t.dv, finish(o.table_grad_buffer(o.table_q, 1), o.table_q),
            finish(o.table_grad_buffer(o.table_k, 1), o.table_k), finish(o.table_grad_buffer(o.table_v, 1), o.table_v)};
  }
  t.bounds = token_bounds(o);
  t.delta = at::empty_like(t.lse);
  t.counters = at::zeros({2, o.H}, o.offsets.options());
  dispatch_head_dim(o.d, [&](auto dp) {
    window_attention_bwd_head_dim<decltype(dp)::value>(o, t, scale, deterministic);
  });
  return {t.dq, t.dk, t.dv, finish(t.slots_q, o.table_q), finish(t.slots_k, o.table_k), finish(t.slots_v, o.table_v)};
}

}  // namespace

TORCH_LIBRARY_IMPL(sptr, CUDA, m) { m.impl("window_attention_bwd", &window_attention_bwd_cuda); }

}  // namespace sptr
