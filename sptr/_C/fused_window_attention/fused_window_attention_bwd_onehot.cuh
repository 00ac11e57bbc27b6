// The fp16/bf16 backward with one-hot cubic tables (cell coordinates inside [0, kOneHot), no radial bins):
// the table terms of the recomputed logits and of dP, and the three histograms of the table gradients, are
// tensor-core products with one-hot coordinate matrices (fused_window_attention_onehot.cuh), so no table work
// is left per pair. Included by fused_window_attention_bwd.cuh, which launches these kernels beside the
// gather kernels (bwd_dq_mma_kernel<.., true>, bwd_dkv_mma_kernel<.., true>); a device flag set from the
// coordinates tells one pair to return at once. Like those, the grid is persistent and takes the (64-row tile,
// head) items round-robin, each CTA adding its items' table gradients into a slot of its own: deterministic.
#pragma once
#include "fused_window_attention_onehot.cuh"

namespace sptr {
namespace {

// The heads [h0, h0 + nh) of one launch; its items are (64-row tile, head) pairs, heads adjacent, and item i
// of the launch is WarpItem's item tile·H + head.
struct Heads {
  int h0, nh;
  __device__ __forceinline__ int item(int H, int i) const { return (i / nh) * H + h0 + i % nh; }
};
template <typename T>
__device__ __forceinline__ int num_items(const Args<T>& a, Heads hs) {
  return (a.N + mma::kRows - 1) / mma::kRows * hs.nh;
}
template <typename T>
__device__ __forceinline__ int num_items(const Args<T>& a) { return num_items(a, Heads{0, a.H}); }

// Heads per pass of the stored-pairs backward: as many heads' words (M each) as the buffer holds; 0 without the
// buffer or where not one head fits (then the recomputing kernels do the work).
template <typename T>
__device__ __forceinline__ int stored_heads(const Args<T>& a) {
  if (a.pairs.off == nullptr) return 0;
  const int64_t m = a.pairs.off[a.N];
  return m == 0 ? a.H : static_cast<int>(min(static_cast<int64_t>(a.H), a.pairs.capacity / m));
}

// The heads of this launch of a one-hot backward kernel (nh = 0: return at once). The recomputing kernels
// (STORED false) take every head unless the stored pairs do the work, the stored ones the heads of their pass.
template <bool STORED, typename T>
__device__ __forceinline__ Heads launch_heads(const Args<T>& a) {
  if (!*a.onehot) return {0, 0};  // a coordinate leaves the one-hot range: the gather kernels do the work
  const int g = stored_heads(a);
  if (!STORED) return {0, g > 0 ? 0 : a.H};
  const int h0 = a.pairs.pass * g;
  return {h0, g == 0 || h0 >= a.H ? 0 : min(g, a.H - h0)};
}

// The word of pair (q, k) of the window w of n tokens from s (PairStore) as a row base for either side: a query
// row's word of key k is query_row_base + k, a key row's word of query q is key_row_base + q·n.
__device__ __forceinline__ int64_t query_row_base(const int64_t* off, int q, int2 w) {
  return off[w.x] + (int64_t)(q - w.x) * (w.y - w.x) - w.x;
}
__device__ __forceinline__ int64_t key_row_base(const int64_t* off, int k, int2 w) {
  return off[w.x] + (k - w.x) - (int64_t)w.x * (w.y - w.x);
}

// Own coordinates of the item's rows [r0, r0 + n) into oc ([kRows][3], 0 past n), for their tilde rows.
template <typename T>
__device__ __forceinline__ void stage_own_coords(int* oc, const Args<T>& a, int r0, int n) {
  for (int i = threadIdx.x; i < mma::kRows * 3; i += mma::kThreads)
    oc[i] = i / 3 < n ? a.rel.coords[(int64_t)r0 * 3 + i] : 0;
}

// Tilde rows of the item's 64 own rows (A fragments `f` per warp) with table x of head h: the table staged into
// `table`, the products into own/own_lo, the tilde rows of the first AXES axes into til/til_lo and, with
// `radial`, the rows' radial products (pitch rp). Ends with the CTA synchronised.
template <bool QUERY, int DP, int AXES = 3, typename T>
__device__ void own_tilde(T* til, T* til_lo, T* own, T* own_lo, int lp, T* table, const T* x, const Args<T>& a,
                          int h, const uint32_t (&f)[DP / 16][4], const int* oc, float* radial = nullptr, int rp = 0) {
  using namespace mma;
  constexpr int LD = kLd<DP>;
  async_rows<DP, LD, kThreads>(table, x, a.H, 0, a.L3, a.L3p, h);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  const int at = (threadIdx.x >> 5) * 16 * lp;
  table_products16<DP, LD>(own + at, own_lo + at, lp, f, table, 0, a.L3p / 16);
  __syncthreads();
  if (radial != nullptr) radial_products(radial, rp, own, own_lo, lp, kRows, a.rel.L, threadIdx.x, kThreads);
  onehot_tilde<QUERY, kRows, AXES>(til, til_lo, own, own_lo, lp, oc, a.rel.L, a.rel.rel_shift);
  __syncthreads();
}

// Shared memory of bwd_dq_onehot_kernel: 64 query rows, 32-key blocks double-buffered. The own rows' table
// products overlay the key-side buffers before the loop; the histogram and the own Q and dO tiles (operands
// of the table gradients) overlay Q̃ and G̃ after it. SPHERE (radial bins on axis 2): one-hot rows of the
// angular axes, Q̃ in registers instead (so that two CTAs fit), and the radial state: the key blocks' radii, the
// own rows' radial products q·Tq and dO·Tv (the loop; the end's buffers overlay them) and radial histograms of
// dS and P (the loop and the item's end; fp32, L columns each).
template <int DP, typename T, bool SPHERE>
struct OneHotDqSmem {
  static constexpr int BN = 32, LD = mma::kLd<DP>, R = mma::kRows, TL = mma::kOneHotLdOf<SPHERE ? kSphereAxes : 3>;
  int *oc, *kc;                          // own coordinates (for own_tilde); the key blocks' (2 buffers)
  float* krad;                           // SPHERE: the key blocks' radii (2 buffers)
  T* table;                              // Tq, Tv before the loop, Tk in it, Tq after it
  float *hqr, *hvr;                      // SPHERE: own radial histograms of dS and P
  float *qr, *gr;                        // SPHERE: own radial products (the loop)
  T *qtil, *qtil_lo, *gtil, *gtil_lo;    // own Q̃ (SPHERE: in registers) and G̃ (the loop)
  T *K, *V, *kt, *kt_lo, *ktil, *ktil_lo;  // key blocks (2 buffers), their k·Tk products and K̃
  T* E;                                  // the key block's one-hot rows
  T *own, *own_lo;                       // own q·Tq or dO·Tv products (before the loop)
  float* hist;                           // Hq, then Hv (after the loop), pitch hlp
  T *Xq, *Xg;                            // own Q and dO tiles (after the loop)
  int lp, hlp, rp;
  __host__ __device__ OneHotDqSmem(Bump& b, const Args<T>& a) : lp(a.L3p + 2), hlp(a.L3p + 4), rp(a.rel.L) {
    oc = b.take<int>(R * 3);
    kc = b.take<int>(2 * BN * 3);
    krad = b.take_if<float>(SPHERE, 2 * BN);
    table = b.take<T>(a.L3p * LD);
    hqr = b.take_if<float>(SPHERE && a.tq != nullptr, R * rp);
    hvr = b.take_if<float>(SPHERE && a.tv != nullptr, R * rp);
    char* const end = next_take(b);
    qr = b.take_if<float>(SPHERE && a.tq != nullptr, R * rp);
    gr = b.take_if<float>(SPHERE && a.tv != nullptr, R * rp);
    qtil = b.take_if<T>(!SPHERE && a.tq != nullptr, R * TL);
    qtil_lo = b.take_if<T>(!SPHERE && a.tq != nullptr, R * TL);
    gtil = b.take_if<T>(a.tv != nullptr, R * TL);
    gtil_lo = b.take_if<T>(a.tv != nullptr, R * TL);
    char* const keys = next_take(b);
    K = b.take<T>(2 * BN * LD);
    V = b.take<T>(2 * BN * LD);
    kt = b.take_if<T>(a.tk != nullptr, BN * lp);
    kt_lo = b.take_if<T>(a.tk != nullptr, BN * lp);
    ktil = b.take_if<T>(a.tk != nullptr, BN * TL);
    ktil_lo = b.take_if<T>(a.tk != nullptr, BN * TL);
    E = b.take<T>(BN * TL);
    own = reinterpret_cast<T*>(keys);
    own_lo = reinterpret_cast<T*>(keys + align128(R * lp * sizeof(T)));
    if (a.tq != nullptr || a.tv != nullptr) reserve_from(b, keys, 2 * align128(R * lp * sizeof(T)));
    hist = reinterpret_cast<float*>(end);
    const size_t hist_bytes = align128(R * hlp * sizeof(float)), tile_bytes = align128(R * LD * sizeof(T));
    Xq = reinterpret_cast<T*>(end + hist_bytes);
    Xg = reinterpret_cast<T*>(end + hist_bytes + tile_bytes);
    reserve_from(b, end, hist_bytes + 2 * tile_bytes);
  }
};

// The end of a dq item with the one-hot histograms Hq (of dS) and Hv (of P): dq = scale·(dS·K + Σ_n Hq[n]·Tq[n])
// into a.dq, dTq = scale·Hqᵀ·Q and dTv = Hvᵀ·dO into this CTA's slot. Shared memory free to take: the
// histogram (64 rows, pitch hlp, fp32), the own Q and dO tiles Xq, Xg and the table buffer. The one-hot
// histograms cover the first AXES axes; the spherical tables' radial columns come from the rows hqr and hvr
// (64 x rp fp32, the radial bins).
template <int DP, int AXES = 3, typename T>
__device__ void dq_item_end(const Args<T>& a, const mma::WarpItem& it, float (&dq)[DP / 8][4],
                            const OneHotHistOf<AXES>& hq, const OneHotHistOf<AXES>& hv, const int (&cq)[2][3],
                            float* hist, int hlp, T* Xq, T* Xg, T* table, int64_t slot, const float* hqr = nullptr,
                            const float* hvr = nullptr, int rp = 0) {
  using namespace mma;
  constexpr int LD = kLd<DP>, R = kRows;
  const int h = it.h, L = a.rel.L, shift = a.rel.rel_shift;
  const float one[2] = {1.f, 1.f};
  float* hrow = hist + (threadIdx.x >> 5) * 16 * hlp;
  if (a.tq) {
    async_block<DP, LD, R, kThreads>(Xq, a.q, a.H, it.r0, it.n, h);
    async_rows<DP, LD, kThreads>(table, a.tq, a.H, 0, a.L3, a.L3p, h);
    cp_async_commit();
    onehot_hist_store<true, AXES>(hrow, hlp, hq, cq, one, L, shift);
    if (hqr) radial_column(hrow, hlp, hqr + (threadIdx.x >> 5) * 16 * rp, rp, L, one);
    cp_async_wait<0>();
    __syncthreads();
    if (it.active) add_rows_times_table<DP, LD>(dq, hrow, hlp, table, a.L3p, 1.f, 1.f);
    table_grad_mma<DP, LD>(a.dtq + slot, hist, hlp, Xq, a.L3, a.L3p, a.H, h, a.scale);
    __syncthreads();
  }
  if (a.tv) {
    async_block<DP, LD, R, kThreads>(Xg, a.dout, a.H, it.r0, it.n, h);
    cp_async_commit();
    onehot_hist_store<true, AXES>(hrow, hlp, hv, cq, one, L, shift);
    if (hvr) radial_column(hrow, hlp, hvr + (threadIdx.x >> 5) * 16 * rp, rp, L, one);
    cp_async_wait<0>();
    __syncthreads();
    table_grad_mma<DP, LD>(a.dtv + slot, hist, hlp, Xg, a.L3, a.L3p, a.H, h, 1.f);
  }
  if (it.active) {
    const float f = static_cast<float>(a.scale);
    store_c_rows<DP>(a.dq, dq, a.N, a.H, it.w0, h, f, f);
  }
}

// Two CTAs per multiprocessor up to head dim 64 (the histograms' 72 accumulators per thread fit 255 registers).
template <int DP> constexpr int kOneHotBwdMinBlocks = DP <= 64 ? 2 : 1;

// dq of 64 query rows of one head (16 per warp), as bwd_dq_mma_kernel, with the table terms of the one-hot axes
// as tensor-core products: logits += Q̃·Eᵀ (own Q̃) + E·K̃ᵀ (K̃ per key block), dP += G̃·Eᵀ (own G̃ of dO·Tv), and
// the histograms Hq (of dS) and Hv (of P) as dS·E_a and P·E_a in registers, turned into table rows after the
// loop. SPHERE: the two angular axes one-hot, and per pair the radial terms of one bin, as in the spherical
// forward: logits += q·Tq[bin] + k·Tk[bin], dP += dO·Tv[bin], dS and P into the own rows' radial histograms.
template <int DP, typename T, bool SPHERE = false>
__global__ void __launch_bounds__(mma::kThreads, kOneHotBwdMinBlocks<DP>) bwd_dq_onehot_kernel(const Args<T> a) {
  using namespace mma;
  using Smem = OneHotDqSmem<DP, T, SPHERE>;
  constexpr int BN = Smem::BN, LD = kLd<DP>, NT = BN / 8, DT = DP / 8, AXES = SPHERE ? kSphereAxes : 3;
  const Heads hs = launch_heads<false>(a);
  if (hs.nh == 0) return;
  extern __shared__ __align__(128) char smem[];
  Bump bump(smem);
  const Smem sm(bump, a);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int L = a.rel.L, shift = a.rel.rel_shift;
  const float sl2 = static_cast<float>(a.scale) * kLog2e;
  const int64_t slot = (int64_t)blockIdx.x * a.L3 * a.H * DP;
  for (int i = blockIdx.x; i < num_items(a, hs); i += gridDim.x) {
    __syncthreads();  // the previous item's overlays are read out
    const WarpItem it(a.bounds, a.N, a.H, hs.item(a.H, i));
    const int h = it.h, r0 = it.r0, nrows = it.n, kbeg = it.lo, kend = it.hi, w0 = it.w0;
    const bool active = it.active;
    const int2 wrange = it.wrange, win0 = it.win0, win1 = it.win1;
    float lse2[2], dl[2];
    row_stats(a, w0, h, lse2, dl);
    uint32_t qf[DP / 16][4], gf[DP / 16][4];
    load_a_rows<DP>(qf, a.q, a.N, a.H, w0, h);
    load_a_rows<DP>(gf, a.dout, a.N, a.H, w0, h);
    int cq[2][3];
    float rq[2];  // SPHERE: the radii of the thread's rows g and g+8
    own_coords(a, w0, cq, SPHERE ? &rq : nullptr);
    TildeA<AXES> qa = {};  // SPHERE: own Q̃ as A fragments
    const int own_r = warp * 16 * sm.rp;  // SPHERE: the warp's rows of qr, gr, hqr, hvr
    const int g = lane >> 2;
    const float* qr_row[2] = {sm.qr + own_r + g * sm.rp, sm.qr + own_r + (g + 8) * sm.rp};
    const float* gr_row[2] = {sm.gr + own_r + g * sm.rp, sm.gr + own_r + (g + 8) * sm.rp};
    float* const h0[2] = {sm.hqr + own_r + g * sm.rp, sm.hvr + own_r + g * sm.rp};  // rows g: dS, P
    float* const h1[2] = {sm.hqr + own_r + (g + 8) * sm.rp, sm.hvr + own_r + (g + 8) * sm.rp};
    stage_own_coords(sm.oc, a, r0, nrows);
    if constexpr (SPHERE) {
      if (a.tq) own_tilde_regs<AXES, DP>(qa, sm.qr, sm.rp, sm.own, sm.own_lo, sm.lp, sm.table, a.tq, a, h, qf, cq);
      for (int x = lane; x < 16 * sm.rp; x += 32) {
        if (a.tq) sm.hqr[own_r + x] = 0.f;
        if (a.tv) sm.hvr[own_r + x] = 0.f;
      }
    } else {
      if (a.tq) own_tilde<true, DP>(sm.qtil, sm.qtil_lo, sm.own, sm.own_lo, sm.lp, sm.table, a.tq, a, h, qf, sm.oc);
    }
    if (a.tv)
      own_tilde<true, DP, AXES>(sm.gtil, sm.gtil_lo, sm.own, sm.own_lo, sm.lp, sm.table, a.tv, a, h, gf, sm.oc,
                                SPHERE ? sm.gr : nullptr, sm.rp);
    __syncthreads();  // the own products' memory becomes the key-side buffers, the table buffer takes Tk
    if (a.tk) {  // waited for with the first key block
      async_rows<DP, LD, kThreads>(sm.table, a.tk, a.H, 0, a.L3, a.L3p, h);
      cp_async_commit();
    }
    const int own = warp * 16 * Smem::TL;
    float dq[DT][4] = {};
    OneHotHistOf<AXES> hq = {}, hv = {};
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
        block_tilde<false, DP, BN, AXES>(sm.ktil, sm.ktil_lo, sm.kt, sm.kt_lo, sm.lp, K, sm.table, kc, a.L3p, L,
                                         shift);
      else
        __syncthreads();  // block_tilde's barriers publish E
      if (!active || c0 >= wrange.y || c0 + BN <= wrange.x) return;
      float s[NT][4] = {}, dp[NT][4] = {}, kb[NT][4] = {};
      int bins[NT][4] = {};  // SPHERE: the pairs' radial bins
      bool live[NT / 2];     // the 16 keys touch the warp's windows (warp-uniform); others stay p = dS = 0
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        live[np] = overlaps16(c0 + 16 * np, wrange);
        if (!live[np]) continue;
        mma_abt_pair<DP, LD>(s, qf, K, np);
        mma_abt_pair<DP, LD>(dp, gf, V, np);
        if constexpr (SPHERE) {
          if (a.tq) tilde_a_times_onehot<AXES>(s, qa, sm.E, np);
        } else {
          if (a.tq) tilde_times_onehot(s, sm.qtil + own, sm.qtil_lo + own, sm.E, np);
        }
        if (a.tv) tilde_times_onehot<AXES>(dp, sm.gtil + own, sm.gtil_lo + own, sm.E, np);
        if (a.tk) onehot_rows_times_tilde<T, NT, AXES>(kb, cq[0], cq[1], sm.ktil, sm.ktil_lo, np);
      }
      const int lo[2] = {win0.x - c0 - 2 * t, win1.x - c0 - 2 * t}, hi[2] = {win0.y - c0 - 2 * t, win1.y - c0 - 2 * t};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (!live[nt / 2]) continue;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = nt * 8 + (e & 1), i = e >> 1;
          float p = 0.f, ds = 0.f;
          if (c >= lo[i] && c < hi[i]) {
            if constexpr (SPHERE) {  // the radial terms
              const int col = c + 2 * t, bin = clamp_rel(radial_bin(rq[i] - kr[col], a.rel), L);
              bins[nt][e] = bin;
              const float qb = a.tq ? qr_row[i][bin] : 0.f, gb = a.tv ? gr_row[i][bin] : 0.f;
              const int at = col * sm.lp + bin * 3 + 2;
              const float kbr = a.tk ? widen(sm.kt[at]) + widen(sm.kt_lo[at]) : 0.f;
              p = fast_exp2((s[nt][e] + qb) * sl2 + (kb[nt][e] + kbr) * kLog2e - lse2[i]);
              ds = p * (dp[nt][e] + gb - dl[i]);
            } else {
              p = fast_exp2(s[nt][e] * sl2 + kb[nt][e] * kLog2e - lse2[i]);
              ds = p * (dp[nt][e] - dl[i]);
            }
          }
          s[nt][e] = p;
          dp[nt][e] = ds;
        }
      }
      if constexpr (SPHERE) {  // the radial histograms (an absent table's values read as 0: nothing is added)
        quad_bin_add_n<2>(h0, h1, bins, [&](int k, int nt, int e) {
          return k == 0 ? (a.tq ? dp[nt][e] : 0.f) : (a.tv ? s[nt][e] : 0.f);
        });
      }
      c_tiles_times<DP, LD>(dq, dp, live, K, [&](const uint32_t (&da)[4], int kk) {
        if (a.tq) onehot_hist_add<AXES>(hq, da, sm.E, kk);
        if (a.tv) {
          uint32_t pa[4];
          c_to_a<T>(pa, s, kk);
          onehot_hist_add<AXES>(hv, pa, sm.E, kk);
        }
      });
    });
    __syncthreads();  // every warp has left the loop: the end's buffers overlay the loop's
    dq_item_end<DP, AXES>(a, it, dq, hq, hv, cq, sm.hist, sm.hlp, sm.Xq, sm.Xg, sm.table, slot,
                          SPHERE ? sm.hqr : nullptr, SPHERE ? sm.hvr : nullptr, sm.rp);
  }
}

