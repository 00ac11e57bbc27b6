// Argument checks and kernel arguments of the mRoPE ops, shared by the CPU and CUDA implementations.
#pragma once
#include <ATen/MemoryOverlap.h>
#include <sptr/checks.h>

#include "rope_math.h"

namespace sptr {

// cos/sin as a 4-D [stream, B, S, D] view (a composed [B, S, D] table gets a stride-0 stream dimension).
struct RopeTables {
  at::Tensor cos, sin;
  bool composed;
};

inline RopeTables rope_tables(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                              at::IntArrayRef section) {
  SPTR_CHECK_VALUE(cos.sizes() == sin.sizes(), "cos and sin must have the same shape, got ", cos.sizes(), " and ",
                    sin.sizes());
  SPTR_CHECK_TYPE(cos.scalar_type() == sin.scalar_type(), "cos and sin must share a dtype");
  SPTR_CHECK_TYPE(cos.scalar_type() == at::kFloat || cos.scalar_type() == x.scalar_type(),
                   "cos/sin must be float32 or the dtype of q, ", x.scalar_type(), ", got ", cos.scalar_type());
  SPTR_CHECK_VALUE(cos.dim() == 3 ? section.empty() : true,
                    "composed [B, S, D] cos/sin take no mrope_section (got ", section,
                    "); [3, B, S, D] stream tables are 4-D");
  SPTR_CHECK_SAME_DEVICE(cos, x);
  const int64_t B = x.size(0), S = x.size(2), D = x.size(3);
  RopeTables t;
  t.composed = cos.dim() == 3;
  if (t.composed) {
    SPTR_CHECK_VALUE(cos.size(1) == S && cos.size(2) == D && (cos.size(0) == B || cos.size(0) == 1),
                      "composed cos/sin must be [B, S, D] = [", B, ", ", S, ", ", D, "], got ", cos.sizes());
    t.cos = cos.unsqueeze(0).expand({3, B, S, D});
    t.sin = sin.unsqueeze(0).expand({3, B, S, D});
  } else {
    SPTR_CHECK_VALUE(cos.dim() == 4 && cos.size(0) == 3 && cos.size(2) == S && cos.size(3) == D &&
                          (cos.size(1) == B || cos.size(1) == 1),
                      "cos/sin must be [3, B, S, D] = [3, ", B, ", ", S, ", ", D, "] or composed [B, S, D], got ",
                      cos.sizes());
    SPTR_CHECK_VALUE(section.size() == 3, "mrope_section must have 3 entries for [3, B, S, D] tables, got ",
                      section.size());
    SPTR_CHECK_VALUE(section[0] >= 0 && section[1] >= 0 && section[2] >= 0 &&
                          section[0] + section[1] + section[2] == D / 2,
                      "mrope_section ", section, " must sum to head_dim / 2 = ", D / 2);
    t.cos = cos.expand({3, B, S, D});
    t.sin = sin.expand({3, B, S, D});
  }
  return t;
}

inline void check_rope_operand(const at::Tensor& x, const char* name) {
  SPTR_CHECK_VALUE(x.dim() == 4, name, " must be [B, H, S, D], got shape ", x.sizes());
  SPTR_CHECK_FLOATING(x);
  SPTR_CHECK_VALUE(x.size(3) % 2 == 0, name, " head_dim must be even, got ", x.size(3));
}

inline void check_rope_pair(const at::Tensor& q, const at::Tensor& k) {
  check_rope_operand(q, "q");
  check_rope_operand(k, "k");
  SPTR_CHECK_SAME_DTYPE(k, q);
  SPTR_CHECK_SAME_DEVICE(k, q);
  SPTR_CHECK_VALUE(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3),
                    "q and k must share B, S and D, got ", q.sizes(), " and ", k.sizes());
}

template <typename T, typename C, typename O = T, typename R = T>
RopeArgs<T, C, O, R> rope_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_out,
                               const at::Tensor& k_out, const RopeTables& t, at::IntArrayRef section, bool hf_layout,
                               bool backward) {
  RopeArgs<T, C, O, R> a;
  const at::Tensor* xs[2] = {&q, &k};
  const at::Tensor* os[2] = {&q_out, &k_out};
  for (int n = 0; n < 2; ++n) {
    a.x[n] = xs[n]->const_data_ptr<T>();
    a.out[n] = os[n]->mutable_data_ptr<O>();
    a.heads[n] = xs[n]->size(1);
    for (int i = 0; i < 4; ++i) {
      a.x_stride[n][i] = xs[n]->stride(i);
      a.out_stride[n][i] = os[n]->stride(i);
    }
  }
  a.cos = t.cos.const_data_ptr<C>();
  a.sin = t.sin.const_data_ptr<C>();
  for (int i = 0; i < 4; ++i) a.cs_stride[i] = t.cos.stride(i);
  a.B = q.size(0);
  a.S = q.size(2);
  a.D = q.size(3);
  a.composed = t.composed;
  a.c1 = t.composed ? 0 : section[0];
  a.c2 = t.composed ? 0 : section[0] + section[1];
  a.hf_layout = hf_layout;
  a.backward = backward;
  return a;
}

