// CUDA forward of the fused window attention (flash-attention style over variable-size windows).
// Pass 1 finds each row's log-sum-exp, pass 2 accumulates the exactly normalised P·V (no rescaling, so the
// value-table histogram needs none either); only out and lse are stored.
#include <torch/library.h>

#include <sptr/dispatch.h>

#include "fused_window_attention_tiles.cuh"

namespace sptr {
namespace {

// -------------------------------------------------------------------------------------------- forward
template <int DP, typename T>
struct FwdSmem {
  using A = acc_t<T>;
  TokenInfo qi, ki;
  T *Q, *K, *V, *P, *Ts;
  A *S, *O, *Qt, *Kt, *Hv, *lse;
  __host__ __device__ FwdSmem(Bump& b, const Args<T>& a)
      : qi(b, a), ki(b, a), Q(b.take<T>(kBM * kLDT<DP>)), K(b.take<T>(kBM * kLDT<DP>)), V(b.take<T>(kBM * kLDT<DP>)),
        P(b.take<T>(kBM * kLDP)), Ts(b.take_if<T>(a.has_rel(), a.L3p * kLDT<DP>)), S(b.take<A>(kBM * kLDS)),
        O(b.take<A>(kBM * kLDO<DP>)), Qt(b.take_if<A>(a.tq != nullptr, kBM * a.L3p)),
        Kt(b.take_if<A>(a.tk != nullptr, kBM * a.L3p)), Hv(b.take_if<A>(a.tv != nullptr, kBM * a.L3p)),
        lse(b.take<A>(kBM)) {}
};

template <int DP, typename T, bool REL>
__global__ void __launch_bounds__(kThreads, REL ? 3 : 6) fwd_kernel(const Args<T> a) {
  using A = acc_t<T>;
  extern __shared__ __align__(128) char smem[];
  Bump bump(smem);
  const FwdSmem<DP, T> s(bump, a);
  const int h = blockIdx.y, tid = threadIdx.x, r = tid >> 2, cb = (tid & 3) * 8;
  const int ntiles = (a.N + kBM - 1) / kBM;
  for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const int r0 = tile * kBM, nrows = min(kBM, a.N - r0);
    __syncthreads();
    load_token_info(s.qi, a, r0, nrows, true);
    load_rows<DP>(s.Q, a.q, a, r0, nrows, h);
    __syncthreads();
    const int kbeg = s.qi.lo[0], kend = s.qi.hi[nrows - 1], lo_r = s.qi.lo[r], hi_r = s.qi.hi[r];
    if (a.tq) {
      stage_table<DP>(s.Ts, a.tq, a, h);
      __syncthreads();
      gemm_nt<DP>(s.Qt, a.L3p, s.Q, s.Ts, a.L3p / 16);
      __syncthreads();
    }
    if (a.tk) stage_table<DP>(s.Ts, a.tk, a, h);
    if (a.tv) zero_smem(s.Hv, kBM * a.L3p);
    A m = -std::numeric_limits<A>::infinity(), l = 0, lse_r = 0;
    OutTiles<DP, T> acc;
    acc.zero();
    for (int pass = 0; pass < 2; ++pass) {
      for (int c0 = kbeg; c0 < kend; c0 += kBM) {
        const int ncols = min(kBM, kend - c0);
        __syncthreads();
        if (REL) load_token_info(s.ki, a, c0, ncols, false);
        load_rows<DP>(s.K, a.k, a, c0, ncols, h);
        if (pass == 1) load_rows<DP>(s.V, a.v, a, c0, ncols, h);
        __syncthreads();
        if (a.tk) gemm_nt<DP>(s.Kt, a.L3p, s.K, s.Ts, a.L3p / 16);
        gemm_nt<DP>(s.S, kLDS, s.Q, s.K, kBM / 16);
        __syncthreads();
        uint32_t rows[8] = {};
        A p[8];
        unsigned valid = 0;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int col = cb + e, j = c0 + col;
          p[e] = 0;
          if (j >= lo_r && j < hi_r) {
            valid |= 1u << e;
            if (REL) rows[e] = pair_rows(a.rel, s.qi, s.ki, r, col);
            const A sv = pair_logit<REL>(a, s.S[r * kLDS + col], products_row(s.Qt, r, a.L3p, s.S),
                                         products_row(s.Kt, col, a.L3p, s.S), rows[e]);
            if (pass == 0) {
              if (sv > m) {
                l = l * exp_acc<T>(m - sv) + A(1);
                m = sv;
              } else {
                l += exp_acc<T>(sv - m);
              }
            } else {
              p[e] = exp_acc<T>(sv - lse_r);
            }
          }
          if (pass == 1) s.P[r * kLDP + col] = narrow<T>(p[e]);
        }
        if (pass == 1) {
          if (REL && a.tv) quad_ordered_add(s.Hv + r * a.L3p, rows, p, valid);
          __syncthreads();
          acc.template mma<false>(s.P, s.V);
        }
      }
      if (pass == 0) {
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
          const A m2 = __shfl_xor_sync(0xffffffffu, m, off), l2 = __shfl_xor_sync(0xffffffffu, l, off);
          const A mn = max(m, m2);
          l = (l > A(0) ? l * exp_acc<T>(m - mn) : A(0)) + (l2 > A(0) ? l2 * exp_acc<T>(m2 - mn) : A(0));
          m = mn;
        }
        lse_r = l > A(0) ? m + log(l) : A(0);
        if ((tid & 3) == 0) s.lse[r] = lse_r;
      }
    }
    __syncthreads();
    acc.store(s.O);
    if (a.tv) stage_table<DP>(s.Ts, a.tv, a, h);
    __syncthreads();
    write_rows<DP>(a.o, s.O, REL && a.tv, s.Hv, s.Ts, a, r0, nrows, h, A(1));
    if (tid < nrows) a.lse[(int64_t)(r0 + tid) * a.H + h] = s.lse[tid];
  }
}

