// CPU kernels of the window attention family. Scatter-style gradients are accumulated serially in the
// accumulation dtype, so CPU results are deterministic.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sptr/dispatch.h>

#include "window_attention_host.h"

namespace sptr {
namespace {

struct SerialAdd {
  template <typename A>
  static void add(A* base, int64_t o, A v) { base[o] += v; }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> window_precompute_all_cpu(const at::Tensor& counts,
                                                                                     int64_t N) {
  WindowLayout w = window_layout(counts, N);
  auto opts = counts.options().dtype(at::kInt);
  auto index_0_offsets = at::empty({N + 1}, opts), index_1_offsets = at::empty({N}, opts);
  auto index_0 = at::empty({w.num_pairs}, opts), index_1 = at::empty({w.num_pairs}, opts);
  const int64_t* win = w.point_window.const_data_ptr<int64_t>();
  const int64_t* cnt = w.counts.const_data_ptr<int64_t>();
  const int64_t* s0 = w.first_point.const_data_ptr<int64_t>();
  const int64_t* S0 = w.first_pair.const_data_ptr<int64_t>();
  int32_t *o0 = index_0_offsets.mutable_data_ptr<int32_t>(), *o1 = index_1_offsets.mutable_data_ptr<int32_t>();
  int32_t *i0 = index_0.mutable_data_ptr<int32_t>(), *i1 = index_1.mutable_data_ptr<int32_t>();
  at::parallel_for(0, N, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t wi = win[p], c = cnt[wi], s = s0[wi], S = S0[wi], a = p - s;
      o0[p] = static_cast<int32_t>(S + a * c);
      o1[p] = static_cast<int32_t>(S + a);
      for (int64_t t = 0; t < c; ++t) {
        i0[S + a * c + t] = static_cast<int32_t>(p);
        i1[S + a * c + t] = static_cast<int32_t>(s + t);
      }
    }
  });
  index_0_offsets[N].fill_(w.num_pairs);
  return {index_0_offsets, index_1_offsets, index_0, index_1};
}

at::Tensor window_pair_logits_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& index_0,
                                      const at::Tensor& index_1, const std::optional<at::Tensor>& table_q,
                                      const std::optional<at::Tensor>& table_k,
                                      const std::optional<at::Tensor>& rel_idx, bool with_qk) {
  PairLogitOperands ops(q, k, index_0, index_1, table_q, table_k, rel_idx);
  auto out = at::empty({ops.M, ops.h}, ops.q.options());
  SPTR_DISPATCH_FLOATING(ops.q.scalar_type(), "window_pair_logits_fwd_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    auto args = ops.args<scalar_t>(with_qk);
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    const int64_t h = ops.h;
    at::parallel_for(0, ops.M * h, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) o[e] = scalar_t(pair_logit<A>(args, e / h, e % h));
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> window_pair_logits_bwd_cpu(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& index_0,
    const at::Tensor& index_1, const std::optional<at::Tensor>& table_q, const std::optional<at::Tensor>& table_k,
    const std::optional<at::Tensor>& rel_idx, bool with_qk) {
  PairLogitOperands ops(q, k, index_0, index_1, table_q, table_k, rel_idx);
  SPTR_CHECK_VALUE(grad.dim() == 2 && grad.size(0) == ops.M && grad.size(1) == ops.h, "grad must have shape (",
                    ops.M, ", ", ops.h, "), got ", grad.sizes());
  auto g = grad.to(ops.q.scalar_type()).contiguous();
  GradBuffers grads(ops.q, {ops.q, ops.k, ops.table_q, ops.table_k});
  SPTR_DISPATCH_FLOATING(ops.q.scalar_type(), "window_pair_logits_bwd_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    auto args = ops.args<scalar_t>(with_qk);
    LogitGradSink<A, SerialAdd> add{grads.ptr<A>(0), grads.ptr<A>(1), grads.ptr<A>(2), grads.ptr<A>(3)};
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    for (int64_t m = 0; m < ops.M; ++m)
      for (int64_t hh = 0; hh < ops.h; ++hh)
        for (int64_t c = 0; c < ops.d; ++c) pair_logit_backward<A>(args, gp, m, hh, c, add);
  });
  return {grads.result(0), grads.result(1), grads.result(2), grads.result(3)};
}

at::Tensor window_aggregate_fwd_cpu(const at::Tensor& attn, const at::Tensor& v, const at::Tensor& index_0_offsets,
                                    const at::Tensor& index_1, const std::optional<at::Tensor>& table_v,
                                    const std::optional<at::Tensor>& rel_idx) {
  AggregateOperands ops(attn, v, index_0_offsets, std::nullopt, index_1, table_v, rel_idx);
  auto out = at::empty({ops.N, ops.h, ops.d}, ops.v.options());
  SPTR_DISPATCH_FLOATING(ops.v.scalar_type(), "window_aggregate_fwd_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    auto args = ops.args<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    const int64_t h = ops.h, d = ops.d;
    at::parallel_for(0, ops.N * h * d, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) o[e] = scalar_t(aggregate_element<A>(args, e / (h * d), (e / d) % h, e % d));
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> window_aggregate_bwd_cpu(
    const at::Tensor& grad, const at::Tensor& attn, const at::Tensor& v, const at::Tensor& index_0,
    const at::Tensor& index_0_offsets, const at::Tensor& index_1, const std::optional<at::Tensor>& table_v,
    const std::optional<at::Tensor>& rel_idx) {
  AggregateOperands ops(attn, v, index_0_offsets, index_0, index_1, table_v, rel_idx);
  SPTR_CHECK_VALUE(grad.dim() == 3 && grad.size(0) == ops.N && grad.size(1) == ops.h && grad.size(2) == ops.d,
                    "grad must have shape (", ops.N, ", ", ops.h, ", ", ops.d, "), got ", grad.sizes());
  auto g = grad.to(ops.v.scalar_type()).contiguous();
  auto dattn = at::empty_like(ops.attn);
  GradBuffers grads(ops.v, {ops.v, ops.table_v});
  SPTR_DISPATCH_FLOATING(ops.v.scalar_type(), "window_aggregate_bwd_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    auto args = ops.args<scalar_t>();
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    scalar_t* da = dattn.mutable_data_ptr<scalar_t>();
    const int64_t h = ops.h;
    at::parallel_for(0, ops.M * h, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) da[e] = scalar_t(aggregate_attn_grad<A>(args, gp, e / h, e % h));
    });
    AggregateGradSink<A, SerialAdd> add{grads.ptr<A>(0), grads.ptr<A>(1)};
    for (int64_t m = 0; m < ops.M; ++m)
      for (int64_t hh = 0; hh < ops.h; ++hh)
        for (int64_t c = 0; c < ops.d; ++c) aggregate_backward<A>(args, gp, m, hh, c, add);
  });
  return {dattn, grads.result(0), grads.result(1)};
}

