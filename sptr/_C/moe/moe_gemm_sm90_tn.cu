// The sm90 grouped GEMM of layout kTN (moe_gemm_sm90.h), 128x256 tiles, in its own translation unit.
#ifdef SPTR_WITH_SM90A
#include "moe_gemm_sm90.cuh"  // first: it sets NDEBUG for the whole unit

SPTR_SM90_INSTANTIATE(kTN, Tiles128x256)
#endif