// Shared memory of bwd_dq_stored_kernel: 32-key blocks (double-buffered) and their one-hot rows for the loop,
// no table products; the histogram, the own Q and dO tiles and Tq for the item's end.
template <int DP, typename T>
struct StoredDqSmem {
  static constexpr int BN = 32, LD = mma::kLd<DP>, R = mma::kRows;
  int* kc;  // the key blocks' coordinates (2 buffers)
  T *K, *E;
  float* hist;
  T *Xq, *Xg, *table;
  int hlp;
  __host__ __device__ StoredDqSmem(Bump& b, const Args<T>& a) : hlp(a.L3p + 4) {
    kc = b.take<int>(2 * BN * 3);
    K = b.take<T>(2 * BN * LD);
    E = b.take<T>(BN * mma::kOneHotLd);
    hist = b.take<float>(R * hlp);
    Xq = b.take_if<T>(a.tq != nullptr, R * LD);
    Xg = b.take_if<T>(a.tv != nullptr, R * LD);
    table = b.take_if<T>(a.tq != nullptr, a.L3p * LD);
  }
};

template <int DP> constexpr int kStoredDqMinBlocks = DP <= 32 ? 3 : 2;

// dq of 64 query rows of one head of a pass, from the P and dS that bwd_dkv_onehot_kernel<.., true> stored
// (launched after it): dq = scale·(dS·K + Σ_n Hq[n]·Tq[n]) with the histograms Hq = dS·E and Hv = P·E, no
// logits recomputed, so no q or dO fragments and no table products in the loop. The A fragments of P and dS
// come straight from the words (the thread's rows g, g+8 and keys 2t, 2t+1, 2t+8, 2t+9 of each 16), 0 outside
// the rows' windows.
template <int DP, typename T>
__global__ void __launch_bounds__(mma::kThreads, kStoredDqMinBlocks<DP>) bwd_dq_stored_kernel(const Args<T> a) {
  using namespace mma;
  using Smem = StoredDqSmem<DP, T>;
  constexpr int BN = Smem::BN, LD = kLd<DP>, DT = DP / 8;
  const Heads hs = launch_heads<true>(a);
  if (hs.nh == 0) return;
  extern __shared__ __align__(128) char smem[];
  Bump bump(smem);
  const Smem sm(bump, a);
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int64_t slot = (int64_t)blockIdx.x * a.L3 * a.H * DP, m = a.pairs.off[a.N];
  const bool hists = a.tq != nullptr || a.tv != nullptr;
  for (int i = blockIdx.x; i < num_items(a, hs); i += gridDim.x) {
    __syncthreads();  // the previous item's end has read its buffers
    const WarpItem it(a.bounds, a.N, a.H, hs.item(a.H, i));
    const int h = it.h, kbeg = it.lo, kend = it.hi;
    const int2 win[2] = {it.win0, it.win1};
    const uint32_t* words = a.pairs.words + (h - hs.h0) * m;
    int64_t base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int q = it.w0 + g + 8 * r;
      base[r] = q < a.N ? query_row_base(a.pairs.off, q, win[r]) : 0;
    }
    int cq[2][3];
    own_coords(a, it.w0, cq);
    float dq[DT][4] = {};
    OneHotHist hq = {}, hv = {};
    const int nblocks = (kend - kbeg + BN - 1) / BN;
    auto load = [&](int blk) {
      const int c0 = kbeg + blk * BN, n = min(BN, kend - c0), buf = blk & 1;
      async_block<DP, LD, BN, kThreads>(sm.K + buf * BN * LD, a.k, a.H, c0, n, h);
      if (hists) async_coords<BN>(sm.kc + buf * BN * 3, nullptr, a, c0, n);
      cp_async_commit();
    };
    double_buffered(nblocks, load, [&](int blk) {
      const int c0 = kbeg + blk * BN, buf = blk & 1;
      const T* K = sm.K + buf * BN * LD;
      const bool used = it.active && c0 < it.wrange.y && c0 + BN > it.wrange.x;
      // The block's words, issued before the barrier that publishes E so that their latency overlaps it.
      // Register j of k-step kk: row g + 8·(j & 1), keys k, k + 1 with k = c0 + 16kk + 2t + 8·(j >> 1); 0 outside
      // the row's window.
      uint32_t wd[BN / 16][4][2];
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int r = j & 1, k = c0 + 16 * kk + 2 * t + 8 * (j >> 1);
          wd[kk][j][0] = used && k >= win[r].x && k < win[r].y ? words[base[r] + k] : 0u;
          wd[kk][j][1] = used && k + 1 >= win[r].x && k + 1 < win[r].y ? words[base[r] + k + 1] : 0u;
        }
      if (hists) {
        onehot_block<BN>(sm.E, sm.kc + buf * BN * 3);
        __syncthreads();
      }
      if (!used) return;
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        if (!overlaps16(c0 + 16 * kk, it.wrange)) continue;
        uint32_t pa[4], da[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          pa[j] = __byte_perm(wd[kk][j][0], wd[kk][j][1], 0x5410);  // the low halves: P
          da[j] = __byte_perm(wd[kk][j][0], wd[kk][j][1], 0x7632);  // the high halves: dS
        }
        mma_ab<DP, LD>(dq, da, K, kk);
        if (a.tq) onehot_hist_add(hq, da, sm.E, kk);
        if (a.tv) onehot_hist_add(hv, pa, sm.E, kk);
      }
    });
    dq_item_end<DP>(a, it, dq, hq, hv, cq, sm.hist, sm.hlp, sm.Xq, sm.Xg, sm.table, slot);
  }
}