std::tuple<at::Tensor, at::Tensor> window_attention_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& offsets,
    const std::optional<at::Tensor>& coords, const std::optional<at::Tensor>& radius,
    const std::optional<at::Tensor>& table_q, const std::optional<at::Tensor>& table_k,
    const std::optional<at::Tensor>& table_v, int64_t rel_shift, double radial_a, double scale,
    bool /*deterministic: used by the backward*/) {
  const c10::cuda::CUDAGuard guard(q.device());
  FusedOperands o(q, k, v, offsets, coords, radius, table_q, table_k, table_v, rel_shift, radial_a);
  at::Tensor out = at::empty_like(o.q);
  at::Tensor lse = at::empty({o.N, o.H}, o.q.options().dtype(at::toOpMathType(o.q.scalar_type())));
  if (o.N == 0) return {out, lse};
  const at::Tensor bounds = token_bounds(o);
  SPTR_DISPATCH_FLOATING(o.q.scalar_type(), "window_attention_fwd_cuda", [&] {
    using T = typename CudaType<scalar_t>::type;
    Args<T> a = make_args<T, scalar_t>(o, scale, bounds);
    a.o = reinterpret_cast<T*>(out.data_ptr<scalar_t>());
    a.lse = lse.data_ptr<acc_t<T>>();
    dispatch_head_dim(o.d, [&](auto dp) {
      dispatch_rel(o, [&](auto rel) {
        constexpr int DP = decltype(dp)::value;
        constexpr bool REL = decltype(rel)::value;
        const size_t bytes = prepare<FwdSmem<DP, T>>(fwd_kernel<DP, T, REL>, a, "window_attention");
        launch(fwd_kernel<DP, T, REL>, a, num_tiles(o), bytes);
      });
    });
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(sptr, CUDA, m) { m.impl("window_attention_fwd", &window_attention_fwd_cuda); }

}  // namespace sptr
