// Element math of the fused window attention, shared by the CPU and CUDA kernels.
//
// Tokens are sorted by window; window w holds tokens [offsets[w], offsets[w+1]). Within a window every
// query attends to every key:
//   logit(i,j) = scale·(q_i·k_j + Σ_a q_i·Tq[rel_a(i,j), a]) + Σ_a k_j·Tk[rel_a(i,j), a]
//   out_i      = Σ_j p_ij·(v_j + Σ_a Tv[rel_a(i,j), a])
// (SparseTransformer's contextual mode with a pre-scaled query). The relative index of a pair comes from
// per-token quantised coordinates, so no per-pair tensor exists:
//   rel_a(i,j) = coords[i,a] − coords[j,a] + rel_shift,
// or, for column 2 when per-token radii are given, SphereFormer's exponential radial bin of r_i − r_j.
// Tables (L, 3, h, d) are read per head as rows n = rel·3 + a, so a per-token table of dot products
// (e.g. Qt[i][n] = q_i·Tq[n]) turns each pair's bias into three gathers.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SPTR_FHD __host__ __device__ __forceinline__
#else
#define SPTR_FHD inline
#endif

namespace sptr {

// Offset added to the radial bin; SphereFormer's exponential_split hard-codes 24 whatever the grid length.
constexpr int kRadialBinOffset = 24;

struct RelPosParams {
  const int32_t* coords = nullptr;  // (N, 3) quantised coordinates; null: no relative position
  const float* radius = nullptr;    // (N,) radii for the exponential radial bins of column 2; may be null
  int L = 0;                        // table length
  int rel_shift = 0;
  // exponential_split's float32 constants, evaluated as torch's CUDA kernels do (2a as a float, division
  // by a and by ln 2 as multiplication with float reciprocals).
  float a = 0.f, two_a = 0.f, inv_a = 0.f, inv_ln2 = 0.f;
};

SPTR_FHD int clamp_rel(int r, int L) { return r < 0 ? 0 : (r >= L ? L - 1 : r); }

// floor(logf(x) · inv_ln2) for x >= 2, as exponential_split evaluates floor(log2(x)). More than 2^9 ulps away
// from a power of two it is x's binary exponent, which costs no logarithm: the product's rounding moves it off
// the exponent at most 84 ulps from a power of two (tests/ops/test_radial_bin_log2.py checks every finite float
// >= 2, against the C++ compiler's logf and CUDA's).
SPTR_FHD float floor_log2_of(float x, float inv_ln2) {
  uint32_t bits;
#if defined(__CUDA_ARCH__)
  bits = __float_as_uint(x);
#else
  std::memcpy(&bits, &x, sizeof bits);
#endif
  const uint32_t mantissa = bits & 0x7FFFFFu, exponent = bits >> 23, band = 1u << 9;
  const bool inside = exponent < 255u && mantissa >= band && mantissa <= 0x7FFFFFu - band;
  if (inside) return static_cast<float>(static_cast<int>(exponent) - 127);
  return floorf(logf(x) * inv_ln2);
}

SPTR_FHD int radial_bin(float delta, const RelPosParams& p) {
  const float dist = fabsf(delta);
  float b = 2.f * floor_log2_of((dist + p.two_a) * p.inv_a, p.inv_ln2) - 2.f;
  const float edge = (3.f * exp2f(floorf(b * 0.5f)) - 2.f) * p.a;
  if (edge <= dist) b += 1.f;
  if (!(delta >= 0.f)) b = -b - 1.f;
  return static_cast<int>(b) + kRadialBinOffset;
}

// Table row n = rel·3 + a of pair (i, j) for column a, from the coordinates already loaded by the caller.
SPTR_FHD int rel_row(const RelPosParams& p, const int32_t* ci, const int32_t* cj, float ri, float rj, int a) {
  const int rel = (a == 2 && p.radius != nullptr) ? radial_bin(ri - rj, p) : ci[a] - cj[a] + p.rel_shift;
  return clamp_rel(rel, p.L) * 3 + a;
}

}  // namespace sptr
