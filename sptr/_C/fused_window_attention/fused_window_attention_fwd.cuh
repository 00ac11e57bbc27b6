// The CUDA forward kernels of the fused window attention (flash-attention style over variable-size windows);
// only out and lse are stored.
// fp16/bf16 without tables: fwd_mma_kernel, one pass with an online softmax, both products on mma.sync
// with the logits and probabilities in registers.
// Otherwise (fp32/fp64, relative-position tables, other head dims): fwd_kernel, two passes (the first finds
// each row's log-sum-exp, the second accumulates the exactly normalised P·V, so the value-table histogram
// needs no rescaling).
#pragma once
#include <sptr/dispatch.h>

#include "fused_window_attention_cuda.h"
#include "fused_window_attention_onehot.cuh"

namespace sptr {
namespace {

// -------------------------------------------------------------------------------------------- forward
template <int DP, typename T>
struct FwdSmem {
  using A = acc_t<T>;
  TokenInfo qi, ki;
  T *Q, *K, *V, *P, *Ts;
  A *S, *O, *Qt, *Kt, *Hv, *lse, *row_scale;
  __host__ __device__ FwdSmem(Bump& b, const Args<T>& a)
      : qi(b, a), ki(b, a), Q(b.take<T>(kBM * kLDT<DP>)), K(b.take<T>(kBM * kLDT<DP>)), V(b.take<T>(kBM * kLDT<DP>)),
        P(b.take<T>(kBM * kLDP)), Ts(b.take_if<T>(a.has_rel(), a.L3p * kLDT<DP>)), S(b.take<A>(kBM * kLDS)),
        O(b.take<A>(kBM * kLDO<DP>)), Qt(b.take_if<A>(a.tq != nullptr, kBM * a.L3p)),
        Kt(b.take_if<A>(a.tk != nullptr, kBM * a.L3p)), Hv(b.take_if<A>(a.tv != nullptr, kBM * a.L3p)),
        lse(b.take<A>(kBM)), row_scale(b.take<A>(kBM)) {}
};

// One-pass softmax step of fwd_kernel for fp32 (whose output tiles can scale their rows): row r's running max m
// (the same in the quad's four lanes, which hold the row's 32 columns of the block) moves to the block's max, the
// lanes' logits p (bits of `valid`) become exp(p − m), and their partial sums l and the row's value-table
// histogram (if rescale_hist) are scaled by alpha = exp(m_old − m_new), which goes to *alpha_row for the output
// tiles. Two passes (first the log-sum-exp, then exactly normalised P) cost every logit twice.
template <typename T, typename A>
__device__ __forceinline__ void online_block(A (&p)[8], unsigned valid, A& m, A& l, bool rescale_hist, A* hist_row,
                                             int L3p, A* alpha_row) {
  A mx = m;
#pragma unroll
  for (int e = 0; e < 8; ++e)
    if (valid >> e & 1u) mx = max(mx, p[e]);
  mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const A alpha = mx == -std::numeric_limits<A>::infinity() ? A(1) : exp_acc<T>(m - mx);
  A sum = 0;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    p[e] = (valid >> e & 1u) ? exp_acc<T>(p[e] - mx) : A(0);
    sum += p[e];
  }
  l = l * alpha + sum;
  m = mx;
  const int t = threadIdx.x & 3;
  if (t == 0) *alpha_row = alpha;
  if (rescale_hist && alpha != A(1))
    for (int n = t; n < L3p; n += 4) hist_row[n] *= alpha;
  __syncwarp();  // the quad's adds to the histogram row come next
}

template <int DP, typename T, bool REL>
__global__ void __launch_bounds__(kThreads, REL ? 2 : 6) fwd_kernel(const Args<T> a) {
  using A = acc_t<T>;
  extern __shared__ __align__(128) char smem[];
  Bump bump(smem);
  const FwdSmem<DP, T> s(bump, a);
  const Team<kThreads> cta = whole_cta();
  const int h = blockIdx.y, tid = threadIdx.x, r = tid >> 2, cb = (tid & 3) * 8;
  const int ntiles = (a.N + kBM - 1) / kBM;
  for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const int r0 = tile * kBM, nrows = min(kBM, a.N - r0);
    __syncthreads();
    load_token_info(cta, s.qi, a, r0, nrows, true);
    load_rows<DP>(cta, s.Q, a.q, a, r0, nrows, h);
    __syncthreads();
    const int kbeg = s.qi.lo[0], kend = s.qi.hi[nrows - 1], lo_r = s.qi.lo[r], hi_r = s.qi.hi[r];
    if (REL && a.tq) {
      stage_table<DP>(cta, s.Ts, a.tq, a, h);
      __syncthreads();
      tile_table_products<DP>(cta, s.Qt, s.Q, s.Ts, a);
      __syncthreads();
    }
    if (a.tk) stage_table<DP>(cta, s.Ts, a.tk, a, h);
    if (a.tv) zero_smem(cta, s.Hv, kBM * a.L3p);
    A m = -std::numeric_limits<A>::infinity(), l = 0, lse_r = 0;
    OutTiles<DP, T> acc;
    acc.zero();
    // fp32: one pass with an online softmax (the output tiles and the histogram rescaled per block); fp16/bf16
    // tiles (opaque wmma fragments) and fp64 keep two passes.
    constexpr bool kOnePass = kHistTiles<T>;
    constexpr int kLastPass = kOnePass ? 0 : 1;
    for (int pass = 0; pass <= kLastPass; ++pass) {
      for (int c0 = kbeg; c0 < kend; c0 += kBM) {
        const int ncols = min(kBM, kend - c0);
        __syncthreads();
        if (REL) load_token_info(cta, s.ki, a, c0, ncols, false);
        load_rows<DP>(cta, s.K, a.k, a, c0, ncols, h);
        if (pass == kLastPass) load_rows<DP>(cta, s.V, a.v, a, c0, ncols, h);
        __syncthreads();
        if (REL && a.tk) tile_table_products<DP>(cta, s.Kt, s.K, s.Ts, a);
        gemm_nt<DP>(cta, s.S, kLDS, s.Q, s.K, kBM / 16);
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
            if (kOnePass) {
              p[e] = sv;  // made a probability by online_block
            } else if (pass == 0) {
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
        }
        if constexpr (kOnePass)
          online_block<T>(p, valid, m, l, REL && a.tv, s.Hv + r * a.L3p, a.L3p, s.row_scale + r);
        if (pass == kLastPass) {
#pragma unroll
          for (int e = 0; e < 8; ++e) s.P[r * kLDP + cb + e] = narrow<T>(p[e]);
          if (REL && a.tv) quad_ordered_add(s.Hv + r * a.L3p, rows, p, valid);
          __syncthreads();
          if constexpr (kOnePass) acc.scale_rows(cta, s.row_scale);
          acc.template mma<false>(cta, s.P, kLDP, s.V, kBM);
        }
      }
      if (kOnePass) {  // the quad's partial sums share the row's max
        __syncthreads();  // every warp has scaled its tiles by the last block's row_scale
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        lse_r = l > A(0) ? m + log(l) : A(0);
        if ((tid & 3) == 0) {
          s.lse[r] = lse_r;
          s.row_scale[r] = l > A(0) ? A(1) / l : A(0);
        }
      } else if (pass == 0) {
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
    if (a.tv) stage_table<DP>(cta, s.Ts, a.tv, a, h);
    if constexpr (kHistTiles<T>) {  // out = (P·V + Hv·Tv) / l, both unnormalised
      if (REL && a.tv) {
        __syncthreads();
        acc.template mma<false>(cta, s.Hv, a.L3p, s.Ts, a.L3p);
      }
      acc.scale_rows(cta, s.row_scale);
    }
    acc.store(cta, s.O);
    __syncthreads();
    write_rows<DP>(cta, a.o, s.O, !kHistTiles<T> && REL && a.tv, s.Hv, s.Ts, a, r0, nrows, h, A(1));
    if (tid < nrows) a.lse[(int64_t)(r0 + tid) * a.H + h] = s.lse[tid];
  }
}

// ------------------------------------------------------------------------------- forward on mma.sync
// A CTA takes 64 query rows of one head (16 per warp) and walks the key blocks of their windows, K/V
// blocks double-buffered in shared memory by cp.async; a warp skips the key groups outside its rows'
// windows. With tables (REL): the query-side table products Qt (64 x 3L) are made once, the key-side Kt
// per key block, both on the tensor cores; each pair gathers its three rows of each, and the value
// table enters through per-row histograms Hv of P (rescaled with the running max), multiplied with Tv
// at the end.
// Without tables, head dims up to 32 take 32-key blocks and eight CTAs per multiprocessor (64 registers, a few
// spilled): on the H200 that took 27% less time than 64-key blocks at four CTAs (the compiler's own choice), as
// the kernel is bound by instruction issue and latency at ~2-3 key blocks per CTA (benchmarks/RESULTS.md).
template <int DP, bool REL> constexpr int kFwdBlock = (REL || DP <= 32) ? 32 : mma::kBlock<DP>;
template <int DP, bool REL> constexpr int kFwdMinBlocks = (!REL && DP <= 32) ? 8 : 1;

template <int DP, typename T, bool REL>
struct MmaFwdSmem {
  static constexpr int BN = kFwdBlock<DP, REL>, LD = mma::kLd<DP>;
  // Two buffers each (index buf · size, never an array of pointers: a run-time index would put it on the stack).
  T *K, *V, *table = nullptr;
  int* kc = nullptr;    // key coordinates (BN, 3)
  float* kr = nullptr;  // key radii (BN)
  float *qt = nullptr, *kt = nullptr, *hv = nullptr;
  int lp = 0;  // row pitch of qt, kt, hv (floats)
  __host__ __device__ MmaFwdSmem(Bump& b, const Args<T>& a) : K(b.take<T>(2 * BN * LD)), V(b.take<T>(2 * BN * LD)) {
    if (!REL) return;
    lp = a.L3p + 4;
    table = b.take<T>(a.L3p * LD);
    kc = b.take<int>(2 * BN * 3);
    kr = b.take_if<float>(a.rel.radius != nullptr, 2 * BN);
    qt = b.take_if<float>(a.tq != nullptr, mma::kRows * lp);
    kt = b.take_if<float>(a.tk != nullptr, BN * lp);
    hv = b.take_if<float>(a.tv != nullptr, mma::kRows * lp);
  }
};

template <int DP, typename T, bool REL>
__device__ __forceinline__ void fwd_mma_item(const Args<T>& a, const MmaFwdSmem<DP, T, REL>& sm, int item) {
  using namespace mma;
  using Smem = MmaFwdSmem<DP, T, REL>;
  constexpr int BN = Smem::BN, LD = kLd<DP>, NT = BN / 8, DT = DP / 8;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const WarpItem it(a.bounds, a.N, a.H, item);
  const int h = it.h, kbeg = it.lo, kend = it.hi, w0 = it.w0;
  const bool active = it.active;
  const int2 wrange = it.wrange, win0 = it.win0, win1 = it.win1, wshared = it.shared_window(a.bounds, a.N);
  uint32_t qf[DP / 16][4];
  load_a_rows<DP>(qf, a.q, a.N, a.H, w0, h);
  const float sl2 = static_cast<float>(a.scale) * kLog2e;  // logits in log2 units: exp2 instead of exp
  // REL: the thread's two query rows (coordinates, radii, products and histogram rows).
  int cq[2][3] = {};
  float rq[2] = {0.f, 0.f};
  float *qt_row[2] = {nullptr, nullptr}, *hv_row[2] = {nullptr, nullptr};
  if constexpr (REL) {
    own_coords(a, w0, cq, &rq);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (a.tq) qt_row[i] = sm.qt + (warp * 16 + g + 8 * i) * sm.lp;
      if (a.tv) hv_row[i] = sm.hv + (warp * 16 + g + 8 * i) * sm.lp;
    }
    if (a.tq) {
      async_rows<DP, LD, kThreads>(sm.table, a.tq, a.H, 0, a.L3, a.L3p, h);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      table_products<DP, LD>(sm.qt + warp * 16 * sm.lp, sm.lp, qf, sm.table, 0, a.L3p / 16);
      __syncthreads();
    }
    if (a.tk) {  // waited for with the first key block
      async_rows<DP, LD, kThreads>(sm.table, a.tk, a.H, 0, a.L3, a.L3p, h);
      cp_async_commit();
    }
    if (a.tv)
      for (int i = lane; i < 16 * sm.lp; i += 32) sm.hv[warp * 16 * sm.lp + i] = 0.f;
    __syncwarp();
  }
  float o[DT][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int nblocks = (kend - kbeg + BN - 1) / BN;
  auto load = [&](int blk) {
    load_key_block<DP, BN>(sm.K, sm.V, REL ? sm.kc : nullptr, sm.kr, a, kbeg, kend, blk, h);
  };
  double_buffered(nblocks, load, [&](int blk) {
    const int c0 = kbeg + blk * BN, buf = blk & 1;
    const T* K = sm.K + buf * BN * LD;
    const T* V = sm.V + buf * BN * LD;
    const int* kc = sm.kc + buf * BN * 3;
    const float* kr = sm.kr + buf * BN;
    if constexpr (REL) {
      if (a.tk) {  // Kt of the block
        block_products<DP, BN>(sm.kt, sm.lp, K, sm.table, a.L3p);
        __syncthreads();
      }
    }
    if (active && c0 < wrange.y && c0 + BN > wrange.x) {
      float s[NT][4] = {};
      uint32_t rows[NT][4] = {};  // REL: the pair's three table rows, packed
      bool live[NT / 2];          // the 16 keys touch the warp's windows (warp-uniform); others stay p = 0
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        live[np] = overlaps16(c0 + 16 * np, wrange);
        if (live[np]) mma_abt_pair<DP, LD>(s, qf, K, np);
      }
      // The windows of the thread's rows in block columns, less the thread's column offset 2t.
      const int lo[2] = {win0.x - c0 - 2 * t, win1.x - c0 - 2 * t}, hi[2] = {win0.y - c0 - 2 * t, win1.y - c0 - 2 * t};
      float mx[2] = {m[0], m[1]};
      auto logit = [&](int nt, int e) {  // s[nt][e] in log2 units, into the row max
        const int i = e >> 1;
        if constexpr (REL) {
          const int col = nt * 8 + 2 * t + (e & 1);
          const uint32_t packed = pack_rows(a.rel, cq[i], kc + col * 3, rq[i], a.rel.radius ? kr[col] : 0.f);
          rows[nt][e] = packed;
          const float qb = a.tq ? gather3(qt_row[i], packed) : 0.f;
          const float kb = a.tk ? gather3(sm.kt + col * sm.lp, packed) : 0.f;
          s[nt][e] = (s[nt][e] + qb) * sl2 + kb * kLog2e;
        } else {
          s[nt][e] *= sl2;
        }
        mx[i] = fmaxf(mx[i], s[nt][e]);
      };
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (!live[nt / 2]) continue;
        // Keys inside every row's window need no mask. With tables the masked form alone: a second copy of the
        // pair's table work made the loop too long for the instruction cache (22 % of the forward's stall samples
        // on the spherical windows were for want of an instruction at 2 CTAs per multiprocessor).
        if (!REL && c0 + 16 * (nt / 2) >= wshared.x && c0 + 16 * (nt / 2) + 16 <= wshared.y) {
#pragma unroll
          for (int e = 0; e < 4; ++e) logit(nt, e);
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = nt * 8 + (e & 1), i = e >> 1;
            if (c < lo[i] || c >= hi[i]) s[nt][e] = -INFINITY;
            else logit(nt, e);
          }
        }
      }
      float alpha[2];
      online_softmax<DT, NT>(s, live, mx, m, l, o, alpha);
      if constexpr (REL) {
        if (a.tv) {
#pragma unroll
          for (int i = 0; i < 2; ++i)
            if (alpha[i] != 1.f)  // quad-uniform: the quad rescales its row's histogram
              for (int c = t; c < a.L3p; c += 4) hv_row[i][c] *= alpha[i];
          quad_hist_add(hv_row[0], hv_row[1], rows, s);
        }
      }
      c_tiles_times<DP, LD>(o, s, live, V, [](const uint32_t (&)[4], int) {});
    }
  });
  float inv[2];
  row_inverse(l, inv);
  if constexpr (REL) {
    if (a.tv) {  // out = (P·V + Hv·Tv) / l, Hv normalised before its rounding to T
      async_rows<DP, LD, kThreads>(sm.table, a.tv, a.H, 0, a.L3, a.L3p, h);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[dt][e] *= inv[e >> 1];
      if (active) add_rows_times_table<DP, LD>(o, sm.hv + warp * 16 * sm.lp, sm.lp, sm.table, a.L3p, inv[0], inv[1]);
      inv[0] = inv[1] = 1.f;
    }
  }
  if (active) store_out_and_lse<DP>(a, o, w0, h, inv, m, l);
}