at::Tensor window_softmax_fwd_cpu(const at::Tensor& src, const at::Tensor& indptr) {
  SoftmaxOperands ops(src, indptr, std::nullopt);
  auto out = at::zeros_like(ops.x);
  SPTR_DISPATCH_FLOATING(ops.x.scalar_type(), "window_softmax_fwd_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* x = ops.x.const_data_ptr<scalar_t>();
    scalar_t* y = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, ops.segments * ops.h, 256, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) softmax_item<A>(x, y, int_view(ops.indptr), ops.M, ops.h, e);
    });
  });
  return out;
}

at::Tensor window_softmax_bwd_cpu(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& indptr) {
  SoftmaxOperands ops(out, indptr, grad);
  auto dsrc = at::zeros_like(ops.x);
  SPTR_DISPATCH_FLOATING(ops.x.scalar_type(), "window_softmax_bwd_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t *g = ops.grad.const_data_ptr<scalar_t>(), *y = ops.x.const_data_ptr<scalar_t>();
    scalar_t* d = dsrc.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, ops.segments * ops.h, 256, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) softmax_backward_item<A>(g, y, d, int_view(ops.indptr), ops.M, ops.h, e);
    });
  });
  return dsrc;
}

TORCH_LIBRARY_IMPL(sptr, CPU, m) {
  m.impl("window_precompute_all", &window_precompute_all_cpu);
  m.impl("window_sort", &window_sort);
  m.impl("window_permute_rows", &window_permute_rows_cpu);
  m.impl("window_pair_logits_fwd", &window_pair_logits_fwd_cpu);
  m.impl("window_pair_logits_bwd", &window_pair_logits_bwd_cpu);
  m.impl("window_aggregate_fwd", &window_aggregate_fwd_cpu);
  m.impl("window_aggregate_bwd", &window_aggregate_bwd_cpu);
  m.impl("window_softmax_fwd", &window_softmax_fwd_cpu);
  m.impl("window_softmax_bwd", &window_softmax_bwd_cpu);
}

}  // namespace sptr
