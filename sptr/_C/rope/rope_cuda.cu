// mRoPE on CUDA: one thread per (position, group of pairs) over the heads; strided loads, so transposed views
// need no copies.
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <sptr/cuda_utils.cuh>

#include "rope_host.h"

namespace sptr {
namespace {

constexpr int kThreads = 128;
constexpr int kHeadsInFlight = 6;

template <typename T>
struct Packed2;
template <>
struct Packed2<at::Half> {
  using type = __half2;
};
template <>
struct Packed2<at::BFloat16> {
  using type = __nv_bfloat162;
};

// fp16/bf16 x, tables and output of x's dtype: rotate_store's arithmetic two elements per instruction. A
// product of two 16-bit values is exact in fp32, so the 16-bit multiply rounds it as rotate_store does; fp32
// (24 bits) is wider than 2p + 2 bits of either 16-bit format, so rounding the fp32 sum to 16 bits equals
// rounding the exact sum once, which the 16-bit add does. The _rn forms forbid contraction into an fma.
template <int V, typename T, typename C, typename O, typename R>
constexpr bool kPackedMath = V % 2 == 0 && std::is_same_v<C, T> && std::is_same_v<O, T> && std::is_same_v<R, T> &&
                             (std::is_same_v<T, at::Half> || std::is_same_v<T, at::BFloat16>);

template <int V, typename T>
__device__ __forceinline__ void rotate_store_packed(const PairRow<V, T>& in, const PairTables<V, T>& tab,
                                                    bool backward, T* out, int64_t j0, int64_t half) {
  using P = typename Packed2<T>::type;
  const P* a = reinterpret_cast<const P*>(in.lo.v);
  const P* z = reinterpret_cast<const P*>(in.hi.v);
  const P* c0 = reinterpret_cast<const P*>(tab.c0.v);
  const P* s0 = reinterpret_cast<const P*>(tab.s0.v);
  const P* c1 = reinterpret_cast<const P*>(tab.c1.v);
  const P* s1 = reinterpret_cast<const P*>(tab.s1.v);
  Pack<T, V> olo, ohi;
  P* lo = reinterpret_cast<P*>(olo.v);
  P* hi = reinterpret_cast<P*>(ohi.v);
#pragma unroll
  for (int i = 0; i < V / 2; ++i) {
    if (!backward) {  // (x1 cos - x2 sin, x2 cos + x1 sin)
      lo[i] = __hsub2_rn(__hmul2_rn(a[i], c0[i]), __hmul2_rn(z[i], s0[i]));
      hi[i] = __hadd2_rn(__hmul2_rn(z[i], c1[i]), __hmul2_rn(a[i], s1[i]));
    } else {          // (g1 cos + g2 sin, g2 cos - g1 sin)
      lo[i] = __hadd2_rn(__hmul2_rn(a[i], c0[i]), __hmul2_rn(z[i], s1[i]));
      hi[i] = __hsub2_rn(__hmul2_rn(z[i], c1[i]), __hmul2_rn(a[i], s0[i]));
    }
  }
  *reinterpret_cast<Pack<T, V>*>(out + j0) = olo;
  *reinterpret_cast<Pack<T, V>*>(out + j0 + half) = ohi;
}

// Pairs [j0, j0 + V) of head hh (q heads first) at (b, s); the row is recomputed for the store, which takes
// fewer registers than keeping its pointer across the loads of the other heads in flight.
template <int V, typename T, typename C, typename O, typename R>
__device__ __forceinline__ PairRow<V, T> load_head(const RopeArgs<T, C, O, R>& p, int b, int s, int hh, int64_t j0) {
  const HeadRow<T, O> row = head_row(p, b, s, hh);
  return load_pairs<V>(row.x, row.x_step, j0, p.D / 2);
}

template <int V, typename T, typename C, typename O, typename R>
__device__ __forceinline__ void store_head(const RopeArgs<T, C, O, R>& p, int b, int s, int hh, int64_t j0,
                                           const PairRow<V, T>& pairs, const PairTables<V, C>& tab) {
  const HeadRow<T, O> row = head_row(p, b, s, hh);
  if constexpr (kPackedMath<V, T, C, O, R>) rotate_store_packed<V>(pairs, tab, p.backward, row.out, j0, p.D / 2);
  else rotate_store<R>(pairs, tab, p.backward, row.out, row.out_step, j0, p.D / 2);
}

// CTA = `positions` (b, s) positions × min(G, kThreads) threads (G = D / 2 / V pair groups per head) × one
// chunk of heads; the chunks of a tile are neighbouring CTAs, so the tables they share come from L2. A thread
// loads cos/sin of its pairs once (kept as stored), then rotates them for the heads of its chunk, q heads
// first, kHeadsInFlight at a time: all their loads are issued before the first store (the compiler may not
// move a load above a store that can alias it, and one head per round trip leaves HBM mostly idle). Every
// pair belongs to one thread, which reads it before writing it, so in-place (out == x) stays exact.
// Positions are int32 (the launcher checks B * S < 2^31): 64-bit division is a long subroutine.
template <int V, typename T, typename C, typename O, typename R>
__global__ void __launch_bounds__(kThreads, 3) mrope_rows_kernel(RopeArgs<T, C, O, R> p, int groups, int positions,
                                                                  int heads_per_chunk, int chunks) {
  const int lanes = groups < kThreads ? groups : kThreads;
  const int slot = threadIdx.x / lanes;
  const int bs = static_cast<int>(blockIdx.x / chunks) * positions + slot;
  const int S = static_cast<int>(p.S);
  if (slot >= positions || bs >= static_cast<int>(p.B) * S) return;
  const int b = bs / S, s = bs - b * S;
  const int heads = static_cast<int>(p.heads[0] + p.heads[1]);
  const int h_begin = static_cast<int>(blockIdx.x % chunks) * heads_per_chunk;
  const int h_end = h_begin + heads_per_chunk < heads ? h_begin + heads_per_chunk : heads;
  for (int g = threadIdx.x % lanes; g < groups; g += lanes) {
    const int64_t j0 = static_cast<int64_t>(g) * V;
    const auto tab = load_pair_tables<V>(p, b, s, j0);
    for (int h0 = h_begin; h0 < h_end; h0 += kHeadsInFlight) {
      PairRow<V, T> rows[kHeadsInFlight];
#pragma unroll
      for (int u = 0; u < kHeadsInFlight; ++u)
        if (h0 + u < h_end) rows[u] = load_head<V>(p, b, s, h0 + u, j0);
#pragma unroll
      for (int u = 0; u < kHeadsInFlight; ++u)
        if (h0 + u < h_end) store_head<V>(p, b, s, h0 + u, j0, rows[u], tab);
    }
  }
}

struct CudaRope {
  template <int V, typename T, typename C, typename O, typename R>
  static void run(const RopeArgs<T, C, O, R>& p) {
    const int64_t groups = p.D / 2 / V;
    SPTR_CHECK_VALUE(groups < (int64_t(1) << 31), "mRoPE on CUDA: head_dim ", p.D, " is too large");
    SPTR_CHECK_VALUE(p.B * p.S < (int64_t(1) << 31), "mRoPE on CUDA: B * S = ", p.B * p.S,
                     " positions is too many (at most 2^31 - 1)");
    const int positions = static_cast<int>(std::max<int64_t>(1, kThreads / groups));
    const int64_t tiles = (p.B * p.S + positions - 1) / positions;
    // All heads of a position in one CTA (each table load serves every head; measured on the H200, shorter
    // chunks were slower at every length down to one head) unless there are fewer than two tiles per SM:
    // then the heads are split into chunks until there are.
    const int64_t heads = p.heads[0] + p.heads[1];
    const int64_t want = 2 * static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
    const int64_t split = std::min<int64_t>(heads, std::max<int64_t>(1, (want + tiles - 1) / tiles));
    const int64_t per_chunk = (heads + split - 1) / split;
    const int64_t chunks = (heads + per_chunk - 1) / per_chunk;
    SPTR_CHECK_VALUE(tiles * chunks < (int64_t(1) << 31), "mRoPE on CUDA: B * S = ", p.B * p.S, " is too large");
    mrope_rows_kernel<V><<<static_cast<unsigned>(tiles * chunks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        p, static_cast<int>(groups), positions, static_cast<int>(per_chunk), static_cast<int>(chunks));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  template <typename T, typename C, typename O, typename R>
  static void launch(RopeArgs<T, C, O, R> p) {
    if (p.B * p.S * p.D * (p.heads[0] + p.heads[1]) == 0) return;
    constexpr int kWide = 16 / sizeof(T) > 1 ? 16 / sizeof(T) : 1;
    if (kWide > 1 && rope_vector_width(p) == kWide) run<kWide>(p);
    else run<1>(p);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(sptr, CUDA, m) {
  m.impl("mrope_fwd", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& c, const at::Tensor& s,
                         at::IntArrayRef sec, bool hf, bool promote) {
    c10::cuda::CUDAGuard guard(q.device());
    return mrope_fwd_impl<CudaRope>(q, k, c, s, sec, hf, promote);
  });
  m.impl("mrope_fwd_out", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& c, const at::Tensor& s,
                             at::IntArrayRef sec, bool hf, const at::Tensor& qo, const at::Tensor& ko) {
    c10::cuda::CUDAGuard guard(q.device());
    mrope_fwd_out_impl<CudaRope>(q, k, c, s, sec, hf, qo, ko);
  });
  m.impl("mrope_", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& c, const at::Tensor& s,
                      at::IntArrayRef sec, bool hf) {
    c10::cuda::CUDAGuard guard(q.device());
    mrope_inplace_impl<CudaRope>(q, k, c, s, sec, hf);
  });
  m.impl("mrope_rebased_", [](const at::Tensor& qb, const at::Tensor& kb, const at::Tensor& c, const at::Tensor& s,
                              at::IntArrayRef sec, bool hf, at::IntArrayRef qs, at::IntArrayRef qst,
                              at::IntArrayRef ks, at::IntArrayRef kst) {
    c10::cuda::CUDAGuard guard(qb.device());
    mrope_rebased_impl<CudaRope>(qb, kb, c, s, sec, hf, qs, qst, ks, kst);
  });
  m.impl("mrope_bwd", [](const at::Tensor& gq, const at::Tensor& gk, const at::Tensor& c, const at::Tensor& s,
                         at::IntArrayRef sec, bool hf, std::optional<at::ScalarType> input_dtype) {
    c10::cuda::CUDAGuard guard(gq.device());
    return mrope_bwd_impl<CudaRope>(gq, gk, c, s, sec, hf, input_dtype);
  });
  m.impl("mrope_bwd_", [](const at::Tensor& gq, const at::Tensor& gk, const at::Tensor& c, const at::Tensor& s,
                          at::IntArrayRef sec, bool hf) {
    c10::cuda::CUDAGuard guard(gq.device());
    mrope_inplace_impl<CudaRope, true>(gq, gk, c, s, sec, hf);
  });
}

}  // namespace sptr
