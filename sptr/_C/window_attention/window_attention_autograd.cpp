// Autograd of the pair-layout window attention ops in C++ (see sptr/autograd.h for why not register_autograd).
// Each backward but window_permute_rows's is one fused kernel that is not itself differentiable.
#include <torch/library.h>

#include <sptr/autograd.h>

#include <tuple>

#include "spherical_coords.h"

namespace sptr {
namespace {

using PairLogitsSignature = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                                   const OptTensor&, const OptTensor&, bool);
using PairLogitsBwdSignature = std::tuple<Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const OptTensor&,
    const OptTensor&, bool);
using AggregateSignature = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                                  const OptTensor&);
using AggregateBwdSignature = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                                 const Tensor&, const Tensor&, const Tensor&,
                                                                 const OptTensor&, const OptTensor&);
using SoftmaxSignature = Tensor(const Tensor&, const Tensor&);
using SoftmaxBwdSignature = Tensor(const Tensor&, const Tensor&, const Tensor&);

class PairLogits : public torch::autograd::Function<PairLogits> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& index_0,
                               const Tensor& index_1, const OptTensor& table_q, const OptTensor& table_k,
                               const OptTensor& rel_idx, bool with_qk) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<PairLogitsSignature>("sptr::window_pair_logits_fwd");
    Tensor out = op.call(q, k, index_0, index_1, table_q, table_k, rel_idx, with_qk);
    const Tensor none;
    ctx->save_for_backward({q, k, index_0, index_1, table_q.value_or(none), table_k.value_or(none),
                            rel_idx.value_or(none)});
    ctx->saved_data["with_qk"] = with_qk;
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();  // q, k, index_0, index_1, table_q, table_k, rel_idx
    refuse_double_backward("pair_logits", {&grads[0], &s[0], &s[1], &s[4], &s[5]});
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<PairLogitsBwdSignature>("sptr::window_pair_logits_bwd");
    auto [dq, dk, dtq, dtk] = op.call(grads[0], s[0], s[1], s[2], s[3], optional(s[4]), optional(s[5]),
                                      optional(s[6]), ctx->saved_data["with_qk"].toBool());
    const Tensor none;
    return {dq, dk, none, none, s[4].defined() ? dtq : none, s[5].defined() ? dtk : none, none, none};
  }
};

class Aggregate : public torch::autograd::Function<Aggregate> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& attn, const Tensor& v, const Tensor& offsets,
                               const Tensor& index_1, const OptTensor& table_v, const OptTensor& rel_idx) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<AggregateSignature>("sptr::window_aggregate_fwd");
    Tensor out = op.call(attn, v, offsets, index_1, table_v, rel_idx);
    const Tensor none;
    ctx->save_for_backward({attn, v, offsets, index_1, table_v.value_or(none), rel_idx.value_or(none)});
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();  // attn, v, index_0_offsets, index_1, table_v, rel_idx
    refuse_double_backward("aggregate", {&grads[0], &s[0], &s[1], &s[4]});
    at::AutoDispatchBelowADInplaceOrView guard;
    // The backward needs each pair's query: rebuilt from the offsets rather than saved.
    const Tensor counts = (s[2].slice(0, 1) - s[2].slice(0, 0, -1)).to(at::kLong);
    const Tensor index_0 = at::repeat_interleave_symint(at::arange(at::Scalar(counts.sym_numel()), counts.options()),
                                                        counts, std::nullopt, s[3].sym_size(0));
    static const auto op = typed_op<AggregateBwdSignature>("sptr::window_aggregate_bwd");
    auto [dattn, dv, dt] = op.call(grads[0], s[0], s[1], index_0, s[2], s[3], optional(s[4]), optional(s[5]));
    const Tensor none;
    return {dattn, dv, none, none, s[4].defined() ? dt : none, none};
  }
};

class SegmentSoftmax : public torch::autograd::Function<SegmentSoftmax> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& src, const Tensor& indptr) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<SoftmaxSignature>("sptr::window_softmax_fwd");
    Tensor out = op.call(src, indptr);
    ctx->save_for_backward({out, indptr});
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    refuse_double_backward("segment_softmax", {&grads[0], &s[0]});
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<SoftmaxBwdSignature>("sptr::window_softmax_bwd");
    return {op.call(grads[0], s[0], s[1]), Tensor()};
  }
};

using PermuteRowsSignature = Tensor(const Tensor&, const Tensor&, const Tensor&, std::optional<at::ScalarType>);

// Linear in x: the backward is the op itself with dest and source swapped and the cast reversed, called above
// the autograd key so that it is differentiable again (double backward).
class PermuteRows : public torch::autograd::Function<PermuteRows> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& dest, const Tensor& source,
                               std::optional<at::ScalarType> dtype) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<PermuteRowsSignature>("sptr::window_permute_rows");
    ctx->save_for_backward({dest, source});
    ctx->saved_data["dtype"] = static_cast<int64_t>(x.scalar_type());
    return {op.call(x, dest, source, dtype)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();  // dest, source
    const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    static const auto op = typed_op<PermuteRowsSignature>("sptr::window_permute_rows");
    return {op.call(grads[0], s[1], s[0], x_dtype), Tensor(), Tensor(), Tensor()};
  }
};

Tensor permute_rows_autograd(const Tensor& x, const Tensor& dest, const Tensor& source,
                             std::optional<at::ScalarType> dtype) {
  return PermuteRows::apply(x, dest, source, dtype)[0];
}

Tensor pair_logits_autograd(const Tensor& q, const Tensor& k, const Tensor& index_0, const Tensor& index_1,
                            const OptTensor& table_q, const OptTensor& table_k, const OptTensor& rel_idx,
                            bool with_qk) {
  return PairLogits::apply(q, k, index_0, index_1, table_q, table_k, rel_idx, with_qk)[0];
}

Tensor aggregate_autograd(const Tensor& attn, const Tensor& v, const Tensor& offsets, const Tensor& index_1,
                          const OptTensor& table_v, const OptTensor& rel_idx) {
  return Aggregate::apply(attn, v, offsets, index_1, table_v, rel_idx)[0];
}

Tensor softmax_autograd(const Tensor& src, const Tensor& indptr) { return SegmentSoftmax::apply(src, indptr)[0]; }

// Points rarely need a gradient: below autograd (the CUDA float32 kernel) unless xyz requires one, then the
// published chain of differentiable ATen ops, whose gradients autograd already knows.
Tensor cart2sphere_autograd(const Tensor& xyz) {
  if (xyz.requires_grad() && at::GradMode::is_enabled()) return cart2sphere_ops(xyz);
  at::AutoDispatchBelowADInplaceOrView guard;
  static const auto op = typed_op<Tensor(const Tensor&)>("sptr::cart2sphere");
  return op.call(xyz);
}

}  // namespace

TORCH_LIBRARY_IMPL(sptr, Autograd, m) {
  m.impl("cart2sphere", &cart2sphere_autograd);
  m.impl("window_permute_rows", &permute_rows_autograd);
  m.impl("window_pair_logits_fwd", &pair_logits_autograd);
  m.impl("window_aggregate_fwd", &aggregate_autograd);
  m.impl("window_softmax_fwd", &softmax_autograd);
}

}  // namespace sptr
