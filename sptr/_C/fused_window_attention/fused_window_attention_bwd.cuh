// The CUDA backward kernels of the fused window attention: one kernel over query tiles (dq, table-q and table-v
// gradients), one over key tiles (dk, dv, table-k gradient); both recompute P from the saved lse.
// No global atomics: a q/k/v gradient row belongs to one tile, and each persistent CTA adds its tiles' table
// gradients into a slot of its own, summed over slots at the end. Histograms are summed in a fixed order
// too, so the result depends only on which CTA took which tile: `deterministic` fixes that (round-robin),
// otherwise tiles go to whichever CTA is free (atomic counter).
// fp16/bf16 without tables run bwd_dq_mma_kernel and bwd_dkv_mma_kernel instead (mma.sync, everything per
// pair in registers, after delta_kernel), which are deterministic by construction.
#pragma once
#include <sptr/dispatch.h>

#include <optional>
#include <type_traits>

#include "fused_window_attention_bwd_onehot.cuh"
#include "fused_window_attention_cuda.h"

namespace sptr {
namespace {

// ------------------------------------------------------------------------------- backward, query side
// The tile backward kernels run one team of kThreads threads per CTA (G = 1) or two (G = 2: fp32 with tables,
// whose shared memory allows one CTA per multiprocessor, so that one team is one warp per scheduler and the
// pair loops wait on latency). With two, group g walks the blocks g, g + 2, ... of the tile's span with buffers
// of its own; the groups' partial results (accumulator tiles, histograms) are summed in group order at the end,
// still a fixed order, so the results stay bitwise reproducible.

// G copies of a group's buffers (Group: made from a Bump), `stride` bytes apart.
template <typename Group, int G>
struct GroupBuffers {
  size_t first = 0, stride = 0;
  template <typename T>
  __host__ __device__ GroupBuffers(Bump& b, const Args<T>& a) {
    first = align128(b.off);
    Bump probe = b;
    const Group g(probe, a);
    (void)g;
    stride = align128(probe.off) - first;
    b.take<char>(G * stride);
  }
  // Group g's buffers in the shared memory at `base`.
  template <typename T>
  __device__ Group at(char* base, int g, const Args<T>& a) const {
    Bump b(base);
    b.off = first + g * stride;
    return Group(b, a);
  }
  // Group g's copy of `own`, a buffer of group `own_group`.
  template <typename U>
  __device__ U* of_group(U* own, int own_group, int g) const {
    return reinterpret_cast<U*>(reinterpret_cast<char*>(own) + (ptrdiff_t)(g - own_group) * (ptrdiff_t)stride);
  }
};

// hist[i] += hist[i + k·part] for k = 1 .. G − 1, in that order: the groups' histograms summed into group 0's.
template <int G, int kTeam, typename A>
__device__ void sum_group_hists(Team<kTeam> team, A* hist, size_t part, int n) {
  for (int i = team.tid(); i < n; i += kTeam) {
    A v = hist[i];
#pragma unroll
    for (int g = 1; g < G; ++g) v += hist[g * part + i];
    hist[i] = v;
  }
}

// Where the pair loops' outputs (dS, P) have the score tiles' type (fp32, fp64), each is written over the score
// tile it is computed from (S or dP, pitch kLDS), by the one thread that reads that element: less shared memory,
// which lets two fp32 groups fit at head dim 32.
template <typename T> constexpr bool kPairsInPlace = std::is_same_v<T, acc_t<T>>;
template <typename T> constexpr int kLDPair = kPairsInPlace<T> ? kLDS : kLDP;

// The pair-loop output tile over `score` (kPairsInPlace), else a buffer of its own.
template <typename T>
__host__ __device__ T* pair_tile(Bump& b, acc_t<T>* score) {
  if constexpr (kPairsInPlace<T>) return score;
  else return b.take<T>(kBM * kLDP);
}

// The buffer over [start, ...) of n elements, taking from b what the buffers since `start` leave short.
template <typename U>
__host__ __device__ U* overlay(Bump& b, U* start, size_t n) {
  reserve_from(b, reinterpret_cast<const char*>(start), n * sizeof(U));
  return start;
}

// A dq group's key block and what it accumulates. (Fixed sizes first: group 0's are at fixed offsets.)
template <int DP, typename T>
struct DqGroupSmem {
  using A = acc_t<T>;
  T *K, *V;
  A *S, *dP;
  T* dS;  // over dP if kPairsInPlace
  A* O;   // over S and dP (the loop's last use of them is over)
  TokenInfo ki;
  A *Kt, *Hq, *Hv;
  __host__ __device__ DqGroupSmem(Bump& b, const Args<T>& a)
      : K(b.take<T>(kBM * kLDT<DP>)), V(b.take<T>(kBM * kLDT<DP>)), S(b.take<A>(kBM * kLDS)),
        dP(b.take<A>(kBM * kLDS)), dS(pair_tile<T>(b, dP)), O(overlay(b, S, kBM * kLDO<DP>)), ki(b, a),
        Kt(b.take_if<A>(a.tk != nullptr, kBM * a.L3p)), Hq(b.take_if<A>(a.tq != nullptr, kBM * a.L3p)),
        Hv(b.take_if<A>(a.tv != nullptr, kBM * a.L3p)) {}
};

template <int DP, typename T, int G>
struct DqSmem {
  using A = acc_t<T>;
  static constexpr int kGroups = G;
  GroupBuffers<DqGroupSmem<DP, T>, G> groups;
  T *Q, *dO;
  A *lse, *delta;
  int* tile_slot;  // next_tile's (dynamic, not static shared memory: fit_smem sizes the dynamic part alone)
  TokenInfo qi;
  T* Ts;
  A *Qt, *Gt;
  __host__ __device__ DqSmem(Bump& b, const Args<T>& a)
      : groups(b, a), Q(b.take<T>(kBM * kLDT<DP>)), dO(b.take<T>(kBM * kLDT<DP>)), lse(b.take<A>(kBM)),
        delta(b.take<A>(kBM)), tile_slot(b.take<int>(1)), qi(b, a), Ts(b.take_if<T>(a.has_rel(), a.L3p * kLDT<DP>)),
        Qt(b.take_if<A>(a.tq != nullptr, kBM * a.L3p)), Gt(b.take_if<A>(a.tv != nullptr, kBM * a.L3p)) {}
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

// The team of a tile backward kernel's thread: its group of kThreads (barrier 1 + group when G > 1).
template <int G>
__device__ __forceinline__ Team<kThreads> group_team(int group) {
  return {static_cast<int>(threadIdx.x) - group * kThreads, G > 1 ? 1 + group : 0};
}

template <int DP, typename T, bool REL, int G>
__global__ void __launch_bounds__(G * kThreads, G > 1 ? 1 : (REL ? 2 : 6)) bwd_dq_kernel(const Args<T> a) {
  using A = acc_t<T>;
  extern __shared__ __align__(128) char smem[];
  Bump bump(smem);
  const DqSmem<DP, T, G> s(bump, a);
  const Team<G * kThreads> cta = whole_cta<G * kThreads>();
  const int group = G > 1 ? static_cast<int>(threadIdx.x) / kThreads : 0;
  const Team<kThreads> team = group_team<G>(group);
  const DqGroupSmem<DP, T> gs = s.groups.at(smem, group, a);
  const size_t part = s.groups.stride / sizeof(A);  // elements from a group's buffer to the next group's
  const int h = blockIdx.y, tid = team.tid(), r = tid >> 2, cb = (tid & 3) * 8;
  const int ntiles = (a.N + kBM - 1) / kBM;
  for (int tile = next_tile(a, -1, s.tile_slot); tile < ntiles; tile = next_tile(a, tile, s.tile_slot)) {
    const int r0 = tile * kBM, nrows = min(kBM, a.N - r0);
    __syncthreads();
    load_token_info(cta, s.qi, a, r0, nrows, true);
    load_rows<DP>(cta, s.Q, a.q, a, r0, nrows, h);
    load_rows<DP>(cta, s.dO, a.dout, a, r0, nrows, h);
    if (group == 0) {  // delta_i = dO_i · O_i, kept for the key-side kernel too
      A part_sum = 0;
      if (r < nrows) {
        const int64_t base = ((int64_t)(r0 + r) * a.H + h) * a.d;
        for (int c = tid & 3; c < a.d; c += 4) part_sum += widen(a.dout[base + c]) * widen(a.out[base + c]);
      }
      part_sum += __shfl_xor_sync(0xffffffffu, part_sum, 1);
      part_sum += __shfl_xor_sync(0xffffffffu, part_sum, 2);
      if ((tid & 3) == 0) {
        s.delta[r] = part_sum;
        s.lse[r] = r < nrows ? a.lse_in[(int64_t)(r0 + r) * a.H + h] : A(0);
        if (r < nrows) a.delta[(int64_t)(r0 + r) * a.H + h] = part_sum;
      }
    }
    __syncthreads();
    const int kbeg = s.qi.lo[0], kend = s.qi.hi[nrows - 1], lo_r = s.qi.lo[r], hi_r = s.qi.hi[r];
    const A lse_r = s.lse[r], delta_r = s.delta[r];
    if (REL && a.tq) {
      stage_table<DP>(cta, s.Ts, a.tq, a, h);
      __syncthreads();
      tile_table_products<DP>(cta, s.Qt, s.Q, s.Ts, a);
      __syncthreads();
    }
    if (REL && a.tv) {
      stage_table<DP>(cta, s.Ts, a.tv, a, h);
      __syncthreads();
      tile_table_products<DP>(cta, s.Gt, s.dO, s.Ts, a);
      __syncthreads();
    }
    if (a.tk) stage_table<DP>(cta, s.Ts, a.tk, a, h);
    if (a.tq) zero_smem(team, gs.Hq, kBM * a.L3p);
    if (a.tv) zero_smem(team, gs.Hv, kBM * a.L3p);
    OutTiles<DP, T> acc;
    acc.zero();
    if (G > 1) __syncthreads();  // the staged table is every group's (with one, the loop's barrier does it)
    for (int c0 = kbeg + group * kBM; c0 < kend; c0 += G * kBM) {
      const int ncols = min(kBM, kend - c0);
      team.sync();
      if (REL) load_token_info(team, gs.ki, a, c0, ncols, false);
      load_rows<DP>(team, gs.K, a.k, a, c0, ncols, h);
      load_rows<DP>(team, gs.V, a.v, a, c0, ncols, h);
      team.sync();
      if (REL && a.tk) tile_table_products<DP>(team, gs.Kt, gs.K, s.Ts, a);
      gemm_nt<DP>(team, gs.S, kLDS, s.Q, gs.K, kBM / 16);
      gemm_nt<DP>(team, gs.dP, kLDS, s.dO, gs.V, kBM / 16);
      team.sync();
      uint32_t rows[8] = {};
      A p[8], ds[8];
      unsigned valid = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int col = cb + e, j = c0 + col;
        p[e] = ds[e] = 0;
        if (j >= lo_r && j < hi_r) {
          valid |= 1u << e;
          if (REL) rows[e] = pair_rows(a.rel, s.qi, gs.ki, r, col);
          const PairGrad<T> g = pair_grad<REL>(a, gs.S[r * kLDS + col], gs.dP[r * kLDS + col], lse_r, delta_r,
                                          products_row(s.Qt, r, a.L3p, gs.S), products_row(gs.Kt, col, a.L3p, gs.S),
                                          products_row(s.Gt, r, a.L3p, gs.S), rows[e]);
          p[e] = g.p;
          ds[e] = g.ds;
        }
        gs.dS[r * kLDPair<T> + col] = narrow<T>(ds[e]);
      }
      if (REL && a.tq) quad_ordered_add(gs.Hq + r * a.L3p, rows, ds, valid);
      if (REL && a.tv) quad_ordered_add(gs.Hv + r * a.L3p, rows, p, valid);
      team.sync();
      acc.template mma<false>(team, gs.dS, kLDPair<T>, gs.K, kBM);
    }
    __syncthreads();
    A* const hq = s.groups.of_group(gs.Hq, group, 0);  // group 0's histograms: the sums, after this
    A* const hv = s.groups.of_group(gs.Hv, group, 0);
    if constexpr (G > 1) {
      if (REL && a.tq) sum_group_hists<G>(cta, hq, part, kBM * a.L3p);
      if (REL && a.tv) sum_group_hists<G>(cta, hv, part, kBM * a.L3p);
      __syncthreads();
    }
    if (a.tq) stage_table<DP>(cta, s.Ts, a.tq, a, h);
    if constexpr (kHistTiles<T>) {
      if (REL && a.tq) {
        __syncthreads();
        if (group == 0) acc.template mma<false>(team, hq, a.L3p, s.Ts, a.L3p);
      }
    }
    acc.store(team, gs.O);
    __syncthreads();
    write_rows<DP, G>(cta, a.dq, s.groups.of_group(gs.O, group, 0), !kHistTiles<T> && REL && a.tq, hq, s.Ts, a,
                      r0, nrows, h, a.scale, part);
    if (a.tq) table_grad<DP>(cta, a.dtq, hq, s.Q, a, h, a.scale);
    if (a.tv) table_grad<DP>(cta, a.dtv, hv, s.dO, a, h, A(1));
  }
}

// --------------------------------------------------------------------------------- backward, key side
// A dk/dv group's query block and what it accumulates. (Fixed sizes first: group 0's are at fixed offsets.)
template <int DP, typename T>
struct DkvGroupSmem {
  using A = acc_t<T>;
  T *Q, *dO;
  A *S, *dP;
  T *P, *dS;  // over S and dP if kPairsInPlace
  A *lse, *delta;
  TokenInfo qi;
  A *Hk, *scratch;
  A *Qt, *Gt, *Ok, *Ov;  // inside scratch: Qt, Gt while walking query blocks, Ok, Ov at the end
  __host__ __device__ DkvGroupSmem(Bump& b, const Args<T>& a)
      : Q(b.take<T>(kBM * kLDT<DP>)), dO(b.take<T>(kBM * kLDT<DP>)), S(b.take<A>(kBM * kLDS)),
        dP(b.take<A>(kBM * kLDS)), P(pair_tile<T>(b, S)), dS(pair_tile<T>(b, dP)), lse(b.take<A>(kBM)),
        delta(b.take<A>(kBM)), qi(b, a), Hk(b.take_if<A>(a.tk != nullptr, kBM * a.L3p)),
        scratch(b.take<A>(imax(2 * kBM * kLDO<DP>, ((a.tq ? 1 : 0) + (a.tv ? 1 : 0)) * kBM * a.L3p))) {
    Qt = a.tq ? scratch : nullptr;
    Gt = a.tv ? scratch + (a.tq ? kBM * a.L3p : 0) : nullptr;
    Ok = scratch;
    Ov = scratch + kBM * kLDO<DP>;
  }
};

template <int DP, typename T, int G>
struct DkvSmem {
  using A = acc_t<T>;
  static constexpr int kGroups = G;
  GroupBuffers<DkvGroupSmem<DP, T>, G> groups;
  T *K, *V;
  int* tile_slot;  // next_tile's
  TokenInfo ki;
  T *Tq, *Tv;
  A* Kt;
  __host__ __device__ DkvSmem(Bump& b, const Args<T>& a)
      : groups(b, a), K(b.take<T>(kBM * kLDT<DP>)), V(b.take<T>(kBM * kLDT<DP>)), tile_slot(b.take<int>(1)),
        ki(b, a),
        Tq(b.take_if<T>(a.tq != nullptr || a.tk != nullptr, a.L3p * kLDT<DP>)),
        Tv(b.take_if<T>(a.tv != nullptr, a.L3p * kLDT<DP>)), Kt(b.take_if<A>(a.tk != nullptr, kBM * a.L3p)) {}
};

template <int DP, typename T, bool REL, int G>
__global__ void __launch_bounds__(G * kThreads, G > 1 ? 1 : (REL ? 2 : 6)) bwd_dkv_kernel(const Args<T> a) {
  using A = acc_t<T>;
  extern __shared__ __align__(128) char smem[];
  Bump bump(smem);
  const DkvSmem<DP, T, G> s(bump, a);
  const Team<G * kThreads> cta = whole_cta<G * kThreads>();
  const int group = G > 1 ? static_cast<int>(threadIdx.x) / kThreads : 0;
  const Team<kThreads> team = group_team<G>(group);
  const DkvGroupSmem<DP, T> gs = s.groups.at(smem, group, a);
  const size_t part = s.groups.stride / sizeof(A);
  // Pairs of a thread: one key (its histogram row), eight queries.
  const int h = blockIdx.y, tid = team.tid(), kc = tid >> 2, rb = (tid & 3) * 8;
  const int ntiles = (a.N + kBM - 1) / kBM;
  for (int tile = next_tile(a, -1, s.tile_slot); tile < ntiles; tile = next_tile(a, tile, s.tile_slot)) {
    const int c0 = tile * kBM, nkeys = min(kBM, a.N - c0);
    __syncthreads();
    load_token_info(cta, s.ki, a, c0, nkeys, true);
    load_rows<DP>(cta, s.K, a.k, a, c0, nkeys, h);
    load_rows<DP>(cta, s.V, a.v, a, c0, nkeys, h);
    if (a.tk) stage_table<DP>(cta, s.Tq, a.tk, a, h);
    __syncthreads();
    const int qbeg = s.ki.lo[0], qend = s.ki.hi[nkeys - 1];
    if (REL && a.tk) {
      tile_table_products<DP>(cta, s.Kt, s.K, s.Tq, a);
      zero_smem(team, gs.Hk, kBM * a.L3p);
      __syncthreads();
    }
    if (a.tq) stage_table<DP>(cta, s.Tq, a.tq, a, h);
    if (a.tv) stage_table<DP>(cta, s.Tv, a.tv, a, h);
    OutTiles<DP, T> dk, dv;
    dk.zero();
    dv.zero();
    if (G > 1) __syncthreads();  // the staged tables are every group's (with one, the loop's barrier does it)
    for (int q0 = qbeg + group * kBM; q0 < qend; q0 += G * kBM) {
      const int nq = min(kBM, qend - q0);
      team.sync();
      if (REL) load_token_info(team, gs.qi, a, q0, nq, false);
      load_rows<DP>(team, gs.Q, a.q, a, q0, nq, h);
      load_rows<DP>(team, gs.dO, a.dout, a, q0, nq, h);
      for (int t = tid; t < kBM; t += kThreads) {
        gs.lse[t] = t < nq ? a.lse_in[(int64_t)(q0 + t) * a.H + h] : A(0);
        gs.delta[t] = t < nq ? a.delta[(int64_t)(q0 + t) * a.H + h] : A(0);
      }
      team.sync();
      if (REL && a.tq) tile_table_products<DP>(team, gs.Qt, gs.Q, s.Tq, a);
      if (REL && a.tv) tile_table_products<DP>(team, gs.Gt, gs.dO, s.Tv, a);
      gemm_nt<DP>(team, gs.S, kLDS, gs.Q, s.K, kBM / 16);
      gemm_nt<DP>(team, gs.dP, kLDS, gs.dO, s.V, kBM / 16);
      team.sync();
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
          if (REL) rows[e] = pair_rows(a.rel, gs.qi, s.ki, rq, kc);
          g = pair_grad<REL>(a, gs.S[rq * kLDS + kc], gs.dP[rq * kLDS + kc], gs.lse[rq], gs.delta[rq],
                             products_row(gs.Qt, rq, a.L3p, gs.S), products_row(s.Kt, kc, a.L3p, gs.S),
                             products_row(gs.Gt, rq, a.L3p, gs.S), rows[e]);
        }
        ds[e] = g.ds;
        gs.P[rq * kLDPair<T> + kc] = narrow<T>(g.p);
        gs.dS[rq * kLDPair<T> + kc] = narrow<T>(g.ds);
      }
      if (REL && a.tk) quad_ordered_add(gs.Hk + kc * a.L3p, rows, ds, valid);
      team.sync();
      dk.template mma<true>(team, gs.dS, kLDPair<T>, gs.Q, kBM);
      dv.template mma<true>(team, gs.P, kLDPair<T>, gs.dO, kBM);
    }
    __syncthreads();
    A* const hk = s.groups.of_group(gs.Hk, group, 0);  // group 0's histogram: the sum, after this
    if constexpr (G > 1) {
      if (REL && a.tk) sum_group_hists<G>(cta, hk, part, kBM * a.L3p);
      __syncthreads();
    }
    if (a.tk) stage_table<DP>(cta, s.Tq, a.tk, a, h);
    // dk = scale·dSᵀQ + Σ_n Hk[n]·Tk[n]: the scale is applied to the tile product before the table term.
    if constexpr (kHistTiles<T>) {
      dk.scale(a.scale);
      if (REL && a.tk) {
        __syncthreads();
        if (group == 0) dk.template mma<false>(team, hk, a.L3p, s.Tq, a.L3p);
      }
    }
    dk.store(team, gs.Ok);
    dv.store(team, gs.Ov);
    __syncthreads();
    if constexpr (!kHistTiles<T>) {
      for (int idx = tid; idx < kBM * kLDO<DP>; idx += kThreads) gs.Ok[idx] *= a.scale;
      __syncthreads();
    }
    write_rows<DP, G>(cta, a.dk, s.groups.of_group(gs.Ok, group, 0), !kHistTiles<T> && REL && a.tk, hk, s.Tq, a,
                      c0, nkeys, h, A(1), part);
    write_rows<DP, G>(cta, a.dv, s.groups.of_group(gs.Ov, group, 0), false, hk, s.Tq, a, c0, nkeys, h, A(1), part);
    if (a.tk) table_grad<DP>(cta, a.dtk, hk, s.K, a, h, A(1));
  }
}

