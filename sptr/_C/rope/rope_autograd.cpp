// Autograd of mRoPE in C++ (see sptr/autograd.h for why not register_autograd). The backward rotates the
// gradients back with mrope_bwd; trainable cos/sin get their gradients as autograd computes them for
// transformers' eager expression `q * cos + rotate_half(q) * sin` (same ops, same reduction order), so they
// stay bit-exact to it.
#include <torch/library.h>

#include <sptr/autograd.h>

#include <tuple>
#include <vector>

namespace sptr {
namespace {

using FwdSignature = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                at::IntArrayRef, bool, bool);
using BwdSignature = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                at::IntArrayRef, bool, std::optional<at::ScalarType>);
using BwdInPlaceSignature = void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, at::IntArrayRef, bool);

// The backward's rotation in place, for gradients that nothing else references (sole_reference): no new
// buffers, and the rotation writes over the lines it just read instead of evicting them for new ones.
void rotate_back_in_place(const Tensor& gq, const Tensor& gk, const Tensor& cos, const Tensor& sin,
                          at::IntArrayRef section, bool hf_layout) {
  static const auto op = typed_op<BwdInPlaceSignature>("sptr::mrope_bwd_");
  op.call(gq, gk, cos, sin, section, hf_layout);
}

Tensor rotate_half(const Tensor& x) {
  const auto halves = x.chunk(2, -1);
  return at::cat({halves[1].neg(), halves[0]}, -1);
}

// d cos / d sin: per operand the gradient times q (or rotate_half(q)) in the promoted dtype, reduced over heads
// (and batch, for a batch-1 table) by one sum_to_size, the q and k parts added; with [3, B, S, D] stream
// tables each dim goes to its stream only (the stream the kernel reads it from).
std::tuple<Tensor, Tensor> table_grads(const Tensor& gq, const Tensor& gk, const Tensor& q, const Tensor& k,
                                       const Tensor& cos, at::IntArrayRef section, bool hf_layout) {
  const std::vector<c10::SymInt> composed{cos.sym_size(-3), 1, q.sym_size(-2), q.sym_size(-1)};
  Tensor gc = (gq * q).sum_to_size_symint(composed) + (gk * k).sum_to_size_symint(composed);
  Tensor gs = (gq * rotate_half(q)).sum_to_size_symint(composed) + (gk * rotate_half(k)).sum_to_size_symint(composed);
  gc = gc.squeeze(1);
  gs = gs.squeeze(1);
  if (cos.dim() == 3) return {gc, gs};
  const c10::SymInt d = q.sym_size(-1);
  Tensor j = at::arange(at::Scalar(d), q.options().dtype(at::kLong));
  j = hf_layout ? at::remainder(j, at::Scalar(d / 2)) : at::div(j, 2, "floor");
  const Tensor stream = at::ge(j, section[0]).to(at::kLong) + at::ge(j, section[0] + section[1]).to(at::kLong);
  const Tensor selected = at::one_hot(stream, 3).t().to(at::kBool).unsqueeze(1).unsqueeze(1);  // [3, 1, 1, D]
  return {at::where(selected, gc.unsqueeze(0), 0), at::where(selected, gs.unsqueeze(0), 0)};
}