// Shared memory of bwd_dkv_onehot_kernel: 64 key rows, 32-query blocks double-buffered. Before the loop Tk and
// the own rows' products, after it Tk, the histogram and the own K tile overlay the loop's tables and block
// tildes.
template <int DP, typename T>
struct OneHotDkvSmem {
  static constexpr int BQ = 32, LD = mma::kLd<DP>, R = mma::kRows, TL = mma::kOneHotLd;
  int *oc, *qc;                        // own coordinates; the query blocks' (2 buffers)
  T *Q, *G;                            // query blocks of q and dO (2 buffers)
  float *lse, *delta;                  // 2 buffers
  T *ktil, *ktil_lo;                   // own K̃
  T *tq, *tv, *prod, *prod_lo;         // the loop: Tq, Tv, the block's products
  T *qtil, *qtil_lo, *gtil, *gtil_lo;  // the loop: the block's Q̃ and G̃
  T* E;                                // the loop: the query block's one-hot rows
  T *tk, *own, *own_lo;                // before the loop: Tk and the own products
  float* hist;                         // after the loop (with tk): Hk, pitch hlp
  T* Xk;                               // after the loop: the own K tile
  int lp, hlp;
  __host__ __device__ OneHotDkvSmem(Bump& b, const Args<T>& a) : lp(a.L3p + 2), hlp(a.L3p + 4) {
    oc = b.take<int>(R * 3);
    qc = b.take<int>(2 * BQ * 3);
    Q = b.take<T>(2 * BQ * LD);
    G = b.take<T>(2 * BQ * LD);
    lse = b.take<float>(2 * BQ);
    delta = b.take<float>(2 * BQ);
    ktil = b.take_if<T>(a.tk != nullptr, R * TL);
    ktil_lo = b.take_if<T>(a.tk != nullptr, R * TL);
    char* const loop = next_take(b);
    tq = b.take_if<T>(a.tq != nullptr, a.L3p * LD);
    tv = b.take_if<T>(a.tv != nullptr, a.L3p * LD);
    prod = b.take_if<T>(a.tq != nullptr || a.tv != nullptr, BQ * lp);
    prod_lo = b.take_if<T>(a.tq != nullptr || a.tv != nullptr, BQ * lp);
    qtil = b.take_if<T>(a.tq != nullptr, BQ * TL);
    qtil_lo = b.take_if<T>(a.tq != nullptr, BQ * TL);
    gtil = b.take_if<T>(a.tv != nullptr, BQ * TL);
    gtil_lo = b.take_if<T>(a.tv != nullptr, BQ * TL);
    E = b.take<T>(BQ * TL);
    const size_t table_bytes = align128(a.L3p * LD * sizeof(T)), prod_bytes = align128(R * lp * sizeof(T));
    const size_t hist_bytes = align128(R * hlp * sizeof(float)), tile_bytes = align128(R * LD * sizeof(T));
    tk = reinterpret_cast<T*>(loop);
    own = reinterpret_cast<T*>(loop + table_bytes);
    own_lo = reinterpret_cast<T*>(loop + table_bytes + prod_bytes);
    hist = reinterpret_cast<float*>(loop + table_bytes);
    Xk = reinterpret_cast<T*>(loop + table_bytes + hist_bytes);
    if (a.tk) reserve_from(b, loop, table_bytes + (2 * prod_bytes > hist_bytes + tile_bytes ? 2 * prod_bytes
                                                                                            : hist_bytes + tile_bytes));
  }
};

