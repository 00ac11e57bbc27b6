// The CUDA fused window attention split by head-dim bucket (16, 32, 64, 128): the entry points
// (fused_window_attention_{fwd,bwd}_cuda.cu) check the operands and call the bucket's function, which
// fused_window_attention_{fwd,bwd}_d<DP>.cu instantiate, one translation unit each, so that the build
// compiles the kernels in parallel.
#pragma once
#include <ATen/ATen.h>

#include "fused_window_attention_host.h"

namespace sptr {

// Forward of head-dim bucket DP, every dtype: writes out and lse.
template <int DP>
void window_attention_fwd_head_dim(const FusedOperands& o, double scale, const at::Tensor& bounds, at::Tensor& out,
                                   at::Tensor& lse);

// The backward's inputs (contiguous) and outputs; the table-gradient slots are made by the bucket's
// launcher, which knows its grids.
struct BackwardTensors {
  at::Tensor grad, out, lse, bounds, delta, counters, dq, dk, dv;
  at::Tensor slots_q, slots_k, slots_v;
};

// Backward of head-dim bucket DP, every dtype: fills dq, dk, dv and the table-gradient slots.
template <int DP>
void window_attention_bwd_head_dim(const FusedOperands& o, BackwardTensors& t, double scale, bool deterministic);

}  // namespace sptr