// ----------------------------------------------------------------------------- backward on mma.sync
// delta_i = dO_i · O_i per (token, head), fp32.
template <int DP, typename T>
__global__ void delta_kernel(const Args<T> a) {
  SPTR_GRID_STRIDE(i, (int64_t)a.N * a.H) {
    const uint4* g = reinterpret_cast<const uint4*>(a.dout + i * DP);
    const uint4* o = reinterpret_cast<const uint4*>(a.out + i * DP);
    float acc = 0.f;
#pragma unroll
    for (int c = 0; c < DP * (int)sizeof(T) / 16; ++c) {
      const uint4 gv = g[c], ov = o[c];
      const T* ge = reinterpret_cast<const T*>(&gv);
      const T* oe = reinterpret_cast<const T*>(&ov);
#pragma unroll
      for (int e = 0; e < 16 / (int)sizeof(T); ++e) acc += widen(ge[e]) * widen(oe[e]);
    }
    a.delta[i] = acc;
  }
}

// Shared memory of the two mma.sync backward kernels. Own: the 64 rows a CTA owns (queries for dq, keys
// for dk/dv); Other: the double-buffered blocks it walks. REL adds the own tile (operand of the table
// gradients), the staged tables, the coordinates of the other side, the table products of both sides, and
// the own rows' histograms (dq: Hq of dS, Hv of P; dk: Hk of dS). Two-buffer arrays are indexed by
// arithmetic (buf · size): an array of pointers indexed at run time would go to the stack.
// With tables the fp32 per-row state decides the occupancy (3L = 144 columns at the spherical tables: 36 KiB
// for each array over the 64 own rows). dk/dv fits two CTAs per multiprocessor at head dim 16 (110 KiB each,
// against 142 KiB in the dq layout) by walking query blocks of 16 instead of 32 (half the block products'
// bytes), staging the tables unpadded (TLD: 32-byte rows, two-way ldmatrix bank conflicts) and putting the own
// V tile under the block products (it goes to registers before the barrier that opens the first block). dq
// stays at one CTA: its four own-row arrays alone take 144 KiB.
// SPHERE (dk/dv with the spherical tables, angular cells inside the one-hot range): Hk's angular columns are
// one-hot accumulators in registers (dSᵀ·E, E the query block's one-hot rows of the two angular axes) and only
// its radial column a shared-memory histogram (64 x L fp32 instead of 64 x 3L); after the loop Hk's rows are
// written over the own Kt products.
template <int DP, typename T, bool REL, bool DQ, bool SPHERE = false>
struct MmaBwdSmem {
  static constexpr int BN = REL ? (DQ ? 32 : 16) : mma::kBlock<DP>, LD = mma::kLd<DP>;
  static constexpr int TLD = REL && !DQ && DP == 16 ? DP : LD;  // row pitch of the staged tables
  T *X, *Y;                  // other side, 2 buffers: K and V (dq) or Q and dO (dk/dv)
  float *lse, *delta;        // dk/dv: the query block's lse and delta, 2 buffers
  T *A = nullptr, *B = nullptr;  // REL: own tile, Q and dO (dq) or K and V (dk/dv)
  T *tq = nullptr, *tk = nullptr, *tv = nullptr;
  int* oc = nullptr;         // coordinates (BN, 3) and radii of the other side, 2 buffers
  float* orad = nullptr;
  float *own_p1 = nullptr, *own_p2 = nullptr;      // own products: Qt, Gt (dq) or Kt (dk/dv)
  float *other_p1 = nullptr, *other_p2 = nullptr;  // block products: Kt (dq) or Qt, Gt (dk/dv)
  float *hist1 = nullptr, *hist2 = nullptr;        // Hq, Hv (dq) or Hk (dk/dv; SPHERE: after the loop)
  float* hkr = nullptr;                            // SPHERE: Hk's radial column (the loop)
  T* E = nullptr;                                  // SPHERE: the query block's one-hot rows
  int lp = 0, rp = 0;
  __host__ __device__ MmaBwdSmem(Bump& b, const Args<T>& a)
      : X(b.take<T>(2 * BN * LD)), Y(b.take<T>(2 * BN * LD)), lse(b.take<float>(2 * BN)), delta(b.take<float>(2 * BN)) {
    if (!REL) return;
    constexpr int R = mma::kRows;
    lp = a.L3p;
    A = b.take<T>(R * LD);
    if (DQ) B = b.take<T>(R * LD);
    tq = b.take_if<T>(a.tq != nullptr, a.L3p * TLD);
    tk = b.take_if<T>(a.tk != nullptr, a.L3p * TLD);
    tv = b.take_if<T>(a.tv != nullptr, a.L3p * TLD);
    oc = b.take<int>(2 * BN * 3);
    orad = b.take_if<float>(a.rel.radius != nullptr, 2 * BN);
    if (DQ) {
      own_p1 = b.take_if<float>(a.tq != nullptr, R * lp);
      own_p2 = b.take_if<float>(a.tv != nullptr, R * lp);
      other_p1 = b.take_if<float>(a.tk != nullptr, BN * lp);
      hist1 = b.take_if<float>(a.tq != nullptr, R * lp);
      hist2 = b.take_if<float>(a.tv != nullptr, R * lp);
    } else {
      own_p1 = b.take_if<float>(a.tk != nullptr, R * lp);
      hist1 = SPHERE ? own_p1 : b.take_if<float>(a.tk != nullptr, R * lp);
      rp = a.rel.L;
      hkr = b.take_if<float>(SPHERE && a.tk != nullptr, R * rp);
      E = b.take_if<T>(SPHERE, BN * mma::kOneHotLdOf<kSphereAxes>);
      char* const under = next_take(b);  // B, and the block products over it
      other_p1 = b.take_if<float>(a.tq != nullptr, BN * lp);
      other_p2 = b.take_if<float>(a.tv != nullptr, BN * lp);
      reserve_from(b, under, R * LD * sizeof(T));
      B = reinterpret_cast<T*>(under);
    }
  }
};
template <int DP, typename T, bool REL>
using MmaDqSmem = MmaBwdSmem<DP, T, REL, true>;
template <int DP, typename T, bool REL, bool SPHERE = false>
using MmaDkvSmem = MmaBwdSmem<DP, T, REL, false, SPHERE>;

