// The fused window attention's CUDA backward kernels for head dims up to 64 (one bucket per translation unit).
#include "fused_window_attention_bwd.cuh"

namespace sptr {
template void window_attention_bwd_head_dim<64>(const FusedOperands&, BackwardTensors&, double, bool);
}  // namespace sptr