// One CTA per (64-row tile, head) item; a smaller grid walks the items (the fallback of the one-hot kernel,
// which returns at once when that kernel does the work).
template <int DP, typename T, bool REL>
__global__ void __launch_bounds__(mma::kThreads, kFwdMinBlocks<DP, REL>) fwd_mma_kernel(const Args<T> a) {
  if (REL && a.onehot != nullptr && *a.onehot) return;
  extern __shared__ __align__(128) char smem[];
  Bump bump(smem);
  const MmaFwdSmem<DP, T, REL> sm(bump, a);
  const int items = (a.N + mma::kRows - 1) / mma::kRows * a.H;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    if (item != (int)blockIdx.x) __syncthreads();  // the previous item's shared memory is read out
    fwd_mma_item<DP, T, REL>(a, sm, item);
  }
}

// ------------------------------------------------------------- forward with one-hot tables
// The fp16/bf16 forward with relative-position tables of cell coordinates inside [0, kOneHot): every table term
// of the one-hot axes is a tensor-core product (fused_window_attention_mma.cuh):
//   logits  += Q̃·Eᵀ (query side; Q̃ built once per tile from the tile's q·Tq products, E of the keys made in
//              registers from their coordinates) and E_q·K̃ᵀ (key side; K̃ per key block from its k·Tk products)
//   G_a     += P·E_a (value side: the probabilities per key coordinate, in registers, rescaled as P·V is)
// and at the end the value-table term Σ_n H[n]·Tv[n] with H[i][clamp(c_i,a − u + s)·3 + a] = Σ G_a[i][u].
// Cubic tables (SphereFormer's cubic windows) have three one-hot axes and no table work left per pair. SPHERE:
// tables whose axis 2 has radial bins (the spherical windows): the two angular axes are one-hot (48 columns,
// three k-steps), the radial terms are gathered per pair as in fwd_mma_kernel, from one bin per pair: the own
// rows' radial products q·Tq[bin·3 + 2] and radial value histograms (fp32, L columns each) and the key block's
// k·Tk products, which block_tilde leaves in shared memory (the gather kernel keeps three fp32 arrays of 3L
// columns per row instead: fewer CTAs per multiprocessor).
template <int DP, typename T, bool SPHERE>
struct OneHotFwdSmem {
  static constexpr int BN = 32, LD = mma::kLd<DP>, TL = mma::kOneHotLdOf<SPHERE ? kSphereAxes : 3>;
  // Products are kept as hi and lo 16-bit planes (table_products16): qt/qt_lo, kt/kt_lo, ktil/ktil_lo.
  T *table, *K, *V, *qt, *qt_lo, *kt, *kt_lo, *ktil, *ktil_lo, *E;  // E: the key block's one-hot rows
  int* kc;
  float* hv;
  float *krad, *qr, *hvr;  // SPHERE: the key blocks' radii (2 buffers); the own rows' radial products, histograms
  int lp, hlp, rp;  // row pitch of qt/kt (16-bit elements, odd in words: no bank conflicts between rows), hv, qr
  __host__ __device__ OneHotFwdSmem(Bump& b, const Args<T>& a) : lp(a.L3p + 2), hlp(a.L3p + 4), rp(a.rel.L) {
    table = b.take<T>(a.L3p * LD);
    kc = b.take<int>(2 * BN * 3);
    krad = b.take_if<float>(SPHERE, 2 * BN);
    qr = b.take_if<float>(SPHERE && a.tq != nullptr, mma::kRows * rp);
    hvr = b.take_if<float>(SPHERE && a.tv != nullptr, mma::kRows * rp);
    // The key loop's buffers. Before the loop they hold the tile's q·Tq products (qt, qt_lo: Q̃ is built from
    // them into registers, and the CTA synchronised, before the first key block is loaded); after it, the
    // value histogram hv.
    char* const loop = next_take(b);
    K = b.take<T>(2 * BN * LD);
    V = b.take<T>(2 * BN * LD);
    kt = b.take_if<T>(a.tk != nullptr, BN * lp);
    kt_lo = b.take_if<T>(a.tk != nullptr, BN * lp);
    ktil = b.take_if<T>(a.tk != nullptr, BN * TL);
    ktil_lo = b.take_if<T>(a.tk != nullptr, BN * TL);
    E = b.take<T>(BN * TL);
    const size_t qt_bytes = align128(size_t(mma::kRows) * lp * sizeof(T));
    qt = reinterpret_cast<T*>(loop);
    qt_lo = reinterpret_cast<T*>(loop + qt_bytes);
    reserve_from(b, loop, a.tq != nullptr ? 2 * qt_bytes : 0);
    hv = reinterpret_cast<float*>(loop);
    reserve_from(b, loop, a.tv != nullptr ? size_t(mma::kRows) * hlp * sizeof(float) : 0);
  }
};