// Per-CTA start of a REL item: the own tile (rows [r0, r0 + n) of x and y) and the present tables staged,
// the own A fragments taken from the tile.
template <int DP, typename T, typename S>
__device__ void stage_own(const S& sm, const Args<T>& a, const T* x, const T* y, int r0, int n, int h,
                          uint32_t (&xf)[DP / 16][4], uint32_t (&yf)[DP / 16][4]) {
  using namespace mma;
  constexpr int LD = kLd<DP>, TLD = S::TLD;
  async_block<DP, LD, kRows, kThreads>(sm.A, x, a.H, r0, n, h);
  async_block<DP, LD, kRows, kThreads>(sm.B, y, a.H, r0, n, h);
  if (a.tq) async_rows<DP, TLD, kThreads>(sm.tq, a.tq, a.H, 0, a.L3, a.L3p, h);
  if (a.tk) async_rows<DP, TLD, kThreads>(sm.tk, a.tk, a.H, 0, a.L3, a.L3p, h);
  if (a.tv) async_rows<DP, TLD, kThreads>(sm.tv, a.tv, a.H, 0, a.L3, a.L3p, h);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  const int warp = threadIdx.x >> 5;
  ldmatrix_a_rows<DP, LD>(xf, sm.A + warp * 16 * LD);
  ldmatrix_a_rows<DP, LD>(yf, sm.B + warp * 16 * LD);
}