inline bool aligned_rows(const void* ptr, const int64_t* strides, int ndims, int64_t V, int64_t bytes) {
  if (reinterpret_cast<uintptr_t>(ptr) % bytes || strides[ndims - 1] != 1) return false;
  for (int i = 0; i < ndims - 1; ++i)
    if (strides[i] % V) return false;
  return true;
}

// Pairs per work item: 16 bytes of x when every row of every operand is unit-stride and aligned to its V
// elements, else 1. Sets whether cos/sin rows also allow the wide loads.
template <typename T, typename C, typename O, typename R>
int rope_vector_width(RopeArgs<T, C, O, R>& a) {
  const int64_t V = 16 / static_cast<int64_t>(sizeof(T));
  if (V <= 1 || (a.D / 2) % V) return 1;
  for (int n = 0; n < 2; ++n)
    if (!aligned_rows(a.x[n], a.x_stride[n], 4, V, 16) ||
        !aligned_rows(a.out[n], a.out_stride[n], 4, V, V * sizeof(O)))
      return 1;
  a.table_vector = aligned_rows(a.cos, a.cs_stride, 4, V, V * sizeof(C)) &&
                   aligned_rows(a.sin, a.cs_stride, 4, V, V * sizeof(C));
  return static_cast<int>(V);
}

// cos and sin must share strides for the kernel's single stride set.
inline RopeTables uniform_strides(RopeTables t) {
  if (t.cos.strides() != t.sin.strides()) {
    t.cos = t.cos.contiguous();
    t.sin = t.sin.contiguous();
  }
  return t;
}

// The promoted pairs (x, out): fp16/bf16 x with fp32 tables and out, or the fp32 gradient with an fp16/bf16
// input gradient; tables kept in fp32.
template <class Device, typename X, typename O>
bool launch_promoted(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_out, const at::Tensor& k_out,
                     const RopeTables& t, at::IntArrayRef section, bool hf_layout, bool backward) {
  if (q.scalar_type() != c10::CppTypeToScalarType<X>::value || q_out.scalar_type() != c10::CppTypeToScalarType<O>::value)
    return false;
  Device::launch(rope_args<X, float, O, float>(q, k, q_out, k_out, t, section, hf_layout, backward));
  return true;
}

// The four mRoPE ops, written once; `Device::launch(args)` runs rope_item over every (b, s, head, pair group).
// Strides are passed to the kernels, so transposed [B, S, H, D] views are used without copies. Outputs of
// another dtype than x select the promoted arithmetic (fp32 tables only).
template <class Device>
void rope_rotate(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                 at::IntArrayRef section, bool hf_layout, bool backward, const at::Tensor& q_out,
                 const at::Tensor& k_out) {
  check_rope_pair(q, k);
  const RopeTables t = uniform_strides(rope_tables(q, cos, sin, section));
  if (q_out.scalar_type() != q.scalar_type()) {
    SPTR_CHECK_TYPE(t.cos.scalar_type() == at::kFloat, "promoted mRoPE needs float32 cos/sin, got ",
                     t.cos.scalar_type());
    const bool done =
        launch_promoted<Device, at::Half, float>(q, k, q_out, k_out, t, section, hf_layout, backward) ||
        launch_promoted<Device, at::BFloat16, float>(q, k, q_out, k_out, t, section, hf_layout, backward) ||
        launch_promoted<Device, float, at::Half>(q, k, q_out, k_out, t, section, hf_layout, backward) ||
        launch_promoted<Device, float, at::BFloat16>(q, k, q_out, k_out, t, section, hf_layout, backward);
    SPTR_CHECK_TYPE(done, "promoted mRoPE maps float16/bfloat16 to float32 (or back for the gradient), got ",
                     q.scalar_type(), " -> ", q_out.scalar_type());
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "mrope", [&] {
    if (t.cos.scalar_type() == q.scalar_type())
      Device::launch(rope_args<scalar_t, scalar_t>(q, k, q_out, k_out, t, section, hf_layout, backward));
    else
      Device::launch(rope_args<scalar_t, float>(q, k, q_out, k_out, t, section, hf_layout, backward));
  });
}