class MultimodalRope : public torch::autograd::Function<MultimodalRope> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& cos,
                               const Tensor& sin, at::IntArrayRef section, bool hf_layout, bool promote) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<FwdSignature>("sptr::mrope_fwd");
    auto [q_out, k_out] = op.call(q, k, cos, sin, section, hf_layout, promote);
    const bool tables_grad = cos.requires_grad() || sin.requires_grad();
    const Tensor none;
    ctx->save_for_backward({cos, sin, tables_grad ? q : none, tables_grad ? k : none});
    ctx->saved_data["section"] = section.vec();
    ctx->saved_data["hf_layout"] = hf_layout;
    // promoted: the gradients come in fp32 and go back in q's dtype
    ctx->saved_data["input_dtype"] = q_out.scalar_type() != q.scalar_type() ? c10::IValue(q.scalar_type())
                                                                             : c10::IValue();
    return {q_out, k_out};
  }

  // Gradients of outputs that took no part in the loss arrive as zeros (materialised by autograd). The list is
  // taken by reference, so that a gradient only autograd held is rotated in place.
  static variable_list backward(AutogradContext* ctx, variable_list& grads) {
    const variable_list s = ctx->get_saved_variables();  // cos, sin, q, k (q, k only for trainable tables)
    refuse_double_backward("apply_rotary", {&grads[0], &grads[1], &s[0], &s[1], &s[2], &s[3]});
    at::AutoDispatchBelowADInplaceOrView guard;
    const std::vector<int64_t> section = ctx->saved_data["section"].toIntVector();
    const bool hf_layout = ctx->saved_data["hf_layout"].toBool();
    const c10::IValue& input_dtype = ctx->saved_data["input_dtype"];
    // Trainable tables need the gradients as they came; a promoted forward returns them in another dtype.
    if (!s[2].defined() && input_dtype.isNone() && sole_reference(grads[0]) && sole_reference(grads[1])) {
      rotate_back_in_place(grads[0], grads[1], s[0], s[1], section, hf_layout);
      return {grads[0], grads[1], Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    }
    static const auto op = typed_op<BwdSignature>("sptr::mrope_bwd");
    auto [gq, gk] = op.call(grads[0], grads[1], s[0], s[1], section, hf_layout,
                            input_dtype.isNone() ? std::nullopt : std::optional(input_dtype.toScalarType()));
    Tensor dcos, dsin;
    if (s[2].defined()) {
      std::tie(dcos, dsin) = table_grads(grads[0], grads[1], s[2], s[3], s[0], section, hf_layout);
      dcos = dcos.to(s[0].scalar_type());
      dsin = dsin.to(s[1].scalar_type());
    }
    return {gq, gk, dcos, dsin, Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> mrope_fwd_autograd(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                                              at::IntArrayRef section, bool hf_layout, bool promote) {
  variable_list outs = MultimodalRope::apply(q, k, cos, sin, section, hf_layout, promote);
  return {outs[0], outs[1]};
}

using RebasedSignature = void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, at::IntArrayRef, bool,
                              at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef);

// mrope_rebased_ below autograd, the bases' versions bumped (the dispatcher bumps none for a custom op that
// writes its arguments).
void rotate_bases(const Tensor& q_base, const Tensor& k_base, const Tensor& cos, const Tensor& sin,
                  at::IntArrayRef section, bool hf_layout, at::IntArrayRef q_size, at::IntArrayRef q_stride,
                  at::IntArrayRef k_size, at::IntArrayRef k_stride) {
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<RebasedSignature>("sptr::mrope_rebased_");
    op.call(q_base, k_base, cos, sin, section, hf_layout, q_size, q_stride, k_size, k_stride);
  }
  for (const Tensor* t : {&q_base, &k_base})
    if (!t->is_inference()) torch::autograd::impl::bump_version(*t);
}

// The gradient of a contiguous base from the gradient `g` of its view (size, stride) rotated back. The rotated
// gradient keeps the view's strides (rope_output_like), so its memory, read in the base's contiguous order, is
// the base's gradient; a stride that came out otherwise (a dimension of size 1) takes a copy.
Tensor base_grad(const Tensor& g, const Tensor& base, at::IntArrayRef stride) {
  if (g.strides() == stride) return g.as_strided(base.sizes(), base.strides(), g.storage_offset());
  Tensor out = at::empty_like(base, g.options());
  out.as_strided(g.sizes(), stride).copy_(g);
  return out;
}

// apply_rotary_ with gradients: q and k are views that cover their contiguous bases (the projections' outputs
// seen as [B, H, S, D]), rotated in place and recorded as in-place writes of the bases. The bases' views,
// q and k among them, follow the bases' new history, so nothing reads stale autograd state; a leaf base that
// requires grad is refused as for any in-place op. Marking the views themselves would give each base
// CopySlices, whose backward copies the gradient three times over.
class RebasedRope : public torch::autograd::Function<RebasedRope> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& q_base, const Tensor& k_base, const Tensor& cos,
                               const Tensor& sin, at::IntArrayRef section, bool hf_layout, at::IntArrayRef q_size,
                               at::IntArrayRef q_stride, at::IntArrayRef k_size, at::IntArrayRef k_stride) {
    rotate_bases(q_base, k_base, cos, sin, section, hf_layout, q_size, q_stride, k_size, k_stride);
    ctx->mark_dirty({q_base, k_base});
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["section"] = section.vec();
    ctx->saved_data["hf_layout"] = hf_layout;
    ctx->saved_data["q_size"] = q_size.vec();
    ctx->saved_data["q_stride"] = q_stride.vec();
    ctx->saved_data["k_size"] = k_size.vec();
    ctx->saved_data["k_stride"] = k_stride.vec();
    return {q_base, k_base};
  }

  static variable_list backward(AutogradContext* ctx, variable_list& grads) {
    const variable_list s = ctx->get_saved_variables();  // cos, sin
    refuse_double_backward("apply_rotary_", {&grads[0], &grads[1]});
    at::AutoDispatchBelowADInplaceOrView guard;
    const std::vector<int64_t> q_size = ctx->saved_data["q_size"].toIntVector();
    const std::vector<int64_t> q_stride = ctx->saved_data["q_stride"].toIntVector();
    const std::vector<int64_t> k_size = ctx->saved_data["k_size"].toIntVector();
    const std::vector<int64_t> k_stride = ctx->saved_data["k_stride"].toIntVector();
    const std::vector<int64_t> section = ctx->saved_data["section"].toIntVector();
    const bool hf_layout = ctx->saved_data["hf_layout"].toBool();
    // The bases are contiguous, so a contiguous gradient of one is laid out as the base, and the view's
    // geometry reads the view's gradient from it. Where nothing else holds it (the engine's reference given
    // up, or a copy made here), it is rotated in place.
    const Tensor gq_base = grads[0].contiguous(), gk_base = grads[1].contiguous();
    grads[0].reset();
    grads[1].reset();
    if (sole_reference(gq_base) && sole_reference(gk_base)) {
      rotate_back_in_place(gq_base.as_strided(q_size, q_stride), gk_base.as_strided(k_size, k_stride), s[0], s[1],
                           section, hf_layout);
      return {gq_base, gk_base, Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    }
    static const auto op = typed_op<BwdSignature>("sptr::mrope_bwd");
    auto [gq, gk] = op.call(gq_base.as_strided(q_size, q_stride), gk_base.as_strided(k_size, k_stride), s[0], s[1],
                            section, hf_layout, std::nullopt);
    return {base_grad(gq, gq_base, q_stride), base_grad(gk, gk_base, k_stride), Tensor(), Tensor(), Tensor(),
            Tensor(),  Tensor(),  Tensor(),  Tensor(),  Tensor()};
  }
};