// The work items of the backward CTAs (num_items): without tables one CTA an item; with tables the grid is
// persistent (each CTA owns a slot of the table-gradient partials) and takes items round-robin, so the partial
// sums, and the result, are the same run to run.

// dq of 64 query rows of one head (16 per warp): per key block S = QKᵀ and dP = dO·Vᵀ, P from the saved lse,
// dS = P∘(dP − delta), dq += dS·K; K/V blocks double-buffered in shared memory. REL: the logits get the
// table terms, dP the value-table term Gt = dO·Tv; Hq (of dS) gives dq's table term Hq·Tq and, with Hv (of
// P), the tile's dTq and dTv.
// Without tables, small head dims fit four CTAs per multiprocessor (128 registers); the compiler's own
// choice lands just above that.
template <int DP, bool REL> constexpr int kDqMinBlocks = (!REL && DP <= 32) ? 4 : 1;

template <int DP, typename T, bool REL>
__global__ void __launch_bounds__(mma::kThreads, kDqMinBlocks<DP, REL>) bwd_dq_mma_kernel(const Args<T> a) {
  using namespace mma;
  if (REL && a.onehot != nullptr && *a.onehot) return;  // bwd_dq_onehot_kernel does the work
  using Smem = MmaDqSmem<DP, T, REL>;
  constexpr int BN = Smem::BN, LD = kLd<DP>, NT = BN / 8, DT = DP / 8;
  extern __shared__ __align__(128) char smem[];
  Bump bump(smem);
  const Smem sm(bump, a);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const float sl2 = static_cast<float>(a.scale) * kLog2e;
  for (int item = blockIdx.x; item < num_items(a); item += gridDim.x) {
    const WarpItem it(a.bounds, a.N, a.H, item);
    const int h = it.h, r0 = it.r0, nrows = it.n, kbeg = it.lo, kend = it.hi, w0 = it.w0;
    const bool active = it.active;
    const int2 wrange = it.wrange, win0 = it.win0, win1 = it.win1;
    float lse2[2], dl[2];
    row_stats(a, w0, h, lse2, dl);
    uint32_t qf[DP / 16][4], gf[DP / 16][4];
    int cq[2][3] = {};
    float rq[2] = {0.f, 0.f};
    float *qt_row[2] = {}, *gt_row[2] = {}, *hq_row[2] = {}, *hv_row[2] = {};
    if constexpr (REL) {
      stage_own<DP>(sm, a, a.q, a.dout, r0, nrows, h, qf, gf);
      own_coords(a, w0, cq, &rq);
      const int own = warp * 16 * sm.lp;
      if (a.tq) table_products<DP, LD>(sm.own_p1 + own, sm.lp, qf, sm.tq, 0, a.L3p / 16);
      if (a.tv) table_products<DP, LD>(sm.own_p2 + own, sm.lp, gf, sm.tv, 0, a.L3p / 16);
      for (int i = lane; i < 16 * sm.lp; i += 32) {
        if (a.tq) sm.hist1[own + i] = 0.f;
        if (a.tv) sm.hist2[own + i] = 0.f;
      }
      __syncwarp();
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int at = own + (g + 8 * i) * sm.lp;
        qt_row[i] = sm.own_p1 + at;
        gt_row[i] = sm.own_p2 + at;
        hq_row[i] = sm.hist1 + at;
        hv_row[i] = sm.hist2 + at;
      }
    } else {
      load_a_rows<DP>(qf, a.q, a.N, a.H, w0, h);
      load_a_rows<DP>(gf, a.dout, a.N, a.H, w0, h);
    }
    float dq[DT][4] = {};
    const int nblocks = (kend - kbeg + BN - 1) / BN;
    auto load = [&](int blk) {
      load_key_block<DP, BN>(sm.X, sm.Y, REL ? sm.oc : nullptr, sm.orad, a, kbeg, kend, blk, h);
    };
    double_buffered(nblocks, load, [&](int blk) {
      const int c0 = kbeg + blk * BN, buf = blk & 1;
      const T* K = sm.X + buf * BN * LD;
      const T* V = sm.Y + buf * BN * LD;
      const int* kc = sm.oc + buf * BN * 3;
      const float* kr = sm.orad + buf * BN;
      if constexpr (REL) {
        if (a.tk) {
          block_products<DP, BN>(sm.other_p1, sm.lp, K, sm.tk, a.L3p);
          __syncthreads();
        }
      }
      if (active && c0 < wrange.y && c0 + BN > wrange.x) {
        float s[NT][4] = {}, dp[NT][4] = {};
        uint32_t rows[NT][4] = {};
#pragma unroll
        for (int np = 0; np < NT / 2; ++np)
          if (overlaps16(c0 + 16 * np, wrange)) {
            mma_abt_pair<DP, LD>(s, qf, K, np);
            mma_abt_pair<DP, LD>(dp, gf, V, np);
          }
        backward_probs(s, dp, rows, c0, win0, win1, wrange, sl2,
                       [&](int, int i) { return make_float2(lse2[i], dl[i]); },
                       [&](int col, int i, float& logit2, float& dpv) -> uint32_t {  // pair (query row i, key col)
                         if constexpr (REL) {
                           const uint32_t packed = pack_rows(a.rel, cq[i], kc + col * 3, rq[i],
                                                             a.rel.radius ? kr[col] : 0.f);
                           if (a.tq) logit2 += gather3(qt_row[i], packed) * sl2;
                           if (a.tk) logit2 += gather3(sm.other_p1 + col * sm.lp, packed) * kLog2e;
                           if (a.tv) dpv += gather3(gt_row[i], packed);
                           return packed;
                         } else {
                           return 0u;
                         }
                       });
        if constexpr (REL) {
          if (a.tq && a.tv) {
            quad_hist_add2(hq_row[0], hq_row[1], dp, hv_row[0], hv_row[1], s, rows);
          } else if (a.tq || a.tv) {  // one copy of the loop for either table (a select per value)
            float one[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
              for (int e = 0; e < 4; ++e) one[nt][e] = a.tq ? dp[nt][e] : s[nt][e];
            quad_hist_add(a.tq ? hq_row[0] : hv_row[0], a.tq ? hq_row[1] : hv_row[1], rows, one);
          }
        }
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) {
          if (!overlaps16(c0 + 16 * kk, wrange)) continue;
          uint32_t da[4];
          c_to_a<T>(da, dp, kk);
          mma_ab<DP, LD>(dq, da, K, kk);
        }
      }
    });
    if constexpr (REL) {
      if (a.tq && active)  // dq's table term Σ_n Hq[n]·Tq[n], scaled with the rest below
        add_rows_times_table<DP, LD>(dq, sm.hist1 + warp * 16 * sm.lp, sm.lp, sm.tq, a.L3p, 1.f, 1.f);
    }
    if (active) {
      const float f = static_cast<float>(a.scale);
      store_c_rows<DP>(a.dq, dq, a.N, a.H, w0, h, f, f);
    }
    if constexpr (REL) {
      __syncthreads();
      const int64_t slot = (int64_t)blockIdx.x * a.L3 * a.H * DP;
      if (a.tq) table_grad_mma<DP, LD>(a.dtq + slot, sm.hist1, sm.lp, sm.A, a.L3, a.L3p, a.H, h, a.scale);
      if (a.tv) table_grad_mma<DP, LD>(a.dtv + slot, sm.hist2, sm.lp, sm.B, a.L3, a.L3p, a.H, h, 1.f);
      __syncthreads();
    }
  }
}