// CTAs per multiprocessor: three up to head dim 32 (168 registers; head dim 32 spills 32 bytes, read in the key
// loop three words per block; 48 / 57 KB of shared memory at head dim 16 / 32 and L = 47, Q̃'s products lying
// over the loop's buffers), two up to 64. Three were 1.2-1.3x faster than two at head dim 16 and 1.2x at head
// dim 32 (benchmarks/RESULTS.md, "Table path, step 8" and the tenth session).
template <int DP> constexpr int kOneHotMinBlocks = DP <= 32 ? 3 : (DP <= 64 ? 2 : 1);

template <int DP, typename T, bool SPHERE>
__global__ void __launch_bounds__(mma::kThreads, kOneHotMinBlocks<DP>) fwd_onehot_kernel(const Args<T> a) {
  using namespace mma;
  using Smem = OneHotFwdSmem<DP, T, SPHERE>;
  constexpr int BN = Smem::BN, LD = kLd<DP>, NT = BN / 8, DT = DP / 8, AXES = SPHERE ? kSphereAxes : 3;
  if (!*a.onehot) return;  // a one-hot coordinate leaves the one-hot range: fwd_mma_kernel<REL> does the work
  extern __shared__ __align__(128) char smem[];
  Bump bump(smem);
  const Smem sm(bump, a);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const WarpItem it(a.bounds, a.N, a.H, blockIdx.x);
  const int h = it.h, kbeg = it.lo, kend = it.hi, w0 = it.w0;
  const bool active = it.active;
  const int2 wrange = it.wrange, win0 = it.win0, win1 = it.win1, wshared = it.shared_window(a.bounds, a.N);
  const int L = a.rel.L, shift = a.rel.rel_shift;
  uint32_t qf[DP / 16][4];
  load_a_rows<DP>(qf, a.q, a.N, a.H, w0, h);
  const float sl2 = static_cast<float>(a.scale) * kLog2e;
  int cq[2][3];  // coordinates of the thread's rows g and g+8 (0 past N: in range, never stored)
  float rq[2];   // SPHERE: their radii
  own_coords(a, w0, cq, SPHERE ? &rq : nullptr);
  const int own = warp * 16 * sm.rp;  // SPHERE: the warp's rows of qr and hvr; the thread's rows g and g+8:
  auto qr_row = [&](int i) { return sm.qr + own + ((lane >> 2) + 8 * i) * sm.rp; };
  auto hvr_row = [&](int i) { return sm.hvr + own + ((lane >> 2) + 8 * i) * sm.rp; };
  // Q̃ of the warp's rows as A fragments (hi and lo planes) and with SPHERE their radial products, from the
  // tile's q·Tq products; then the table buffer takes Tk and the products' memory becomes the key loop's buffers.
  TildeA<AXES> qtil = {};
  if (a.tq) own_tilde_regs<AXES, DP>(qtil, SPHERE ? sm.qr : nullptr, sm.rp, sm.qt, sm.qt_lo, sm.lp, sm.table, a.tq, a,
                                     h, qf, cq);
  if (SPHERE && a.tv) {
    for (int x = lane; x < 16 * sm.rp; x += 32) sm.hvr[own + x] = 0.f;
    __syncwarp();
  }
  if (a.tk) {  // waited for with the first key block
    async_rows<DP, LD, kThreads>(sm.table, a.tk, a.H, 0, a.L3, a.L3p, h);
    cp_async_commit();
  }
  float o[DT][4] = {};
  OneHotHistOf<AXES> gv = {};  // G_a[i][u] in C tiles: tile a·kOneHotGroups + u/8
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int nblocks = (kend - kbeg + BN - 1) / BN;
  auto load = [&](int blk) {
    load_key_block<DP, BN>(sm.K, sm.V, sm.kc, SPHERE ? sm.krad : nullptr, a, kbeg, kend, blk, h);
  };
  double_buffered(nblocks, load, [&](int blk) {
    const int c0 = kbeg + blk * BN, buf = blk & 1;
    const T* K = sm.K + buf * BN * LD;
    const T* V = sm.V + buf * BN * LD;
    const int* kc = sm.kc + buf * BN * 3;
    const float* kr = sm.krad + buf * BN;
    onehot_block<BN, AXES>(sm.E, kc);
    if (a.tk)
      block_tilde<false, DP, BN, AXES>(sm.ktil, sm.ktil_lo, sm.kt, sm.kt_lo, sm.lp, K, sm.table, kc, a.L3p, L, shift);
    else __syncthreads();  // block_tilde's barriers publish E
    if (active && c0 < wrange.y && c0 + BN > wrange.x) {
      float s[NT][4] = {}, kb[NT][4] = {};
      int bins[NT][4] = {};  // SPHERE: the pairs' radial bins
      bool live[NT / 2];     // the 16 keys touch the warp's windows (warp-uniform); others stay p = 0
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        live[np] = overlaps16(c0 + 16 * np, wrange);
        if (!live[np]) continue;
        mma_abt_pair<DP, LD>(s, qf, K, np);
        if (a.tq) tilde_a_times_onehot<AXES>(s, qtil, sm.E, np);  // s += Q̃·Eᵀ
        if (a.tk) onehot_rows_times_tilde<T, NT, AXES>(kb, cq[0], cq[1], sm.ktil, sm.ktil_lo, np);  // kb = E_q·K̃ᵀ
      }
      const int lo[2] = {win0.x - c0 - 2 * t, win1.x - c0 - 2 * t}, hi[2] = {win0.y - c0 - 2 * t, win1.y - c0 - 2 * t};
      float mx[2] = {m[0], m[1]};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (!live[nt / 2]) continue;
        const bool inside = c0 + 16 * (nt / 2) >= wshared.x && c0 + 16 * (nt / 2) + 16 <= wshared.y;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = nt * 8 + (e & 1), i = e >> 1;
          if (!inside && (c < lo[i] || c >= hi[i])) {
            s[nt][e] = -INFINITY;
          } else {
            if constexpr (SPHERE) {  // the radial terms
              const int col = c + 2 * t, bin = clamp_rel(radial_bin(rq[i] - kr[col], a.rel), L);
              bins[nt][e] = bin;
              const int at = col * sm.lp + bin * 3 + 2;
              const float qb = a.tq ? qr_row(i)[bin] : 0.f;
              const float kbr = a.tk ? widen(sm.kt[at]) + widen(sm.kt_lo[at]) : 0.f;
              s[nt][e] = (s[nt][e] + qb) * sl2 + (kb[nt][e] + kbr) * kLog2e;
            } else {
              s[nt][e] = s[nt][e] * sl2 + kb[nt][e] * kLog2e;
            }
            mx[i] = fmaxf(mx[i], s[nt][e]);
          }
        }
      }
      float alpha[2];
      online_softmax<DT, NT>(s, live, mx, m, l, o, alpha);
      if (a.tv) {
#pragma unroll
        for (int x = 0; x < AXES * kOneHot / 8; ++x)
#pragma unroll
          for (int e = 0; e < 4; ++e) gv[x][e] *= alpha[e >> 1];
        if constexpr (SPHERE) {
#pragma unroll
          for (int i = 0; i < 2; ++i)
            if (alpha[i] != 1.f)  // quad-uniform: the quad rescales its row's radial histogram
              for (int c = t; c < L; c += 4) hvr_row(i)[c] *= alpha[i];
          quad_bin_add(hvr_row(0), hvr_row(1), bins, s);
        }
      }
      c_tiles_times<DP, LD>(o, s, live, V, [&](const uint32_t (&pa)[4], int kk) {
        if (a.tv) onehot_hist_add<AXES>(gv, pa, sm.E, kk);  // G_a += P·E_a
      });
    }
  });
  float inv[2];
  row_inverse(l, inv);
  if (a.tv) {  // out = (P·V + H·Tv) / l, H from G (and the radial histogram) normalised before rounding to T
    __syncthreads();  // every warp has left the loop: its buffers become the histogram
    async_rows<DP, LD, kThreads>(sm.table, a.tv, a.H, 0, a.L3, a.L3p, h);
    cp_async_commit();
    float* hrow = sm.hv + warp * 16 * sm.hlp;
    onehot_hist_store<true, AXES>(hrow, sm.hlp, gv, cq, inv, L, shift);
    if constexpr (SPHERE) radial_column(hrow, sm.hlp, sm.hvr + own, sm.rp, L, inv);
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[dt][e] *= inv[e >> 1];
    if (active) add_rows_times_table<DP, LD>(o, hrow, sm.hlp, sm.table, a.L3p, 1.f, 1.f);
    inv[0] = inv[1] = 1.f;
  }
  if (active) store_out_and_lse<DP>(a, o, w0, h, inv, m, l);
}

