// The sm90 grouped GEMM of layout kNN, tile k128x128 (moe_gemm_sm90.h), in its own translation unit.
#ifdef SPTR_WITH_SM90A
#include "moe_gemm_sm90.cuh"  // first: it sets NDEBUG for the whole unit

namespace sptr::sm90 {
template void run_layout<Layout::kNN, Tile::k128x128>(at::ScalarType, Dynamic, const std::vector<Problem>&,
                                                     const at::Tensor&, int64_t);
}  // namespace sptr::sm90
#endif