// dk, dv of 64 key rows of one head (16 per warp), walking the query blocks of their windows: Sᵀ = K·Qᵀ,
// dPᵀ = V·dOᵀ, dv += Pᵀ·dO, dk += dSᵀ·Q; Q/dO blocks with their lse and delta double-buffered. REL: the
// query blocks' products Qt, Gt per block, the own Kt once; Hk (of dS) gives dk's table term and dTk.
// SPHERE (the spherical tables with their angular cells inside the one-hot range, a device flag): Hk's angular
// columns as dSᵀ·E in registers (E: the query block's one-hot rows of the angular axes), one radial histogram
// entry per pair instead of three (MmaBwdSmem).
template <int DP, typename T, bool REL, bool SPHERE = false>
__global__ void __launch_bounds__(mma::kThreads) bwd_dkv_mma_kernel(const Args<T> a) {
  using namespace mma;
  static_assert(REL || !SPHERE, "SPHERE takes tables");
  if constexpr (SPHERE) {
    if (!*a.onehot) return;  // an angular coordinate leaves the one-hot range: the plain variant does the work
  } else {
    if (REL && a.onehot != nullptr && *a.onehot) return;  // bwd_dkv_onehot_kernel or SPHERE does the work
  }
  using Smem = MmaDkvSmem<DP, T, REL, SPHERE>;
  constexpr int BQ = Smem::BN, LD = kLd<DP>, TLD = Smem::TLD, NT = BQ / 8, DT = DP / 8, AXES = kSphereAxes;
  extern __shared__ __align__(128) char smem[];
  Bump bump(smem);
  const Smem sm(bump, a);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const float sl2 = static_cast<float>(a.scale) * kLog2e;
  const int L = a.rel.L, shift = a.rel.rel_shift;
  for (int item = blockIdx.x; item < num_items(a); item += gridDim.x) {
    // A query attends to a key exactly when they share a window, so the key's window bounds its queries.
    const WarpItem it(a.bounds, a.N, a.H, item);
    const int h = it.h, c0 = it.r0, nkeys = it.n, qbeg = it.lo, qend = it.hi, w0 = it.w0;
    const bool active = it.active;
    const int2 wrange = it.wrange, win0 = it.win0, win1 = it.win1;
    uint32_t kf[DP / 16][4], vf[DP / 16][4];
    int ck[2][3] = {};
    float rk[2] = {0.f, 0.f};
    float *kt_row[2] = {}, *hk_row[2] = {};  // SPHERE: hk_row are Hk's radial rows
    if constexpr (REL) {
      stage_own<DP>(sm, a, a.k, a.v, c0, nkeys, h, kf, vf);
      own_coords(a, w0, ck, &rk);
      const int own = warp * 16 * sm.lp, own_r = warp * 16 * sm.rp;
      if (a.tk) {
        table_products<DP, TLD>(sm.own_p1 + own, sm.lp, kf, sm.tk, 0, a.L3p / 16);
        if constexpr (SPHERE)
          for (int i = lane; i < 16 * sm.rp; i += 32) sm.hkr[own_r + i] = 0.f;
        else
          for (int i = lane; i < 16 * sm.lp; i += 32) sm.hist1[own + i] = 0.f;
      }
      __syncwarp();
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        kt_row[i] = sm.own_p1 + own + (g + 8 * i) * sm.lp;
        hk_row[i] = SPHERE ? sm.hkr + own_r + (g + 8 * i) * sm.rp : sm.hist1 + own + (g + 8 * i) * sm.lp;
      }
    } else {
      load_a_rows<DP>(kf, a.k, a.N, a.H, w0, h);
      load_a_rows<DP>(vf, a.v, a.N, a.H, w0, h);
    }
    float dk[DT][4] = {}, dv[DT][4] = {};
    OneHotHistOf<AXES> hk = {};  // SPHERE: Hk's angular columns
    const int nblocks = (qend - qbeg + BQ - 1) / BQ;
    auto load = [&](int blk) {
      const int q0 = qbeg + blk * BQ, n = min(BQ, qend - q0), buf = blk & 1;
      async_block<DP, LD, BQ, kThreads>(sm.X + buf * BQ * LD, a.q, a.H, q0, n, h);
      async_block<DP, LD, BQ, kThreads>(sm.Y + buf * BQ * LD, a.dout, a.H, q0, n, h);
      for (int i = threadIdx.x; i < BQ; i += kThreads) {
        const bool ok = i < n;
        const int64_t at = ok ? (int64_t)(q0 + i) * a.H + h : 0;
        cp_async_4(sm.lse + buf * BQ + i, a.lse_in + at, ok);
        cp_async_4(sm.delta + buf * BQ + i, a.delta + at, ok);
      }
      if constexpr (REL) async_coords<BQ>(sm.oc + buf * BQ * 3, sm.orad + buf * BQ, a, q0, n);
      cp_async_commit();
    };
    double_buffered(nblocks, load, [&](int blk) {
      const int q0 = qbeg + blk * BQ, buf = blk & 1;
      const T* Q = sm.X + buf * BQ * LD;
      const T* G = sm.Y + buf * BQ * LD;
      const float* lse = sm.lse + buf * BQ;
      const float* delta = sm.delta + buf * BQ;
      const int* qc = sm.oc + buf * BQ * 3;
      const float* qr = sm.orad + buf * BQ;
      if constexpr (REL) {
        if constexpr (SPHERE) onehot_block<BQ, AXES>(sm.E, qc);
        if (SPHERE || a.tq || a.tv) {
          if (a.tq) block_products<DP, BQ, TLD>(sm.other_p1, sm.lp, Q, sm.tq, a.L3p);
          if (a.tv) block_products<DP, BQ, TLD>(sm.other_p2, sm.lp, G, sm.tv, a.L3p);
          __syncthreads();
        }
      }
      if (active && q0 < wrange.y && q0 + BQ > wrange.x) {
        float s[NT][4] = {}, dp[NT][4] = {};
        uint32_t rows[NT][4] = {};
#pragma unroll
        for (int np = 0; np < NT / 2; ++np)
          if (overlaps16(q0 + 16 * np, wrange)) {
            mma_abt_pair<DP, LD>(s, kf, Q, np);
            mma_abt_pair<DP, LD>(dp, vf, G, np);
          }
        backward_probs(s, dp, rows, q0, win0, win1, wrange, sl2,
                       [&](int col, int) { return make_float2(lse[col] * kLog2e, delta[col]); },
                       [&](int col, int r, float& logit2, float& dpv) -> uint32_t {  // pair (query col, key row r)
                         if constexpr (REL) {
                           const uint32_t packed = pack_rows(a.rel, qc + col * 3, ck[r], a.rel.radius ? qr[col] : 0.f,
                                                             rk[r]);
                           if (a.tq) logit2 += gather3(sm.other_p1 + col * sm.lp, packed) * sl2;
                           if (a.tk) logit2 += gather3(kt_row[r], packed) * kLog2e;
                           if (a.tv) dpv += gather3(sm.other_p2 + col * sm.lp, packed);
                           return packed;
                         } else {
                           return 0u;
                         }
                       });
        if constexpr (SPHERE) {
          if (a.tk) {  // the radial entry: table row bin·3 + 2
            int bins[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
              for (int e = 0; e < 4; ++e) bins[nt][e] = table_row(rows[nt][e], 2) / 3;
            quad_bin_add(hk_row[0], hk_row[1], bins, dp);
          }
        } else if constexpr (REL) {
          if (a.tk) quad_hist_add(hk_row[0], hk_row[1], rows, dp);
        }
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) {
          if (!overlaps16(q0 + 16 * kk, wrange)) continue;
          uint32_t pa[4], da[4];
          c_to_a<T>(pa, s, kk);
          mma_ab<DP, LD>(dv, pa, G, kk);
          c_to_a<T>(da, dp, kk);
          mma_ab<DP, LD>(dk, da, Q, kk);
          if constexpr (SPHERE)
            if (a.tk) onehot_hist_add<AXES>(hk, da, sm.E, kk);
        }
      }
    });
    // dk = scale·dSᵀQ + Σ_n Hk[n]·Tk[n]: the key-side table term carries no scale.
    const float f = static_cast<float>(a.scale);
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[dt][e] *= f;
    if constexpr (SPHERE) {
      if (a.tk) {  // Hk's rows of the warp over its own Kt rows, which only this warp read
        __syncwarp();
        const float one[2] = {1.f, 1.f};
        float* hrow = sm.hist1 + warp * 16 * sm.lp;
        onehot_hist_store<false, AXES>(hrow, sm.lp, hk, ck, one, L, shift);
        radial_column(hrow, sm.lp, sm.hkr + warp * 16 * sm.rp, sm.rp, L, one);
        __syncwarp();
      }
    }
    if constexpr (REL) {
      if (a.tk && active)
        add_rows_times_table<DP, TLD>(dk, sm.hist1 + warp * 16 * sm.lp, sm.lp, sm.tk, a.L3p, 1.f, 1.f);
    }
    if (active) {
      store_c_rows<DP>(a.dk, dk, a.N, a.H, w0, h, 1.f, 1.f);
      store_c_rows<DP>(a.dv, dv, a.N, a.H, w0, h, 1.f, 1.f);
    }
    if constexpr (REL) {
      __syncthreads();
      if (a.tk)
        table_grad_mma<DP, LD>(a.dtk + (int64_t)blockIdx.x * a.L3 * a.H * DP, sm.hist1, sm.lp, sm.A, a.L3, a.L3p,
                               a.H, h, 1.f);
      __syncthreads();
    }
  }
}