// Launches the mma.sync forward if it applies (fp16/bf16, head dim 16..128 with aligned rows, its shared
// memory fits); false leaves the work to fwd_kernel. Cubic tables (no radial bins) go to the one-hot kernel,
// launched together with the gather kernel on a grid of resident CTAs: a device flag, set from the
// coordinates without a host sync, tells one of them to return at once.
template <int DP, typename T>
bool launch_mma_forward(const FusedOperands& o, Args<T> a) {
  if (!a.vec) return false;
  const auto stream = at::cuda::getCurrentCUDAStream();
  auto run = [&](auto rel) {
    constexpr bool REL = decltype(rel)::value;
    auto* kernel = fwd_mma_kernel<DP, T, REL>;
    const size_t bytes = fit_smem(kernel, smem_bytes<MmaFwdSmem<DP, T, REL>>(a));
    if (bytes == 0) return false;
    unsigned int grid = mma_grid(o);
    at::Tensor flag;
    // Spherical tables (radial bins) take the one-hot kernel of the angular axes, cubic ones that of all three.
    const bool radial = o.radius.defined();
    auto* onehot = radial ? fwd_onehot_kernel<DP, T, true> : fwd_onehot_kernel<DP, T, false>;
    const size_t onehot_bytes = !REL ? 0
                                : radial ? fit_smem(onehot, smem_bytes<OneHotFwdSmem<DP, T, true>>(a))
                                         : fit_smem(onehot, smem_bytes<OneHotFwdSmem<DP, T, false>>(a));
    if (onehot_bytes > 0) {
      flag = onehot_flag(o);
      a.onehot = flag.const_data_ptr<int>();
      onehot<<<grid, mma::kThreads, onehot_bytes, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      int per_sm = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, mma::kThreads, bytes));
      const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
      grid = std::min<unsigned int>(grid, std::max(1, per_sm) * sms);
    }
    kernel<<<grid, mma::kThreads, bytes, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return true;
  };
  return o.has_rel() ? (3 * o.L <= kMaxRows3 && run(std::true_type())) : run(std::false_type());
}

}  // namespace

// The forward of one head-dim bucket, all dtypes (declared in fused_window_attention_cuda.h; one
// fused_window_attention_fwd_d<DP>.cu instantiates each bucket, so that the build compiles them in parallel).
template <int DP>
void window_attention_fwd_head_dim(const FusedOperands& o, double scale, const at::Tensor& bounds, at::Tensor& out,
                                   at::Tensor& lse) {
  SPTR_DISPATCH_FLOATING(o.q.scalar_type(), "window_attention_fwd_cuda", [&] {
    using T = typename CudaType<scalar_t>::type;
    Args<T> a = make_args<T, scalar_t>(o, scale, bounds);
    a.o = reinterpret_cast<T*>(out.data_ptr<scalar_t>());
    a.lse = lse.data_ptr<acc_t<T>>();
    if constexpr (kTensorCores<T>) {
      if (launch_mma_forward<DP>(o, a)) return;
    }
    dispatch_rel(o, [&](auto rel) {
      constexpr bool REL = decltype(rel)::value;
      const size_t bytes = prepare<FwdSmem<DP, T>>(fwd_kernel<DP, T, REL>, a, "window_attention");
      launch(fwd_kernel<DP, T, REL>, a, num_tiles(o), bytes);
    });
  });
}

}  // namespace sptr
