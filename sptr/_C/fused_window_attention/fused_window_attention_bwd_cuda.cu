// CUDA backward of the fused window attention: one kernel over query tiles (dq, table-q and table-v
// gradients, delta), one over key tiles (dk, dv, table-k gradient); both recompute P from the saved lse.
// No global atomics: a q/k/v gradient row belongs to one tile, and each persistent CTA adds its tiles' table
// gradients into a slot of its own, summed over slots at the end. Histograms are summed in a fixed order
// too, so the result depends only on which CTA took which tile: `deterministic` fixes that (round-robin),
// otherwise tiles go to whichever CTA is free (atomic counter).
#include <torch/library.h>

#include <sptr/dispatch.h>

#include "fused_window_attention_tiles.cuh"

namespace sptr {
namespace {

// ------------------------------------------------------------------------------- backward, query side
template <int DP, typename T>
struct DqSmem {
  using A = acc_t<T>;
  TokenInfo qi, ki;
  T *Q, *dO, *K, *V, *dS, *Ts;
  A *S, *dP, *O, *Qt, *Gt, *Kt, *Hq, *Hv, *lse, *delta;
  __host__ __device__ DqSmem(Bump& b, const Args<T>& a)
      : qi(b, a), ki(b, a), Q(b.take<T>(kBM * kLDT<DP>)), dO(b.take<T>(kBM * kLDT<DP>)),
        K(b.take<T>(kBM * kLDT<DP>)), V(b.take<T>(kBM * kLDT<DP>)), dS(b.take<T>(kBM * kLDP)),
        Ts(b.take_if<T>(a.has_rel(), a.L3p * kLDT<DP>)), S(b.take<A>(kBM * kLDS)), dP(b.take<A>(kBM * kLDS)),
        O(b.take<A>(kBM * kLDO<DP>)), Qt(b.take_if<A>(a.tq != nullptr, kBM * a.L3p)),
        Gt(b.take_if<A>(a.tv != nullptr, kBM * a.L3p)), Kt(b.take_if<A>(a.tk != nullptr, kBM * a.L3p)),
        Hq(b.take_if<A>(a.tq != nullptr, kBM * a.L3p)), Hv(b.take_if<A>(a.tv != nullptr, kBM * a.L3p)),
        lse(b.take<A>(kBM)), delta(b.take<A>(kBM)) {}
};

// Recomputed probability and logit gradient of pair (r, col): P from the saved lse, dS = P·(dP − delta).
template <typename T>
struct PairGrad {
  acc_t<T> p, ds;
};

template <bool REL, typename T, typename A>
__device__ __forceinline__ PairGrad<T> pair_grad(const Args<T>& a, A qk, A dpv, A lse, A delta, const A* qt,
                                                 const A* kt, const A* gt, uint32_t rows) {
  const A sv = pair_logit<REL>(a, qk, qt, kt, rows);
  const A p = exp_acc<T>(sv - lse);
  A dp = dpv;
  if (REL && a.tv) {
#pragma unroll
    for (int c = 0; c < 3; ++c) dp += gt[table_row(rows, c)];
  }
  return {p, p * (dp - delta)};
}

template <int DP, typename T, bool REL>
__global__ void __launch_bounds__(kThreads, REL ? 3 : 6) bwd_dq_kernel(const Args<T> a) {
  using A = acc_t<T>;
  extern __shared__ __align__(128) char smem[];
  Bump bump(smem);
  const DqSmem<DP, T> s(bump, a);
  __shared__ int tile_slot;
  const int h = blockIdx.y, tid = threadIdx.x, r = tid >> 2, cb = (tid & 3) * 8;
  const int ntiles = (a.N + kBM - 1) / kBM;
  for (int tile = next_tile(a, -1, &tile_slot); tile < ntiles; tile = next_tile(a, tile, &tile_slot)) {
    const int r0 = tile * kBM, nrows = min(kBM, a.N - r0);
    __syncthreads();
    load_token_info(s.qi, a, r0, nrows, true);
    load_rows<DP>(s.Q, a.q, a, r0, nrows, h);
    load_rows<DP>(s.dO, a.dout, a, r0, nrows, h);
    {  // delta_i = dO_i · O_i, kept for the key-side kernel too
      A part = 0;
      if (r < nrows) {
        const int64_t base = ((int64_t)(r0 + r) * a.H + h) * a.d;
        for (int c = tid & 3; c < a.d; c += 4) part += widen(a.dout[base + c]) * widen(a.out[base + c]);
      }
      part += __shfl_xor_sync(0xffffffffu, part, 1);
      part += __shfl_xor_sync(0xffffffffu, part, 2);
      if ((tid & 3) == 0) {
        s.delta[r] = part;
        s.lse[r] = r < nrows ? a.lse_in[(int64_t)(r0 + r) * a.H + h] : A(0);
        if (r < nrows) a.delta[(int64_t)(r0 + r) * a.H + h] = part;
      }
    }
    __syncthreads();
    const int kbeg = s.qi.lo[0], kend = s.qi.hi[nrows - 1], lo_r = s.qi.lo[r], hi_r = s.qi.hi[r];
    const A lse_r = s.lse[r], delta_r = s.delta[r];
    if (a.tq) {
      stage_table<DP>(s.Ts, a.tq, a, h);
      __syncthreads();
      gemm_nt<DP>(s.Qt, a.L3p, s.Q, s.Ts, a.L3p / 16);
      __syncthreads();
    }
    if (a.tv) {
      stage_table<DP>(s.Ts, a.tv, a, h);
      __syncthreads();
      gemm_nt<DP>(s.Gt, a.L3p, s.dO, s.Ts, a.L3p / 16);
      __syncthreads();
    }
    if (a.tk) stage_table<DP>(s.Ts, a.tk, a, h);
    if (a.tq) zero_smem(s.Hq, kBM * a.L3p);
    if (a.tv) zero_smem(s.Hv, kBM * a.L3p);
    OutTiles<DP, T> acc;
    acc.zero();
    for (int c0 = kbeg; c0 < kend; c0 += kBM) {
      const int ncols = min(kBM, kend - c0);
      __syncthreads();
      if (REL) load_token_info(s.ki, a, c0, ncols, false);
      load_rows<DP>(s.K, a.k, a, c0, ncols, h);
      load_rows<DP>(s.V, a.v, a, c0, ncols, h);
      __syncthreads();
      if (a.tk) gemm_nt<DP>(s.Kt, a.L3p, s.K, s.Ts, a.L3p / 16);
      gemm_nt<DP>(s.S, kLDS, s.Q, s.K, kBM / 16);
      gemm_nt<DP>(s.dP, kLDS, s.dO, s.V, kBM / 16);
      __syncthreads();
      uint32_t rows[8] = {};
      A p[8], ds[8];
      unsigned valid = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int col = cb + e, j = c0 + col;
        p[e] = ds[e] = 0;
        if (j >= lo_r && j < hi_r) {
          valid |= 1u << e;
          if (REL) rows[e] = pair_rows(a.rel, s.qi, s.ki, r, col);
          const PairGrad<T> g = pair_grad<REL>(a, s.S[r * kLDS + col], s.dP[r * kLDS + col], lse_r, delta_r,
                                          products_row(s.Qt, r, a.L3p, s.S), products_row(s.Kt, col, a.L3p, s.S),
                                          products_row(s.Gt, r, a.L3p, s.S), rows[e]);
          p[e] = g.p;
          ds[e] = g.ds;
        }
        s.dS[r * kLDP + col] = narrow<T>(ds[e]);
      }
      if (REL && a.tq) quad_ordered_add(s.Hq + r * a.L3p, rows, ds, valid);
      if (REL && a.tv) quad_ordered_add(s.Hv + r * a.L3p, rows, p, valid);
      __syncthreads();
      acc.template mma<false>(s.dS, s.K);
    }
    __syncthreads();
    acc.store(s.O);
    if (a.tq) stage_table<DP>(s.Ts, a.tq, a, h);
    __syncthreads();
    write_rows<DP>(a.dq, s.O, REL && a.tq, s.Hq, s.Ts, a, r0, nrows, h, a.scale);
    if (a.tq) table_grad<DP>(a.dtq, s.Hq, s.Q, a, h, a.scale);
    if (a.tv) table_grad<DP>(a.dtv, s.Hv, s.dO, a, h, A(1));
  }
}

// --------------------------------------------------------------------------------- backward, key side
template <int DP, typename T>
struct DkvSmem {
  using A = acc_t<T>;
  TokenInfo qi, ki;
  T *K, *V, *Q, *dO, *P, *dS, *Tq, *Tv;
  A *S, *dP, *Kt, *Hk, *scratch, *lse, *delta;
  A *Qt, *Gt, *Ok, *Ov;  // inside scratch: Qt, Gt while walking query blocks, Ok, Ov at the end
  __host__ __device__ DkvSmem(Bump& b, const Args<T>& a)
      : qi(b, a), ki(b, a), K(b.take<T>(kBM * kLDT<DP>)), V(b.take<T>(kBM * kLDT<DP>)),
        Q(b.take<T>(kBM * kLDT<DP>)), dO(b.take<T>(kBM * kLDT<DP>)), P(b.take<T>(kBM * kLDP)),
        dS(b.take<T>(kBM * kLDP)), Tq(b.take_if<T>(a.tq != nullptr || a.tk != nullptr, a.L3p * kLDT<DP>)),
        Tv(b.take_if<T>(a.tv != nullptr, a.L3p * kLDT<DP>)), S(b.take<A>(kBM * kLDS)), dP(b.take<A>(kBM * kLDS)),
        Kt(b.take_if<A>(a.tk != nullptr, kBM * a.L3p)), Hk(b.take_if<A>(a.tk != nullptr, kBM * a.L3p)),
        scratch(b.take<A>(imax(2 * kBM * kLDO<DP>, ((a.tq ? 1 : 0) + (a.tv ? 1 : 0)) * kBM * a.L3p))),
        lse(b.take<A>(kBM)), delta(b.take<A>(kBM)) {
    Qt = a.tq ? scratch : nullptr;
    Gt = a.tv ? scratch + (a.tq ? kBM * a.L3p : 0) : nullptr;
    Ok = scratch;
    Ov = scratch + kBM * kLDO<DP>;
  }
};

template <int DP, typename T, bool REL>
__global__ void __launch_bounds__(kThreads, REL ? 3 : 6) bwd_dkv_kernel(const Args<T> a) {
  using A = acc_t<T>;
  extern __shared__ __align__(128) char smem[];
  Bump bump(smem);
  const DkvSmem<DP, T> s(bump, a);
  __shared__ int tile_slot;
  // Pairs of a thread: one key (its histogram row), eight queries.
  const int h = blockIdx.y, tid = threadIdx.x, kc = tid >> 2, rb = (tid & 3) * 8;
  const int ntiles = (a.N + kBM - 1) / kBM;
  for (int tile = next_tile(a, -1, &tile_slot); tile < ntiles; tile = next_tile(a, tile, &tile_slot)) {
    const int c0 = tile * kBM, nkeys = min(kBM, a.N - c0);
    __syncthreads();
    load_token_info(s.ki, a, c0, nkeys, true);
    load_rows<DP>(s.K, a.k, a, c0, nkeys, h);
    load_rows<DP>(s.V, a.v, a, c0, nkeys, h);
    if (a.tk) stage_table<DP>(s.Tq, a.tk, a, h);
    __syncthreads();
    const int qbeg = s.ki.lo[0], qend = s.ki.hi[nkeys - 1];
    if (a.tk) {
      gemm_nt<DP>(s.Kt, a.L3p, s.K, s.Tq, a.L3p / 16);
      zero_smem(s.Hk, kBM * a.L3p);
      __syncthreads();
    }
    if (a.tq) stage_table<DP>(s.Tq, a.tq, a, h);
    if (a.tv) stage_table<DP>(s.Tv, a.tv, a, h);
    OutTiles<DP, T> dk, dv;
    dk.zero();
    dv.zero();
    for (int q0 = qbeg; q0 < qend; q0 += kBM) {
      const int nq = min(kBM, qend - q0);
      __syncthreads();
      if (REL) load_token_info(s.qi, a, q0, nq, false);
      load_rows<DP>(s.Q, a.q, a, q0, nq, h);
      load_rows<DP>(s.dO, a.dout, a, q0, nq, h);
      for (int t = tid; t < kBM; t += kThreads) {
        s.lse[t] = t < nq ? a.lse_in[(int64_t)(q0 + t) * a.H + h] : A(0);
        s.delta[t] = t < nq ? a.delta[(int64_t)(q0 + t) * a.H + h] : A(0);
      }
      __syncthreads();
      if (a.tq) gemm_nt<DP>(s.Qt, a.L3p, s.Q, s.Tq, a.L3p / 16);
      if (a.tv) gemm_nt<DP>(s.Gt, a.L3p, s.dO, s.Tv, a.L3p / 16);
      gemm_nt<DP>(s.S, kLDS, s.Q, s.K, kBM / 16);
      gemm_nt<DP>(s.dP, kLDS, s.dO, s.V, kBM / 16);
      __syncthreads();
      const int klo = s.ki.lo[kc], khi = s.ki.hi[kc];
      uint32_t rows[8] = {};
      A ds[8];
      unsigned valid = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int rq = rb + e, i = q0 + rq;
        PairGrad<T> g{A(0), A(0)};
        if (rq < nq && i >= klo && i < khi) {
          valid |= 1u << e;
          if (REL) rows[e] = pair_rows(a.rel, s.qi, s.ki, rq, kc);
          g = pair_grad<REL>(a, s.S[rq * kLDS + kc], s.dP[rq * kLDS + kc], s.lse[rq], s.delta[rq],
                        products_row(s.Qt, rq, a.L3p, s.S), products_row(s.Kt, kc, a.L3p, s.S),
                        products_row(s.Gt, rq, a.L3p, s.S), rows[e]);
        }
        ds[e] = g.ds;
        s.P[rq * kLDP + kc] = narrow<T>(g.p);
        s.dS[rq * kLDP + kc] = narrow<T>(g.ds);
      }
      if (REL && a.tk) quad_ordered_add(s.Hk + kc * a.L3p, rows, ds, valid);
      __syncthreads();
      dk.template mma<true>(s.dS, s.Q);
      dv.template mma<true>(s.P, s.dO);
    }
    __syncthreads();
    dk.store(s.Ok);
    dv.store(s.Ov);
    if (a.tk) stage_table<DP>(s.Tq, a.tk, a, h);
    __syncthreads();
    // dk = scale·dSᵀQ + Σ_n Hk[n]·Tk[n]: the scale is applied to the tile product before the table term.
    for (int idx = tid; idx < kBM * kLDO<DP>; idx += kThreads) s.Ok[idx] *= a.scale;
    __syncthreads();
    write_rows<DP>(a.dk, s.Ok, REL && a.tk, s.Hk, s.Tq, a, c0, nkeys, h, A(1));
    write_rows<DP>(a.dv, s.Ov, false, s.Ov, s.Q, a, c0, nkeys, h, A(1));
    if (a.tk) table_grad<DP>(a.dtk, s.Hk, s.K, a, h, A(1));
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> window_attention_bwd_cuda(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& offsets, const std::optional<at::Tensor>& coords,
    const std::optional<at::Tensor>& radius, const std::optional<at::Tensor>& table_q,
    const std::optional<at::Tensor>& table_k, const std::optional<at::Tensor>& table_v, int64_t rel_shift,
    double radial_a, double scale, bool deterministic) {
  const c10::cuda::CUDAGuard guard(q.device());
  FusedOperands o(q, k, v, offsets, coords, radius, table_q, table_k, table_v, rel_shift, radial_a);
  check_backward_operands(o, grad, out, lse);
  const at::Tensor g = grad.contiguous(), oc = out.contiguous(), lc = lse.contiguous();
  at::Tensor dq = at::empty_like(o.q), dk = at::empty_like(o.k), dv = at::empty_like(o.v);
  // Table gradients: one partial per CTA (slot), summed by finish in slot order.
  at::Tensor sq, sk, sv;
  auto finish = [&](const at::Tensor& partials, const at::Tensor& table) {
    return table.defined() ? table_grad_result(partials.sum(0), table) : partials;
  };
  if (o.N == 0) {  // zero table gradients: one zero slot each
    return {dq, dk, dv, finish(o.table_grad_buffer(o.table_q, 1), o.table_q),
            finish(o.table_grad_buffer(o.table_k, 1), o.table_k), finish(o.table_grad_buffer(o.table_v, 1), o.table_v)};
  }
  const at::Tensor bounds = token_bounds(o);
  at::Tensor delta = at::empty_like(lc);
  at::Tensor counters = at::zeros({2, o.H}, o.offsets.options());
  SPTR_DISPATCH_FLOATING(o.q.scalar_type(), "window_attention_bwd_cuda", [&] {
    using T = typename CudaType<scalar_t>::type;
    using A = acc_t<T>;
    Args<T> a = make_args<T, scalar_t>(o, scale, bounds);
    a.vec = a.vec && aligned16(g) && aligned16(oc);
    a.dout = reinterpret_cast<const T*>(g.const_data_ptr<scalar_t>());
    a.out = reinterpret_cast<const T*>(oc.const_data_ptr<scalar_t>());
    a.lse_in = lc.const_data_ptr<A>();
    a.delta = delta.data_ptr<A>();
    a.dq = reinterpret_cast<T*>(dq.data_ptr<scalar_t>());
    a.dk = reinterpret_cast<T*>(dk.data_ptr<scalar_t>());
    a.dv = reinterpret_cast<T*>(dv.data_ptr<scalar_t>());
    a.dynamic = !deterministic;
    dispatch_head_dim(o.d, [&](auto dp) {
      dispatch_rel(o, [&](auto rel) {
        constexpr int DP = decltype(dp)::value;
        constexpr bool REL = decltype(rel)::value;
        const int ntiles = num_tiles(o);
        auto* dq_kernel = bwd_dq_kernel<DP, T, REL>;
        const size_t dq_bytes = prepare<DqSmem<DP, T>>(dq_kernel, a, "window_attention backward");
        const int dq_grid = persistent_grid(dq_kernel, a, dq_bytes, ntiles);
        sq = o.table_grad_buffer(o.table_q, dq_grid);
        sv = o.table_grad_buffer(o.table_v, dq_grid);
        a.dtq = sq.numel() ? sq.data_ptr<A>() : nullptr;
        a.dtv = sv.numel() ? sv.data_ptr<A>() : nullptr;
        a.tile_counter = counters.data_ptr<int32_t>();
        launch(dq_kernel, a, dq_grid, dq_bytes);  // also writes delta, read by the key side
        auto* dkv_kernel = bwd_dkv_kernel<DP, T, REL>;
        const size_t dkv_bytes = prepare<DkvSmem<DP, T>>(dkv_kernel, a, "window_attention backward");
        const int dkv_grid = persistent_grid(dkv_kernel, a, dkv_bytes, ntiles);
        sk = o.table_grad_buffer(o.table_k, dkv_grid);
        a.dtk = sk.numel() ? sk.data_ptr<A>() : nullptr;
        a.tile_counter = counters.data_ptr<int32_t>() + o.H;
        launch(dkv_kernel, a, dkv_grid, dkv_bytes);
      });
    });
  });
  return {dq, dk, dv, finish(sq, o.table_q), finish(sk, o.table_k), finish(sv, o.table_v)};
}

}  // namespace

TORCH_LIBRARY_IMPL(sptr, CUDA, m) { m.impl("window_attention_bwd", &window_attention_bwd_cuda); }

}  // namespace sptr