// A tile backward kernel and its launch shape.
template <typename T>
struct TileBackward {
  void (*kernel)(const Args<T>);
  size_t bytes;
  int threads, grid;
};

// `kernel` (Smem::kGroups teams of kThreads) and its launch shape, or nothing where its shared memory does not
// fit, which is a clear error if it is `required`.
template <typename Smem, typename T>
std::optional<TileBackward<T>> tile_backward(void (*kernel)(const Args<T>), const Args<T>& a, int ntiles,
                                             bool required) {
  const size_t bytes = required ? prepare<Smem>(kernel, a, "window_attention backward")
                                : fit_smem(kernel, smem_bytes<Smem>(a));
  if (bytes == 0) return std::nullopt;
  const int threads = Smem::kGroups * kThreads;
  return TileBackward<T>{kernel, bytes, threads, persistent_grid(kernel, bytes, ntiles, a.H, threads)};
}

// The stored-pairs buffers of the one-hot backward (PairStore): the prefix of the tokens' window sizes and a
// fixed budget of words, 0.5x the q/k/v/out bytes: issue 25 limits the extra peak memory to 2x them, and the
// backward's other buffers take 1.26-1.33x (H100, 270k voxels; 0.6 measured 1.94-2.05x). M is known only on the
// device (reading it would be a host sync), so the kernels work out how many heads fit per pass and fall back to
// the recomputing kernels where not one does.
inline at::Tensor window_prefix(const at::Tensor& bounds, int64_t N) {
  at::Tensor off = at::zeros({N + 1}, bounds.options().dtype(at::kLong));
  off.narrow(0, 1, N).copy_(at::cumsum(bounds.select(1, 1) - bounds.select(1, 0), 0, at::kLong));
  return off;
}
inline int64_t pair_budget_words(const FusedOperands& o) {
  return o.N * o.H * o.d * o.q.element_size() / 2;  // 0.5 · 4 tensors · bytes / 4 bytes per word
}

