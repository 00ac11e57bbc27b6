// CUDA kernels of the window attention family (step-by-step path). Row-wise sums are gathered per output
// element (deterministic); key-side and table gradients are scattered with fp32/fp64 atomics. Table
// gradients go through a per-block shared-memory copy of one head's table when it fits, so the small
// tables see one global atomic per element per block instead of one per pair (the published kernels'
// bottleneck, D9).
#include <c10/util/TypeCast.h>
#include <torch/library.h>

#include <sptr/cuda_utils.cuh>
#include <sptr/dispatch.h>

#include "window_attention_host.h"

namespace sptr {
namespace {

constexpr int kThreads = 256;
constexpr size_t kSharedTableBytes = 48 * 1024;

struct AtomicAdd {
  template <typename A>
  __device__ static void add(A* base, int64_t o, A v) {
    atomicAdd(base + o, v);
  }
};

__global__ void precompute_all_kernel(const int64_t* __restrict__ point_window, const int64_t* __restrict__ counts,
                                      const int64_t* __restrict__ first_point, const int64_t* __restrict__ first_pair,
                                      int64_t N, int32_t* o0, int32_t* o1, int32_t* i0, int32_t* i1) {
  // One warp per point: lanes write the point's row, so stores are coalesced.
  const int lane = threadIdx.x % 32;
  const int64_t warps = (int64_t)gridDim.x * blockDim.x / 32;
  for (int64_t p = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32; p < N; p += warps) {
    const int64_t w = point_window[p], c = counts[w], s = first_point[w], S = first_pair[w], a = p - s;
    if (lane == 0) {
      o0[p] = static_cast<int32_t>(S + a * c);
      o1[p] = static_cast<int32_t>(S + a);
    }
    for (int64_t t = lane; t < c; t += 32) {
      i0[S + a * c + t] = static_cast<int32_t>(p);
      i1[S + a * c + t] = static_cast<int32_t>(s + t);
    }
  }
}

template <typename T>
__global__ void pair_logits_kernel(PairLogitArgs<T> args, T* __restrict__ out) {
  using A = at::opmath_type<T>;
  SPTR_GRID_STRIDE(e, args.num_pairs * args.h) { out[e] = T(pair_logit<A>(args, e / args.h, e % args.h)); }
}

// Table-gradient sink into a shared-memory copy of one head's (L,3,d) slice of each table.
template <typename A>
struct SharedTableLogitSink {
  A *dq, *dk, *sq, *sk;
  int64_t h, d;
  __device__ int64_t local(int64_t o) const { return (o / (h * d)) * d + o % d; }
  __device__ void q(int64_t o, A v) { atomicAdd(dq + o, v); }
  __device__ void k(int64_t o, A v) { atomicAdd(dk + o, v); }
  __device__ void table_q(int64_t o, A v) { atomicAdd(sq + local(o), v); }
  __device__ void table_k(int64_t o, A v) { atomicAdd(sk + local(o), v); }
};

template <typename A>
struct SharedTableAggregateSink {
  A *dv, *st;
  int64_t h, d;
  __device__ void v(int64_t o, A x) { atomicAdd(dv + o, x); }
  __device__ void table_v(int64_t o, A x) { atomicAdd(st + (o / (h * d)) * d + o % d, x); }
};

// Adds a block's shared (L,3,d) slice of `head` into the global (L,3,h,d) gradient.
template <typename A>
__device__ void flush_table(const A* shared, A* global, int64_t L3, int64_t head, int64_t h, int64_t d) {
  for (int64_t e = threadIdx.x; e < L3 * d; e += blockDim.x) {
    const A v = shared[e];
    if (v != A(0)) atomicAdd(global + ((e / d) * h + head) * d + e % d, v);
  }
}

template <typename A>
__device__ void zero_shared(A* s, int64_t n) {
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) s[e] = A(0);
}

template <typename T, typename A>
__global__ void pair_logits_backward_kernel(PairLogitArgs<T> args, const T* __restrict__ grad,
                                            LogitGradSink<A, AtomicAdd> sink) {
  SPTR_GRID_STRIDE(e, args.num_pairs * args.h * args.d) {
    const int64_t c = e % args.d, hd = e / args.d;
    pair_logit_backward<A>(args, grad, hd / args.h, hd % args.h, c, sink);
  }
}

// blockIdx.y = head; each block reduces its pairs' table gradients in shared memory first.
template <typename T, typename A>
__global__ void pair_logits_backward_shared_kernel(PairLogitArgs<T> args, const T* __restrict__ grad,
                                                   LogitGradSink<A, AtomicAdd> global) {
  extern __shared__ unsigned char smem_raw[];
  A* smem = reinterpret_cast<A*>(smem_raw);
  const int64_t head = blockIdx.y, slice = args.L * 3 * args.d;
  A* sq = args.table_q ? smem : nullptr;
  A* sk = args.table_k ? smem + (args.table_q ? slice : 0) : nullptr;
  zero_shared(smem, slice * ((sq != nullptr) + (sk != nullptr)));
  __syncthreads();
  SharedTableLogitSink<A> sink{global.dq, global.dk, sq, sk, args.h, args.d};
  SPTR_GRID_STRIDE(e, args.num_pairs * args.d) { pair_logit_backward<A>(args, grad, e / args.d, head, e % args.d, sink); }
  __syncthreads();
  if (sq) flush_table(sq, global.dtable_q, args.L * 3, head, args.h, args.d);
  if (sk) flush_table(sk, global.dtable_k, args.L * 3, head, args.h, args.d);
}

template <typename T>
__global__ void aggregate_kernel(AggregateArgs<T> args, T* __restrict__ out) {
  using A = at::opmath_type<T>;
  const int64_t hd = args.h * args.d;
  SPTR_GRID_STRIDE(e, args.num_out * hd) { out[e] = T(aggregate_element<A>(args, e / hd, (e / args.d) % args.h, e % args.d)); }
}

template <typename T>
__global__ void aggregate_attn_grad_kernel(AggregateArgs<T> args, const T* __restrict__ grad, T* __restrict__ dattn) {
  using A = at::opmath_type<T>;
  SPTR_GRID_STRIDE(e, args.num_pairs * args.h) { dattn[e] = T(aggregate_attn_grad<A>(args, grad, e / args.h, e % args.h)); }
}

template <typename T, typename A>
__global__ void aggregate_backward_kernel(AggregateArgs<T> args, const T* __restrict__ grad,
                                          AggregateGradSink<A, AtomicAdd> sink) {
  SPTR_GRID_STRIDE(e, args.num_pairs * args.h * args.d) {
    const int64_t c = e % args.d, hd = e / args.d;
    aggregate_backward<A>(args, grad, hd / args.h, hd % args.h, c, sink);
  }
}

template <typename T, typename A>
__global__ void aggregate_backward_shared_kernel(AggregateArgs<T> args, const T* __restrict__ grad,
                                                 AggregateGradSink<A, AtomicAdd> global) {
  extern __shared__ unsigned char smem_raw[];
  A* st = reinterpret_cast<A*>(smem_raw);
  const int64_t head = blockIdx.y, slice = args.L * 3 * args.d;
  zero_shared(st, slice);
  __syncthreads();
  SharedTableAggregateSink<A> sink{global.dv, st, args.h, args.d};
  SPTR_GRID_STRIDE(e, args.num_pairs * args.d) { aggregate_backward<A>(args, grad, e / args.d, head, e % args.d, sink); }
  __syncthreads();
  flush_table(st, global.dtable_v, args.L * 3, head, args.h, args.d);
}

template <typename T>
__global__ void softmax_kernel(const T* __restrict__ src, T* __restrict__ out, IntView indptr, int64_t segments,
                               int64_t M, int64_t h) {
  SPTR_GRID_STRIDE(e, segments * h) { softmax_item<at::opmath_type<T>>(src, out, indptr, M, h, e); }
}

template <typename T>
__global__ void softmax_backward_kernel(const T* __restrict__ grad, const T* __restrict__ y, T* __restrict__ dsrc,
                                        IntView indptr, int64_t segments, int64_t M, int64_t h) {
  SPTR_GRID_STRIDE(e, segments * h) { softmax_backward_item<at::opmath_type<T>>(grad, y, dsrc, indptr, M, h, e); }
}

// Grid for the shared-table kernels: blocks along x for one head, so x * h blocks fill the device.
dim3 shared_table_grid(int64_t work_per_head, int64_t h) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t want = (work_per_head + kThreads - 1) / kThreads;
  const int64_t cap = std::max<int64_t>(1, sms * 8 / std::max<int64_t>(h, 1));
  return dim3(static_cast<unsigned int>(std::max<int64_t>(1, std::min(want, cap))), static_cast<unsigned int>(h));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> window_precompute_all_cuda(const at::Tensor& counts,
                                                                                      int64_t N) {
  c10::cuda::CUDAGuard guard(counts.device());
  WindowLayout w = window_layout(counts, N);
  auto opts = counts.options().dtype(at::kInt);
  auto index_0_offsets = at::empty({N + 1}, opts), index_1_offsets = at::empty({N}, opts);
  auto index_0 = at::empty({w.num_pairs}, opts), index_1 = at::empty({w.num_pairs}, opts);
  if (N > 0) {
    auto stream = at::cuda::getCurrentCUDAStream();
    precompute_all_kernel<<<grid_for(N * 32, kThreads), kThreads, 0, stream>>>(
        w.point_window.const_data_ptr<int64_t>(), w.counts.const_data_ptr<int64_t>(),
        w.first_point.const_data_ptr<int64_t>(), w.first_pair.const_data_ptr<int64_t>(), N,
        index_0_offsets.mutable_data_ptr<int32_t>(), index_1_offsets.mutable_data_ptr<int32_t>(),
        index_0.mutable_data_ptr<int32_t>(), index_1.mutable_data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  index_0_offsets[N].fill_(w.num_pairs);
  return {index_0_offsets, index_1_offsets, index_0, index_1};
}

at::Tensor window_pair_logits_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& index_0,
                                       const at::Tensor& index_1, const std::optional<at::Tensor>& table_q,
                                       const std::optional<at::Tensor>& table_k,
                                       const std::optional<at::Tensor>& rel_idx, bool with_qk) {
  c10::cuda::CUDAGuard guard(q.device());
  PairLogitOperands ops(q, k, index_0, index_1, table_q, table_k, rel_idx);
  auto out = at::empty({ops.M, ops.h}, ops.q.options());
  if (out.numel() == 0) return out;
  SPTR_DISPATCH_FLOATING(ops.q.scalar_type(), "window_pair_logits_fwd_cuda", [&] {
    pair_logits_kernel<scalar_t><<<grid_for(out.numel(), kThreads), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        ops.args<scalar_t>(with_qk), out.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> window_pair_logits_bwd_cuda(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& index_0,
    const at::Tensor& index_1, const std::optional<at::Tensor>& table_q, const std::optional<at::Tensor>& table_k,
    const std::optional<at::Tensor>& rel_idx, bool with_qk) {
  c10::cuda::CUDAGuard guard(q.device());
  PairLogitOperands ops(q, k, index_0, index_1, table_q, table_k, rel_idx);
  SPTR_CHECK_VALUE(grad.dim() == 2 && grad.size(0) == ops.M && grad.size(1) == ops.h, "grad must have shape (",
                    ops.M, ", ", ops.h, "), got ", grad.sizes());
  auto g = grad.to(ops.q.scalar_type()).contiguous();
  GradBuffers grads(ops.q, {ops.q, ops.k, ops.table_q, ops.table_k});
  if (ops.M * ops.h * ops.d > 0) {
    SPTR_DISPATCH_FLOATING(ops.q.scalar_type(), "window_pair_logits_bwd_cuda", [&] {
      using A = at::opmath_type<scalar_t>;
      auto args = ops.args<scalar_t>(with_qk);
      LogitGradSink<A, AtomicAdd> sink{grads.ptr<A>(0), grads.ptr<A>(1), grads.ptr<A>(2), grads.ptr<A>(3)};
      auto stream = at::cuda::getCurrentCUDAStream();
      const int tables = ops.table_q.defined() + ops.table_k.defined();
      const size_t smem = sizeof(A) * args.L * 3 * ops.d * tables;
      if (tables > 0 && smem <= kSharedTableBytes) {
        pair_logits_backward_shared_kernel<scalar_t, A><<<shared_table_grid(ops.M * ops.d, ops.h), kThreads, smem, stream>>>(
            args, g.const_data_ptr<scalar_t>(), sink);
      } else {
        pair_logits_backward_kernel<scalar_t, A><<<grid_for(ops.M * ops.h * ops.d, kThreads), kThreads, 0, stream>>>(
            args, g.const_data_ptr<scalar_t>(), sink);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return {grads.result(0), grads.result(1), grads.result(2), grads.result(3)};
}

at::Tensor window_aggregate_fwd_cuda(const at::Tensor& attn, const at::Tensor& v, const at::Tensor& index_0_offsets,
                                     const at::Tensor& index_1, const std::optional<at::Tensor>& table_v,
                                     const std::optional<at::Tensor>& rel_idx) {
  c10::cuda::CUDAGuard guard(v.device());
  AggregateOperands ops(attn, v, index_0_offsets, std::nullopt, index_1, table_v, rel_idx);
  auto out = at::empty({ops.N, ops.h, ops.d}, ops.v.options());
  if (out.numel() == 0) return out;
  SPTR_DISPATCH_FLOATING(ops.v.scalar_type(), "window_aggregate_fwd_cuda", [&] {
    aggregate_kernel<scalar_t><<<grid_for(out.numel(), kThreads), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        ops.args<scalar_t>(), out.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> window_aggregate_bwd_cuda(
    const at::Tensor& grad, const at::Tensor& attn, const at::Tensor& v, const at::Tensor& index_0,
    const at::Tensor& index_0_offsets, const at::Tensor& index_1, const std::optional<at::Tensor>& table_v,
    const std::optional<at::Tensor>& rel_idx) {
  c10::cuda::CUDAGuard guard(v.device());
  AggregateOperands ops(attn, v, index_0_offsets, index_0, index_1, table_v, rel_idx);
  SPTR_CHECK_VALUE(grad.dim() == 3 && grad.size(0) == ops.N && grad.size(1) == ops.h && grad.size(2) == ops.d,
                    "grad must have shape (", ops.N, ", ", ops.h, ", ", ops.d, "), got ", grad.sizes());
  auto g = grad.to(ops.v.scalar_type()).contiguous();
  auto dattn = at::empty_like(ops.attn);
  GradBuffers grads(ops.v, {ops.v, ops.table_v});
  if (ops.M * ops.h * ops.d > 0) {
    SPTR_DISPATCH_FLOATING(ops.v.scalar_type(), "window_aggregate_bwd_cuda", [&] {
      using A = at::opmath_type<scalar_t>;
      auto args = ops.args<scalar_t>();
      auto stream = at::cuda::getCurrentCUDAStream();
      const scalar_t* gp = g.const_data_ptr<scalar_t>();
      aggregate_attn_grad_kernel<scalar_t><<<grid_for(ops.M * ops.h, kThreads), kThreads, 0, stream>>>(
          args, gp, dattn.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      AggregateGradSink<A, AtomicAdd> sink{grads.ptr<A>(0), grads.ptr<A>(1)};
      const size_t smem = sizeof(A) * args.L * 3 * ops.d;
      if (ops.table_v.defined() && smem <= kSharedTableBytes) {
        aggregate_backward_shared_kernel<scalar_t, A><<<shared_table_grid(ops.M * ops.d, ops.h), kThreads, smem, stream>>>(
            args, gp, sink);
      } else {
        aggregate_backward_kernel<scalar_t, A><<<grid_for(ops.M * ops.h * ops.d, kThreads), kThreads, 0, stream>>>(
            args, gp, sink);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  } else {
    dattn.zero_();
  }
  return {dattn, grads.result(0), grads.result(1)};
}

at::Tensor window_softmax_fwd_cuda(const at::Tensor& src, const at::Tensor& indptr) {
  c10::cuda::CUDAGuard guard(src.device());
  SoftmaxOperands ops(src, indptr, std::nullopt);
  auto out = at::zeros_like(ops.x);
  if (ops.segments * ops.h == 0) return out;
  SPTR_DISPATCH_FLOATING(ops.x.scalar_type(), "window_softmax_fwd_cuda", [&] {
    softmax_kernel<scalar_t><<<grid_for(ops.segments * ops.h, kThreads), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        ops.x.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), int_view(ops.indptr), ops.segments, ops.M,
        ops.h);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor window_softmax_bwd_cuda(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& indptr) {
  c10::cuda::CUDAGuard guard(out.device());
  SoftmaxOperands ops(out, indptr, grad);
  auto dsrc = at::zeros_like(ops.x);
  if (ops.segments * ops.h == 0) return dsrc;
  SPTR_DISPATCH_FLOATING(ops.x.scalar_type(), "window_softmax_bwd_cuda", [&] {
    softmax_backward_kernel<scalar_t><<<grid_for(ops.segments * ops.h, kThreads), kThreads, 0,
                                        at::cuda::getCurrentCUDAStream()>>>(
        ops.grad.const_data_ptr<scalar_t>(), ops.x.const_data_ptr<scalar_t>(), dsrc.mutable_data_ptr<scalar_t>(),
        int_view(ops.indptr), ops.segments, ops.M, ops.h);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return dsrc;
}

// out[dest[i]] = x[i], one thread per vector of V bytes of a row (rows of `row_vectors` vectors, x's rows
// `x_stride` vectors apart). A dest outside [0, N) (not a permutation: the callers pass checked or constructed
// ones) skips its row instead of writing out of bounds.
template <typename V>
__global__ void permute_rows_kernel(const V* __restrict__ x, const int64_t* __restrict__ dest, int64_t N,
                                    int64_t row_vectors, int64_t x_stride, V* __restrict__ out) {
  SPTR_GRID_STRIDE(e, N * row_vectors) {
    const int64_t i = e / row_vectors, c = e - i * row_vectors, d = dest[i];
    if (d >= 0 && d < N) out[d * row_vectors + c] = x[i * x_stride + c];
  }
}

template <typename V>
void launch_permute_rows(const at::Tensor& x, const at::Tensor& dest, int64_t row_bytes, at::Tensor& out) {
  const int64_t N = x.size(0), row_vectors = row_bytes / sizeof(V);
  const int64_t x_stride = x.stride(0) * x.element_size() / static_cast<int64_t>(sizeof(V));
  permute_rows_kernel<V><<<grid_for(N * row_vectors, kThreads), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const V*>(x.const_data_ptr()), dest.const_data_ptr<int64_t>(), N, row_vectors, x_stride,
      static_cast<V*>(out.mutable_data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// out[dest[i]] = x[i] cast to Out, VEC elements a thread (rows of `row_vecs` packs, x's rows `x_stride` packs
// apart), each element converted as ATen's copy converts it.
template <typename In, typename Out, int VEC>
__global__ void permute_cast_rows_kernel(const In* __restrict__ x, const int64_t* __restrict__ dest, int64_t N,
                                         int64_t row_vecs, int64_t x_stride, Out* __restrict__ out) {
  struct alignas(sizeof(In) * VEC) InPack { In v[VEC]; };
  struct alignas(sizeof(Out) * VEC) OutPack { Out v[VEC]; };
  SPTR_GRID_STRIDE(e, N * row_vecs) {
    const int64_t i = e / row_vecs, c = e - i * row_vecs, d = dest[i];
    if (d < 0 || d >= N) continue;
    const InPack p = reinterpret_cast<const InPack*>(x)[i * x_stride + c];
    OutPack q;
#pragma unroll
    for (int j = 0; j < VEC; ++j) q.v[j] = c10::static_cast_with_inter_type<Out, In>::apply(p.v[j]);
    reinterpret_cast<OutPack*>(out)[d * row_vecs + c] = q;
  }
}

template <int VEC>
void launch_permute_cast_rows(const at::Tensor& x, const at::Tensor& dest, int64_t row_elems, at::Tensor& out) {
  const int64_t N = x.size(0), row_vecs = row_elems / VEC, x_stride = x.stride(0) / VEC;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "window_permute_rows", [&] {
    using In = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "window_permute_rows", [&] {
      permute_cast_rows_kernel<In, scalar_t, VEC>
          <<<grid_for(N * row_vecs, kThreads), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
              x.const_data_ptr<In>(), dest.const_data_ptr<int64_t>(), N, row_vecs, x_stride,
              out.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

// Rows whose elements are contiguous (a row stride of any size: the q, k, v views of a fused qkv projection)
// are copied as they are; other layouts first become contiguous. Without a cast, vectors of up to 16 bytes, as
// wide as the row size, row stride and both addresses allow; with one, packs of 4 elements where they allow.
at::Tensor window_permute_rows_cuda(const at::Tensor& x_, const at::Tensor& dest, const at::Tensor& source,
                                    std::optional<at::ScalarType> dtype) {
  const at::ScalarType out_dtype = check_permute_rows(x_, dest, source, dtype);
  c10::cuda::CUDAGuard guard(x_.device());
  bool rows_contiguous = true;
  for (int64_t dim = x_.dim() - 1, expected = 1; dim > 0; expected *= x_.size(dim--))
    rows_contiguous = rows_contiguous && (x_.size(dim) == 1 || x_.stride(dim) == expected);
  const at::Tensor x = rows_contiguous ? x_ : x_.contiguous();
  auto out = at::empty(x.sizes(), x.options().dtype(out_dtype));
  const int64_t N = x.size(0);
  if (out.numel() == 0) return out;
  const auto d = dest.contiguous();
  const int64_t row_elems = x.numel() / N;
  if (out_dtype != x.scalar_type()) {
    const auto x_addr = reinterpret_cast<uintptr_t>(x.const_data_ptr());
    const auto out_addr = reinterpret_cast<uintptr_t>(out.const_data_ptr());
    if ((row_elems | x.stride(0)) % 4 == 0 && x_addr % (4 * x.element_size()) == 0 &&
        out_addr % (4 * out.element_size()) == 0)
      launch_permute_cast_rows<4>(x, d, row_elems, out);
    else
      launch_permute_cast_rows<1>(x, d, row_elems, out);
    return out;
  }
  const int64_t row_bytes = row_elems * x.element_size();
  const uint64_t bits = static_cast<uint64_t>(row_bytes) | static_cast<uint64_t>(x.stride(0) * x.element_size()) |
                        reinterpret_cast<uintptr_t>(x.const_data_ptr()) | reinterpret_cast<uintptr_t>(out.const_data_ptr());
  if (bits % 16 == 0) launch_permute_rows<uint4>(x, d, row_bytes, out);
  else if (bits % 8 == 0) launch_permute_rows<uint2>(x, d, row_bytes, out);
  else if (bits % 4 == 0) launch_permute_rows<uint32_t>(x, d, row_bytes, out);
  else if (bits % 2 == 0) launch_permute_rows<uint16_t>(x, d, row_bytes, out);
  else launch_permute_rows<uint8_t>(x, d, row_bytes, out);
  return out;
}

TORCH_LIBRARY_IMPL(sptr, CUDA, m) {
  m.impl("window_precompute_all", &window_precompute_all_cuda);
  m.impl("window_sort", &window_sort);
  m.impl("window_permute_rows", &window_permute_rows_cuda);
  m.impl("window_pair_logits_fwd", &window_pair_logits_fwd_cuda);
  m.impl("window_pair_logits_bwd", &window_pair_logits_bwd_cuda);
  m.impl("window_aggregate_fwd", &window_aggregate_fwd_cuda);
  m.impl("window_aggregate_bwd", &window_aggregate_bwd_cuda);
  m.impl("window_softmax_fwd", &window_softmax_fwd_cuda);
  m.impl("window_softmax_bwd", &window_softmax_bwd_cuda);
}

}  // namespace sptr