inline void check_rope_out(const at::Tensor& out, const at::Tensor& x, const char* name) {
  SPTR_CHECK_VALUE(out.sizes() == x.sizes(), name, " must have shape ", x.sizes(), ", got ", out.sizes());
  SPTR_CHECK_TYPE(out.scalar_type() == x.scalar_type(), name, " must have dtype ", x.scalar_type());
  SPTR_CHECK_VALUE(out.device() == x.device(), name, " must be on ", x.device());
  at::assert_no_internal_overlap(out);
  at::assert_no_overlap(out, x);
}

// Outputs keep x's memory layout (as the eager expression's TensorIterator does), in `dtype` if given.
inline at::Tensor rope_output_like(const at::Tensor& x, std::optional<at::ScalarType> dtype) {
  return at::empty_like(x, x.options().dtype(dtype.value_or(x.scalar_type())));
}

// promote: fp16/bf16 q, k with fp32 cos/sin give fp32 results computed from the unrounded tables (PyTorch's
// type promotion of `q * cos`); otherwise the tables are cast to q's dtype.
template <class Device>
std::tuple<at::Tensor, at::Tensor> mrope_fwd_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                  const at::Tensor& sin, at::IntArrayRef section, bool hf_layout,
                                                  bool promote) {
  std::optional<at::ScalarType> dtype;
  if (promote) dtype = at::promote_types(q.scalar_type(), cos.scalar_type());
  auto q_out = rope_output_like(q, dtype), k_out = rope_output_like(k, dtype);
  rope_rotate<Device>(q, k, cos, sin, section, hf_layout, false, q_out, k_out);
  return {q_out, k_out};
}

template <class Device>
void mrope_fwd_out_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                        at::IntArrayRef section, bool hf_layout, const at::Tensor& q_out, const at::Tensor& k_out) {
  check_rope_out(q_out, q, "q_out");
  check_rope_out(k_out, k, "k_out");
  rope_rotate<Device>(q, k, cos, sin, section, hf_layout, false, q_out, k_out);
}

// The rotation (Backward: its transpose) in place: every work item loads its elements before it stores any.
template <class Device, bool Backward = false>
void mrope_inplace_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                        at::IntArrayRef section, bool hf_layout) {
  at::assert_no_internal_overlap(q);
  at::assert_no_internal_overlap(k);
  at::assert_no_overlap(q, k);
  rope_rotate<Device>(q, k, cos, sin, section, hf_layout, Backward, q, k);
}

// mrope_ on the views q = q_base.as_strided(q_size, q_stride), k likewise: the in-place rotation whose
// autograd marks the bases modified (rope_autograd.cpp), which a view of each base, rotated in place, would not
// allow without autograd's copies of the gradient (CopySlices).
template <class Device>
void mrope_rebased_impl(const at::Tensor& q_base, const at::Tensor& k_base, const at::Tensor& cos,
                        const at::Tensor& sin, at::IntArrayRef section, bool hf_layout, at::IntArrayRef q_size,
                        at::IntArrayRef q_stride, at::IntArrayRef k_size, at::IntArrayRef k_stride) {
  SPTR_CHECK_VALUE(q_size.size() == 4 && q_stride.size() == 4 && k_size.size() == 4 && k_stride.size() == 4,
                   "mrope_rebased_: q and k views must be 4-D, got sizes ", q_size, " and ", k_size);
  mrope_inplace_impl<Device>(q_base.as_strided(q_size, q_stride), k_base.as_strided(k_size, k_stride), cos, sin,
                             section, hf_layout);
}

// input_dtype: the dtype of the forward's q, k when it was promoted (the gradient is then fp32).
template <class Device>
std::tuple<at::Tensor, at::Tensor> mrope_bwd_impl(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                                  const at::Tensor& cos, const at::Tensor& sin,
                                                  at::IntArrayRef section, bool hf_layout,
                                                  std::optional<at::ScalarType> input_dtype) {
  auto gq = rope_output_like(grad_q, input_dtype), gk = rope_output_like(grad_k, input_dtype);
  rope_rotate<Device>(grad_q, grad_k, cos, sin, section, hf_layout, true, gq, gk);
  return {gq, gk};
}

}  // namespace sptr