// The mma.sync backward (fp16/bf16, head dim 16..128 with aligned rows, its shared memory fits), or false
// for the tile kernels. With tables, table-gradient slots (one per CTA) come from make_slots(grid). Cubic tables
// (no radial bins) launch the one-hot kernels too, on their own persistent grids: a device flag set from the
// coordinates tells them or the gather kernels to return at once, and the slots cover every grid. The one-hot
// path has two forms: the dk/dv kernel storing P and dS for a light dq kernel, pass by pass of as many heads as
// the buffer holds (H passes launched, the ones past the last head return at once), or, where not one head's
// pairs fit, both kernels recomputing the logits.
template <int DP, typename T, typename MakeSlots>
bool launch_mma_backward(const FusedOperands& o, const at::Tensor& bounds, Args<T>& a, const MakeSlots& make_slots) {
  if (!a.vec || (o.has_rel() && 3 * o.L > kMaxRows3)) return false;
  const auto stream = at::cuda::getCurrentCUDAStream();
  auto run = [&](auto rel) {
    constexpr bool REL = decltype(rel)::value;
    auto* dq_kernel = bwd_dq_mma_kernel<DP, T, REL>;
    auto* dkv_kernel = bwd_dkv_mma_kernel<DP, T, REL>;
    const size_t dq_bytes = fit_smem(dq_kernel, smem_bytes<MmaDqSmem<DP, T, REL>>(a));
    const size_t dkv_bytes = fit_smem(dkv_kernel, smem_bytes<MmaDkvSmem<DP, T, REL>>(a));
    if (dq_bytes == 0 || dkv_bytes == 0) return false;
    const int items = static_cast<int>(mma_grid(o));
    const int dq_grid = REL ? persistent_grid(dq_kernel, dq_bytes, items, 1) : items;
    const int dkv_grid = REL ? persistent_grid(dkv_kernel, dkv_bytes, items, 1) : items;
    auto* dq_onehot = bwd_dq_onehot_kernel<DP, T>;
    auto* dkv_onehot = bwd_dkv_onehot_kernel<DP, T, false>;
    auto* dq_stored = bwd_dq_stored_kernel<DP, T>;
    auto* dkv_storing = bwd_dkv_onehot_kernel<DP, T, true>;
    size_t dq_onehot_bytes = 0, dkv_onehot_bytes = 0, dq_stored_bytes = 0;
    if (REL && !o.radius.defined()) {
      dq_onehot_bytes = fit_smem(dq_onehot, smem_bytes<OneHotDqSmem<DP, T, false>>(a));
      dkv_onehot_bytes = fit_smem(dkv_onehot, smem_bytes<OneHotDkvSmem<DP, T>>(a));
      dq_stored_bytes = fit_smem(dq_stored, smem_bytes<StoredDqSmem<DP, T>>(a));
      if (dkv_onehot_bytes > 0) fit_smem(dkv_storing, dkv_onehot_bytes);
    }
    // Spherical tables (radial bins): dq by the one-hot kernel of the angular axes (the radial bins gathered per
    // pair), dk/dv by the gather kernel with Hk's angular columns one-hot (SPHERE), at head dims up to 32
    // (SphereFormer's; from 64 on the dq kernel's accumulators spill).
    void (*dq_sphere)(const Args<T>) = nullptr;
    void (*dkv_sphere)(const Args<T>) = nullptr;
    size_t dq_sphere_bytes = 0, dkv_sphere_bytes = 0;
    if constexpr (REL && DP <= 32) {
      if (o.radius.defined()) {
        dq_sphere = bwd_dq_onehot_kernel<DP, T, true>;
        dkv_sphere = bwd_dkv_mma_kernel<DP, T, true, true>;
        dq_sphere_bytes = fit_smem(dq_sphere, smem_bytes<OneHotDqSmem<DP, T, true>>(a));
        dkv_sphere_bytes = fit_smem(dkv_sphere, smem_bytes<MmaDkvSmem<DP, T, true, true>>(a));
      }
    }
    const bool sphere = dq_sphere_bytes > 0 && dkv_sphere_bytes > 0;
    const int dq_sphere_grid = sphere ? persistent_grid(dq_sphere, dq_sphere_bytes, items, 1) : 0;
    const int dkv_sphere_grid = sphere ? persistent_grid(dkv_sphere, dkv_sphere_bytes, items, 1) : 0;
    const bool onehot = dq_onehot_bytes > 0 && dkv_onehot_bytes > 0;
    const bool stored = onehot && dq_stored_bytes > 0;
    const int dq_onehot_grid = onehot ? persistent_grid(dq_onehot, dq_onehot_bytes, items, 1) : 0;
    const int dkv_onehot_grid = onehot ? persistent_grid(dkv_onehot, dkv_onehot_bytes, items, 1) : 0;
    const int dq_stored_grid = stored ? persistent_grid(dq_stored, dq_stored_bytes, items, 1) : 0;
    const int dkv_storing_grid = stored ? persistent_grid(dkv_storing, dkv_onehot_bytes, items, 1) : 0;
    make_slots(std::max({dq_grid, dq_onehot_grid, dq_stored_grid, dq_sphere_grid}),
               std::max({dkv_grid, dkv_onehot_grid, dkv_storing_grid, dkv_sphere_grid}));
    at::Tensor flag, pair_off, pair_words;
    if (onehot || sphere) {
      flag = onehot_flag(o);
      a.onehot = flag.const_data_ptr<int>();
    }
    if (stored) {
      pair_off = window_prefix(bounds, o.N);
      pair_words = at::empty({pair_budget_words(o)}, bounds.options());
      a.pairs = PairStore{reinterpret_cast<uint32_t*>(pair_words.data_ptr<int32_t>()),
                          pair_off.const_data_ptr<int64_t>(), pair_words.numel(), 0};
    }
    delta_kernel<DP, T><<<grid_for(o.N * o.H, 256), 256, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    for (int pass = 0; stored && pass < o.H; ++pass) {  // each pass's dq reads what its dk/dv stored
      a.pairs.pass = pass;
      dkv_storing<<<dkv_storing_grid, mma::kThreads, dkv_onehot_bytes, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      dq_stored<<<dq_stored_grid, mma::kThreads, dq_stored_bytes, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (onehot) {
      dq_onehot<<<dq_onehot_grid, mma::kThreads, dq_onehot_bytes, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (sphere) {
      dq_sphere<<<dq_sphere_grid, mma::kThreads, dq_sphere_bytes, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    dq_kernel<<<dq_grid, mma::kThreads, dq_bytes, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (sphere) {
      dkv_sphere<<<dkv_sphere_grid, mma::kThreads, dkv_sphere_bytes, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (onehot) {
      dkv_onehot<<<dkv_onehot_grid, mma::kThreads, dkv_onehot_bytes, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    dkv_kernel<<<dkv_grid, mma::kThreads, dkv_bytes, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return true;
  };
  return o.has_rel() ? run(std::true_type()) : run(std::false_type());
}

}  // namespace

// The backward of one head-dim bucket, all dtypes (declared in fused_window_attention_cuda.h; one
// fused_window_attention_bwd_d<DP>.cu instantiates each bucket).
template <int DP>
void window_attention_bwd_head_dim(const FusedOperands& o, BackwardTensors& t, double scale, bool deterministic) {
  SPTR_DISPATCH_FLOATING(o.q.scalar_type(), "window_attention_bwd_cuda", [&] {
    using T = typename CudaType<scalar_t>::type;
    using A = acc_t<T>;
    Args<T> a = make_args<T, scalar_t>(o, scale, t.bounds);
    a.vec = a.vec && aligned16(t.grad) && aligned16(t.out);
    a.dout = reinterpret_cast<const T*>(t.grad.const_data_ptr<scalar_t>());
    a.out = reinterpret_cast<const T*>(t.out.const_data_ptr<scalar_t>());
    a.lse_in = t.lse.const_data_ptr<A>();
    a.delta = t.delta.data_ptr<A>();
    a.dq = reinterpret_cast<T*>(t.dq.data_ptr<scalar_t>());
    a.dk = reinterpret_cast<T*>(t.dk.data_ptr<scalar_t>());
    a.dv = reinterpret_cast<T*>(t.dv.data_ptr<scalar_t>());
    a.dynamic = !deterministic;
    auto make_slots = [&](int dq_grid, int dkv_grid) {
      t.slots_q = o.table_grad_buffer(o.table_q, dq_grid);
      t.slots_v = o.table_grad_buffer(o.table_v, dq_grid);
      t.slots_k = o.table_grad_buffer(o.table_k, dkv_grid);
      a.dtq = t.slots_q.numel() ? t.slots_q.data_ptr<A>() : nullptr;
      a.dtv = t.slots_v.numel() ? t.slots_v.data_ptr<A>() : nullptr;
      a.dtk = t.slots_k.numel() ? t.slots_k.data_ptr<A>() : nullptr;
    };
    if constexpr (kTensorCores<T>) {
      if (launch_mma_backward<DP>(o, t.bounds, a, make_slots)) return;
    }
    dispatch_rel(o, [&](auto rel) {
      constexpr bool REL = decltype(rel)::value;
      const int ntiles = num_tiles(o);
      std::optional<TileBackward<T>> dq, dkv;
      if constexpr (REL && std::is_same_v<T, float>) {  // two groups per CTA where they fit
        dq = tile_backward<DqSmem<DP, T, 2>>(bwd_dq_kernel<DP, T, REL, 2>, a, ntiles, false);
        dkv = tile_backward<DkvSmem<DP, T, 2>>(bwd_dkv_kernel<DP, T, REL, 2>, a, ntiles, false);
      }
      if (!dq) dq = tile_backward<DqSmem<DP, T, 1>>(bwd_dq_kernel<DP, T, REL, 1>, a, ntiles, true);
      if (!dkv) dkv = tile_backward<DkvSmem<DP, T, 1>>(bwd_dkv_kernel<DP, T, REL, 1>, a, ntiles, true);
      make_slots(dq->grid, dkv->grid);
      a.tile_counter = t.counters.data_ptr<int32_t>();
      launch(dq->kernel, a, dq->grid, dq->bytes, dq->threads);  // also writes delta, read by the key side
      a.tile_counter = t.counters.data_ptr<int32_t>() + o.H;
      launch(dkv->kernel, a, dkv->grid, dkv->bytes, dkv->threads);
    });
  });
}

}  // namespace sptr
