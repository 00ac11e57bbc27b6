// The fused window attention's CUDA forward kernels for head dims up to 64 (one bucket per translation unit).
#include "fused_window_attention_fwd.cuh"

namespace sptr {
template void window_attention_fwd_head_dim<64>(const FusedOperands&, double, const at::Tensor&, at::Tensor&,
                                                   at::Tensor&);
}  // namespace sptr
