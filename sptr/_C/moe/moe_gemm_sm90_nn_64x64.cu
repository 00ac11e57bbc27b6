// The sm90 grouped GEMM of layout kNN (moe_gemm_sm90.h), 64x64 tiles, in its own translation unit.
#ifdef SPTR_WITH_SM90A
#include "moe_gemm_sm90.cuh"  // first: it sets NDEBUG for the whole unit

SPTR_SM90_INSTANTIATE(kNN, Tiles64x64)
#endif