void mrope_rebased_autograd(const Tensor& q_base, const Tensor& k_base, const Tensor& cos, const Tensor& sin,
                            at::IntArrayRef section, bool hf_layout, at::IntArrayRef q_size, at::IntArrayRef q_stride,
                            at::IntArrayRef k_size, at::IntArrayRef k_stride) {
  const bool bases_grad = q_base.requires_grad() || k_base.requires_grad();
  if (!at::GradMode::is_enabled() || !(bases_grad || cos.requires_grad() || sin.requires_grad())) {
    rotate_bases(q_base, k_base, cos, sin, section, hf_layout, q_size, q_stride, k_size, k_stride);
    return;
  }
  SPTR_CHECK_VALUE(!cos.requires_grad() && !sin.requires_grad(),
                   "mrope_rebased_: cos/sin that require grad need the pre-rotation q and k, which an in-place "
                   "rotation overwrites; use apply_rotary (out of place) for trainable tables");
  SPTR_CHECK_VALUE(q_base.is_contiguous() && k_base.is_contiguous(),
                   "mrope_rebased_: q_base and k_base must be contiguous (the views' gradients are read from theirs)");
  RebasedRope::apply(q_base, k_base, cos, sin, section, hf_layout, q_size, q_stride, k_size, k_stride);
}

}  // namespace

TORCH_LIBRARY_IMPL(sptr, Autograd, m) {
  m.impl("mrope_fwd", &mrope_fwd_autograd);
  m.impl("mrope_rebased_", &mrope_rebased_autograd);
}

}  // namespace sptr