// dk, dv of 64 key rows of one head (16 per warp), as bwd_dkv_mma_kernel, with the table terms as one-hot
// products: logits += E·Q̃ᵀ (Q̃ per query block) + K̃·Eᵀ (own K̃), dP += E·G̃ᵀ (G̃ per query block), and the
// histogram Hk (of dS) as dSᵀ·E_a in registers.
// STORED: the heads of one pass, each pair's P and dS also written to the head's slot of a.pairs, for
// bwd_dq_stored_kernel.
template <int DP, typename T, bool STORED>
__global__ void __launch_bounds__(mma::kThreads, kOneHotBwdMinBlocks<DP>) bwd_dkv_onehot_kernel(const Args<T> a) {
  using namespace mma;
  using Smem = OneHotDkvSmem<DP, T>;
  constexpr int BQ = Smem::BQ, LD = kLd<DP>, NT = BQ / 8, DT = DP / 8, R = kRows;
  const Heads hs = launch_heads<STORED>(a);
  if (hs.nh == 0) return;
  extern __shared__ __align__(128) char smem[];
  Bump bump(smem);
  const Smem sm(bump, a);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int L = a.rel.L, shift = a.rel.rel_shift;
  const float sl2 = static_cast<float>(a.scale) * kLog2e;
  const int64_t m = STORED ? a.pairs.off[a.N] : 0;  // words per head's slot
  for (int i = blockIdx.x; i < num_items(a, hs); i += gridDim.x) {
    __syncthreads();  // the previous item's overlays are read out
    // A query attends to a key exactly when they share a window, so the key's window bounds its queries.
    const WarpItem it(a.bounds, a.N, a.H, hs.item(a.H, i));
    const int h = it.h, c0 = it.r0, nkeys = it.n, qbeg = it.lo, qend = it.hi, w0 = it.w0;
    const bool active = it.active;
    const int2 wrange = it.wrange, win0 = it.win0, win1 = it.win1;
    uint32_t* words = nullptr;
    int64_t wbase[2] = {};  // the thread's key rows g and g+8: key_row_base, and the step n per query
    int wstep[2] = {};
    if constexpr (STORED) {
      words = a.pairs.words + (h - hs.h0) * m;
      const int2 win[2] = {win0, win1};
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int k = w0 + (lane >> 2) + 8 * r;
        wbase[r] = k < a.N ? key_row_base(a.pairs.off, k, win[r]) : 0;
        wstep[r] = win[r].y - win[r].x;
      }
    }
    uint32_t kf[DP / 16][4], vf[DP / 16][4];
    load_a_rows<DP>(kf, a.k, a.N, a.H, w0, h);
    load_a_rows<DP>(vf, a.v, a.N, a.H, w0, h);
    int ck[2][3];
    own_coords(a, w0, ck);
    if (a.tk) {
      stage_own_coords(sm.oc, a, c0, nkeys);
      own_tilde<false, DP>(sm.ktil, sm.ktil_lo, sm.own, sm.own_lo, sm.lp, sm.tk, a.tk, a, h, kf, sm.oc);
    }
    // Tq and Tv take the memory of Tk and the own products; waited for with the first query block.
    if (a.tq) async_rows<DP, LD, kThreads>(sm.tq, a.tq, a.H, 0, a.L3, a.L3p, h);
    if (a.tv) async_rows<DP, LD, kThreads>(sm.tv, a.tv, a.H, 0, a.L3, a.L3p, h);
    cp_async_commit();
    const int own = warp * 16 * Smem::TL;
    float dk[DT][4] = {}, dv[DT][4] = {};
    OneHotHist hk = {};
    const int nblocks = (qend - qbeg + BQ - 1) / BQ;
    auto load = [&](int blk) {
      const int q0 = qbeg + blk * BQ, n = min(BQ, qend - q0), buf = blk & 1;
      async_block<DP, LD, BQ, kThreads>(sm.Q + buf * BQ * LD, a.q, a.H, q0, n, h);
      async_block<DP, LD, BQ, kThreads>(sm.G + buf * BQ * LD, a.dout, a.H, q0, n, h);
      for (int i = threadIdx.x; i < BQ; i += kThreads) {
        const bool ok = i < n;
        const int64_t at = ok ? (int64_t)(q0 + i) * a.H + h : 0;
        cp_async_4(sm.lse + buf * BQ + i, a.lse_in + at, ok);
        cp_async_4(sm.delta + buf * BQ + i, a.delta + at, ok);
      }
      async_coords<BQ>(sm.qc + buf * BQ * 3, nullptr, a, q0, n);
      cp_async_commit();
    };
    double_buffered(nblocks, load, [&](int blk) {
      const int q0 = qbeg + blk * BQ, buf = blk & 1;
      const T* Q = sm.Q + buf * BQ * LD;
      const T* G = sm.G + buf * BQ * LD;
      const float* lse = sm.lse + buf * BQ;
      const float* delta = sm.delta + buf * BQ;
      const int* qc = sm.qc + buf * BQ * 3;
      onehot_block<BQ>(sm.E, qc);
      if (a.tq)
        block_tilde<true, DP, BQ>(sm.qtil, sm.qtil_lo, sm.prod, sm.prod_lo, sm.lp, Q, sm.tq, qc, a.L3p, L, shift);
      if (a.tv)
        block_tilde<true, DP, BQ>(sm.gtil, sm.gtil_lo, sm.prod, sm.prod_lo, sm.lp, G, sm.tv, qc, a.L3p, L, shift);
      if (!a.tq && !a.tv) __syncthreads();  // block_tilde's barriers publish E
      if (!active || q0 >= wrange.y || q0 + BQ <= wrange.x) return;
      float s[NT][4] = {}, dp[NT][4] = {}, kb[NT][4] = {};
      bool live[NT / 2];
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        live[np] = overlaps16(q0 + 16 * np, wrange);
        if (!live[np]) continue;
        mma_abt_pair<DP, LD>(s, kf, Q, np);
        mma_abt_pair<DP, LD>(dp, vf, G, np);
        if (a.tq) onehot_rows_times_tilde<T>(s, ck[0], ck[1], sm.qtil, sm.qtil_lo, np);
        if (a.tv) onehot_rows_times_tilde<T>(dp, ck[0], ck[1], sm.gtil, sm.gtil_lo, np);
        if (a.tk) tilde_times_onehot(kb, sm.ktil + own, sm.ktil_lo + own, sm.E, np);
      }
      const int lo[2] = {win0.x - q0 - 2 * t, win1.x - q0 - 2 * t}, hi[2] = {win0.y - q0 - 2 * t, win1.y - q0 - 2 * t};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (!live[nt / 2]) continue;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = nt * 8 + (e & 1), i = e >> 1;
          float p = 0.f, ds = 0.f;
          if (c >= lo[i] && c < hi[i]) {
            const int col = c + 2 * t;
            p = fast_exp2(s[nt][e] * sl2 + kb[nt][e] * kLog2e - lse[col] * kLog2e);
            ds = p * (dp[nt][e] - delta[col]);
            if constexpr (STORED) words[wbase[i] + (int64_t)(q0 + col) * wstep[i]] = pack2<T>(p, ds);
          }
          s[nt][e] = p;
          dp[nt][e] = ds;
        }
      }
