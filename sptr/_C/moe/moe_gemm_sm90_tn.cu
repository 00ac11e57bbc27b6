// The sm90 grouped GEMM of layout kTN (see moe_gemm_sm90.h), in its own translation unit for a parallel build.
#ifdef SPTR_WITH_SM90A
#include "moe_gemm_sm90.cuh"  // first: it sets NDEBUG for the whole unit

namespace sptr::sm90 {
void run_tn(at::ScalarType dtype, Dynamic dynamic, const std::vector<Problem>& problems, const at::Tensor& offsets,
            int64_t range_end) {
  run_layout<Layout::kTN>(dtype, dynamic, problems, offsets, range_end);
}
}  // namespace sptr::sm90
#endif
