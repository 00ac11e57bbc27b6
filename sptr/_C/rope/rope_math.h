// Multimodal RoPE element math shared by the CPU and CUDA kernels.
//
// Each work item owns one rotation pair (d, d + D/2) of one (batch, head, position), so reading both inputs
// before writing makes true in-place operation (out == x) safe. The arithmetic reproduces transformers'
// eager expression `x * cos + rotate_half(x) * sin` evaluated in x's dtype: each product and the sum are
// rounded to T (fp32 products of fp16/bf16 operands are exact, so this equals PyTorch's own rounding), with
// no fused multiply-add. The backward is the matching transpose, rounded the way autograd rounds it.
#pragma once
#include <ATen/OpMathType.h>
#include <sptr/views.h>

namespace sptr {

template <typename T, typename C>
struct RopeArgs {
  const T* x = nullptr;
  T* out = nullptr;
  int64_t x_stride[4] = {0, 0, 0, 0};    // [B, H, S, D]
  int64_t out_stride[4] = {0, 0, 0, 0};
  const C* cos = nullptr;
  const C* sin = nullptr;
  int64_t cs_stride[4] = {0, 0, 0, 0};   // [stream, B, S, D]; stream stride 0 for composed tables
  int64_t B = 0, H = 0, S = 0, D = 0;
  int64_t c1 = 0, c2 = 0;                // section ends (half-dim units): streams [0,c1), [c1,c2), [c2,D/2)
  bool hf_layout = true, composed = false, backward = false;
};

SPTR_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
SPTR_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
SPTR_HD double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
SPTR_HD double add_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

template <typename T, typename C>
SPTR_HD int64_t rope_stream(const RopeArgs<T, C>& p, int64_t d) {
  if (p.composed) return 0;
  const int64_t j = p.hf_layout ? d % (p.D / 2) : d / 2;  // Wall-X: doubled sections over contiguous dims
  return j < p.c1 ? 0 : (j < p.c2 ? 1 : 2);
}

template <typename T, typename A>
SPTR_HD A round_to(A v) {
  return static_cast<A>(static_cast<T>(v));
}

// Rotates pair j of row (b, h, s).
template <typename T, typename C, typename A = at::opmath_type<T>>
SPTR_HD void rope_pair(const RopeArgs<T, C>& p, int64_t b, int64_t h, int64_t s, int64_t j) {
  const int64_t half = p.D / 2, d0 = j, d1 = j + half;
  const int64_t xb = b * p.x_stride[0] + h * p.x_stride[1] + s * p.x_stride[2];
  const int64_t ob = b * p.out_stride[0] + h * p.out_stride[1] + s * p.out_stride[2];
  const int64_t cb = b * p.cs_stride[1] + s * p.cs_stride[2];
  const int64_t t0 = rope_stream(p, d0) * p.cs_stride[0] + cb, t1 = rope_stream(p, d1) * p.cs_stride[0] + cb;
  // cos/sin take part in x's dtype, as in transformers (which casts the tables to the activation dtype).
  const A c0 = round_to<T>(A(p.cos[t0 + d0 * p.cs_stride[3]])), s0 = round_to<T>(A(p.sin[t0 + d0 * p.cs_stride[3]]));
  const A c1 = round_to<T>(A(p.cos[t1 + d1 * p.cs_stride[3]])), s1 = round_to<T>(A(p.sin[t1 + d1 * p.cs_stride[3]]));
  const A a = A(p.x[xb + d0 * p.x_stride[3]]), z = A(p.x[xb + d1 * p.x_stride[3]]);
  A o0, o1;
  if (!p.backward) {  // out = x*cos + rotate_half(x)*sin, rotate_half(x) = (-x2, x1)
    o0 = add_rn(round_to<T>(mul_rn(a, c0)), round_to<T>(mul_rn(-z, s0)));
    o1 = add_rn(round_to<T>(mul_rn(z, c1)), round_to<T>(mul_rn(a, s1)));
  } else {            // gx = g*cos + rotate_half^T(g*sin), rotate_half^T(y) = (y2, -y1)
    o0 = add_rn(round_to<T>(mul_rn(a, c0)), round_to<T>(mul_rn(z, s1)));
    o1 = add_rn(round_to<T>(mul_rn(z, c1)), -round_to<T>(mul_rn(a, s0)));
  }
  p.out[ob + d0 * p.out_stride[3]] = static_cast<T>(o0);
  p.out[ob + d1 * p.out_stride[3]] = static_cast<T>(o1);
}

}  // namespace sptr