#pragma unroll
      for (int kk = 0; kk < NT / 2; ++kk) {
        if (!live[kk]) continue;
        uint32_t pa[4], da[4];
        c_to_a<T>(pa, s, kk);
        mma_ab<DP, LD>(dv, pa, G, kk);
        c_to_a<T>(da, dp, kk);
        mma_ab<DP, LD>(dk, da, Q, kk);
        if (a.tk) onehot_hist_add(hk, da, sm.E, kk);
      }
    });
    // dk = scale·dSᵀQ + Σ_n Hk[n]·Tk[n] (the key-side table term carries no scale); dTk = Hkᵀ·K.
    const float f = static_cast<float>(a.scale);
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[dt][e] *= f;
    if (a.tk) {
      __syncthreads();  // every warp has left the loop: its tables become Tk, the histogram and the K tile
      async_rows<DP, LD, kThreads>(sm.tk, a.tk, a.H, 0, a.L3, a.L3p, h);
      async_block<DP, LD, R, kThreads>(sm.Xk, a.k, a.H, c0, nkeys, h);
      cp_async_commit();
      const float one[2] = {1.f, 1.f};
      float* hrow = sm.hist + warp * 16 * sm.hlp;
      onehot_hist_store<false>(hrow, sm.hlp, hk, ck, one, L, shift);
      cp_async_wait<0>();
      __syncthreads();
      if (active) add_rows_times_table<DP, LD>(dk, hrow, sm.hlp, sm.tk, a.L3p, 1.f, 1.f);
      table_grad_mma<DP, LD>(a.dtk + (int64_t)blockIdx.x * a.L3 * a.H * DP, sm.hist, sm.hlp, sm.Xk, a.L3, a.L3p,
                             a.H, h, 1.f);
    }
    if (active) {
      store_c_rows<DP>(a.dk, dk, a.N, a.H, w0, h, 1.f, 1.f);
      store_c_rows<DP>(a.dv, dv, a.N, a.H, w0, h, 1.f, 1.f);
    }
  }
}

}  // namespace
}  // namespace sptr
