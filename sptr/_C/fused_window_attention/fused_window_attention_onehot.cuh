// The one-hot table terms shared by the fp16/bf16 forward and backward kernels of the fused window attention
// (cubic tables, cell coordinates inside [0, kOneHot): fused_window_attention_mma.cuh explains the scheme).
// A token's table products x·T[n] become its "tilde" row X̃[32·a + u] = x·T[rel_a(u)·3 + a], whose pairing
// with the one-hot matrix E of the other side's coordinates is an mma. The relative index of axis a is
// c − u + s for the query side (the pair's query has coordinate c, its key u) and u − c + s for the key side.
#pragma once
#include "fused_window_attention_tiles.cuh"

namespace sptr {
namespace {

// Table row of axis coordinate c paired with one-hot column u on the query side (QUERY) or the key side.
template <bool QUERY>
__device__ __forceinline__ int onehot_rel(int c, int u, int shift, int L) {
  return clamp_rel(QUERY ? c - u + shift : u - c + shift, L);
}

// One-hot and tilde rows are written in runs of 8 columns (one 16-byte store): run r of a row is its 8-column
// group r (mma::onehot_axis, mma::onehot_cell0), whose (row, axis) is fixed, so the coordinate and row addresses
// are worked out once per run, with shifts and constant divisions. A row's runs past its AXES axes (up to
// 16·kOneHotStepsOf<AXES> columns) are zero: the last k-step's padding.
constexpr int kOneHotRun = 8;
template <int AXES = 3>
constexpr int kOneHotRowRuns = 16 * mma::kOneHotStepsOf<AXES> / kOneHotRun;  // runs per row, padding included

// Tilde rows (hi and lo planes, [row][kOneHotLd] 16-bit) of ROWS tokens from their table products (hi and lo
// planes, [row][lp] 16-bit, column n = rel·3 + a) and coordinates ([row][3] in shared memory); all threads of
// the CTA take part, a thread per run and both planes. Along a run the relative index steps by one (down on the
// query side, up on the key side), so a run clamped nowhere (SphereFormer's tables: 2·kOneHot rows) is 8 loads
// per plane at fixed offsets from one address.
template <bool QUERY, int ROWS, int AXES = 3, typename T>
__device__ void onehot_tilde(T* til, T* til_lo, const T* prod, const T* prod_lo, int lp, const int* coords, int L,
                             int shift) {
  using namespace mma;
  constexpr int step = QUERY ? -3 : 3;  // product columns from cell u to u + 1
  constexpr int RUNS = kOneHotRowRuns<AXES>;
  for (int idx = threadIdx.x; idx < ROWS * RUNS; idx += kThreads) {
    const int run = idx % RUNS, j = idx / RUNS;
    uint32_t w[2][kOneHotRun / 2] = {};
    if (run < AXES * kOneHotGroups) {
      const int a = onehot_axis(run), u0 = onehot_cell0(run), c = coords[j * 3 + a];
      const int r0 = QUERY ? c - u0 + shift : u0 - c + shift;  // relative index of cell u0, unclamped
      const int r7 = QUERY ? r0 - (kOneHotRun - 1) : r0 + kOneHotRun - 1;
      const bool inside = min(r0, r7) >= 0 && max(r0, r7) < L;
#pragma unroll
      for (int plane = 0; plane < 2; ++plane) {
        const uint16_t* row = reinterpret_cast<const uint16_t*>(plane ? prod_lo : prod) + j * lp + a;
        if (inside) {
          const uint16_t* p = row + r0 * 3;
#pragma unroll
          for (int k = 0; k < kOneHotRun / 2; ++k)
            w[plane][k] = static_cast<uint32_t>(p[2 * k * step]) | static_cast<uint32_t>(p[(2 * k + 1) * step]) << 16;
        } else {
#pragma unroll
          for (int k = 0; k < kOneHotRun / 2; ++k) {
            const uint32_t lo = row[onehot_rel<QUERY>(c, u0 + 2 * k, shift, L) * 3];
            const uint32_t hi = row[onehot_rel<QUERY>(c, u0 + 2 * k + 1, shift, L) * 3];
            w[plane][k] = lo | hi << 16;
          }
        }
      }
    }
    const int at = j * kOneHotLdOf<AXES> + run * kOneHotRun;
    *reinterpret_cast<uint4*>(til + at) = make_uint4(w[0][0], w[0][1], w[0][2], w[0][3]);
    *reinterpret_cast<uint4*>(til_lo + at) = make_uint4(w[1][0], w[1][1], w[1][2], w[1][3]);
  }
}

// Radial products of `rows` rows from their table products (hi and lo planes, pitch lp): radial[r][bin] =
// x_r·T[bin·3 + 2] in fp32 (pitch rp), the spherical tables' radial axis; threads tid, tid + nthreads, ... of
// the caller take part.
template <typename T>
__device__ __forceinline__ void radial_products(float* radial, int rp, const T* prod, const T* prod_lo, int lp,
                                                int rows, int L, int tid, int nthreads) {
  for (int idx = tid; idx < rows * L; idx += nthreads) {
    const int r = idx / L, bin = idx - r * L, at = r * lp + bin * 3 + 2;
    radial[r * rp + bin] = widen(prod[at]) + widen(prod_lo[at]);
  }
}

// Tilde rows of a block of BN tokens (rows_tile: [row][LD] in shared memory, coordinates `coords`) with the
// staged table `table`: their table products into prod/prod_lo (warps split the 16-row groups and the table
// columns), then the tilde rows of the first AXES axes. Ends with the CTA synchronised.
template <bool QUERY, int DP, int BN, int AXES = 3, typename T>
__device__ void block_tilde(T* til, T* til_lo, T* prod, T* prod_lo, int lp, const T* rows_tile, const T* table,
                            const int* coords, int L3p, int L, int shift) {
  using namespace mma;
  split_block_products<DP, BN>(rows_tile, L3p, [&](const uint32_t (&f)[DP / 16][4], int rg, int np0, int np1) {
    table_products16<DP, kLd<DP>>(prod + rg * 16 * lp, prod_lo + rg * 16 * lp, lp, f, table, np0, np1);
  });
  __syncthreads();
  onehot_tilde<QUERY, BN, AXES>(til, til_lo, prod, prod_lo, lp, coords, L, shift);
  __syncthreads();
}

// acc (16 rows x 16 tokens of group np, C tiles 2np and 2np+1) += A · Ẽᵀ-style products with the tilde rows of
// a block in shared memory: acc[i][j] += Σ_m E_i[m] · X̃_j[m], E from the coordinates of the thread's rows g and
// g+8 (c0, c1), both planes of X̃ (rows of the first AXES axes).
template <typename T, int NT, int AXES = 3>
__device__ __forceinline__ void onehot_rows_times_tilde(float (&acc)[NT][4], const int (&c0)[3], const int (&c1)[3],
                                                        const T* til, const T* til_lo, int np) {
  using namespace mma;
  const int lane = threadIdx.x & 31;
  const int rowo = (np * 16 + (lane >> 4) * 8 + (lane & 7)) * kOneHotLdOf<AXES> + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < kOneHotStepsOf<AXES>; ++kk) {
    uint32_t e[4], b[4];
    onehot_a<T>(e, c0, c1, kk);
#pragma unroll
    for (int plane = 0; plane < 2; ++plane) {
      ldmatrix_x4(b, (plane ? til_lo : til) + rowo + kk * 16);
      mma_16816<T>(acc[2 * np], e, b[0], b[1]);
      mma_16816<T>(acc[2 * np + 1], e, b[2], b[3]);
    }
  }
}

// The one-hot rows E[j][32·a + u] = [c_j,a = u] of a block's ROWS tokens (coordinates `coords`, [token][3])
// into E ([token][kOneHotLd] 16-bit), built once per block by all threads of the CTA (the caller synchronises)
// and read by every warp with ldmatrix, instead of compares per mma operand. Axes from AXES on are left zero
// (the spherical tables' radial axis, whose bins are gathered per pair): no table term goes through them.
template <int ROWS, int AXES = 3, typename T>
__device__ __forceinline__ void onehot_block(T* E, const int* coords) {
  using namespace mma;
  constexpr int RUNS = kOneHotRowRuns<AXES>;
  for (int idx = threadIdx.x; idx < ROWS * RUNS; idx += kThreads) {
    const int run = idx % RUNS, j = idx / RUNS;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (run < AXES * kOneHotGroups) {
      const int c = coords[j * 3 + onehot_axis(run)] - onehot_cell0(run);
      v = make_uint4(onehot2<T>(c, c - 1, 0), onehot2<T>(c, c - 1, 2), onehot2<T>(c, c - 1, 4), onehot2<T>(c, c - 1, 6));
    }
    *reinterpret_cast<uint4*>(E + j * kOneHotLdOf<AXES> + run * kOneHotRun) = v;
  }
}

// acc (C tiles 2np, 2np+1) += X̃ · Eᵀ for the warp's 16 own tilde rows (shared memory, from row `own`) and the
// 16 tokens of group np of a block whose one-hot rows are E (onehot_block), both of the first AXES axes.
template <int AXES = 3, typename T, int NT>
__device__ __forceinline__ void tilde_times_onehot(float (&acc)[NT][4], const T* til, const T* til_lo, const T* E,
                                                   int np) {
  using namespace mma;
  constexpr int TL = kOneHotLdOf<AXES>;
  const int lane = threadIdx.x & 31;
  const T* arow = til + (lane & 15) * TL + (lane >> 4) * 8;
  const T* arow_lo = til_lo + (lane & 15) * TL + (lane >> 4) * 8;
  const T* brow = E + (np * 16 + (lane >> 4) * 8 + (lane & 7)) * TL + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < kOneHotStepsOf<AXES>; ++kk) {
    uint32_t hi[4], lo[4], b[4];
    ldmatrix_x4(hi, arow + kk * 16);
    ldmatrix_x4(lo, arow_lo + kk * 16);
    ldmatrix_x4(b, brow + kk * 16);
    mma_16816<T>(acc[2 * np], hi, b[0], b[1]);
    mma_16816<T>(acc[2 * np], lo, b[0], b[1]);
    mma_16816<T>(acc[2 * np + 1], hi, b[2], b[3]);
    mma_16816<T>(acc[2 * np + 1], lo, b[2], b[3]);
  }
}

// The one-hot axes of the spherical tables (SphereFormer's): the two angular ones; axis 2 has radial bins.
constexpr int kSphereAxes = 2;

// The own tilde rows of the thread's rows g and g+8 (query side, the first AXES axes) as A fragments in
// registers, hi and lo planes: til[plane][kk] is k-step kk of X̃ (fwd_onehot_kernel and the spherical kernels
// keep Q̃ and G̃ there instead of in shared memory). prod/prod_lo: the warp's 16 rows of table products.
template <int AXES>
using TildeA = uint32_t[2][mma::kOneHotStepsOf<AXES>][4];

template <int AXES, typename T>
__device__ __forceinline__ void own_tilde_a(TildeA<AXES>& til, const T* prod, const T* prod_lo, int lp,
                                            const int (&c)[2][3], int L, int shift) {
  using namespace mma;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int plane = 0; plane < 2; ++plane) {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(plane ? prod_lo : prod);
#pragma unroll
    for (int kk = 0; kk < kOneHotStepsOf<AXES>; ++kk) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {  // register r: row g + 8·(r & 1), 8-column group 2·kk + r / 2
        const int i = r & 1, grp = 2 * kk + (r >> 1);
        if (grp >= AXES * kOneHotGroups) {  // the last k-step's padding
          til[plane][kk][r] = 0u;
          continue;
        }
        const int col = onehot_axis(grp), u = onehot_cell0(grp) + 2 * t;
        const uint16_t* row = bits + (g + 8 * i) * lp + col;
        const uint32_t lo = row[onehot_rel<true>(c[i][col], u, shift, L) * 3];
        const uint32_t hi = row[onehot_rel<true>(c[i][col], u + 1, shift, L) * 3];
        til[plane][kk][r] = lo | hi << 16;
      }
    }
  }
}

// Table x of head h staged into `table`, the warp's 16 own rows (A fragments f) times it into the product
// planes prod/prod_lo ([64 rows][lp], the warp's rows from warp·16), their tilde rows into `til` and, with
// `radial` (the spherical tables), their radial products x·T[bin·3 + 2] (hi + lo, fp32) into radial rows of
// pitch rp. Ends with the CTA synchronised, so that the table buffer and the planes can be reused.
template <int AXES, int DP, typename T>
__device__ void own_tilde_regs(TildeA<AXES>& til, float* radial, int rp, T* prod, T* prod_lo, int lp, T* table,
                               const T* x, const Args<T>& a, int h, const uint32_t (&f)[DP / 16][4],
                               const int (&c)[2][3]) {
  using namespace mma;
  constexpr int LD = kLd<DP>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, L = a.rel.L;
  async_rows<DP, LD, kThreads>(table, x, a.H, 0, a.L3, a.L3p, h);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  const int own = warp * 16 * lp;
  table_products16<DP, LD>(prod + own, prod_lo + own, lp, f, table, 0, a.L3p / 16);
  __syncwarp();
  if (radial != nullptr) radial_products(radial + warp * 16 * rp, rp, prod + own, prod_lo + own, lp, 16, L, lane, 32);
  own_tilde_a<AXES>(til, prod + own, prod_lo + own, lp, c, L, a.rel.rel_shift);
  __syncthreads();
}

// acc (C tiles 2np, 2np+1) += X̃ · Eᵀ for own tilde rows in registers (own_tilde_a) and the 16 tokens of group
// np of a block whose one-hot rows are E (onehot_block<.., AXES>).
template <int AXES, typename T, int NT>
__device__ __forceinline__ void tilde_a_times_onehot(float (&acc)[NT][4], const TildeA<AXES>& til, const T* E,
                                                     int np) {
  using namespace mma;
  const int lane = threadIdx.x & 31;
  const T* brow = E + (np * 16 + (lane >> 4) * 8 + (lane & 7)) * kOneHotLdOf<AXES> + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < kOneHotStepsOf<AXES>; ++kk) {
    uint32_t b[4];
    ldmatrix_x4(b, brow + kk * 16);
    mma_16816<T>(acc[2 * np], til[0][kk], b[0], b[1]);
    mma_16816<T>(acc[2 * np], til[1][kk], b[0], b[1]);
    mma_16816<T>(acc[2 * np + 1], til[0][kk], b[2], b[3]);
    mma_16816<T>(acc[2 * np + 1], til[1][kk], b[2], b[3]);
  }
}

// Per-axis one-hot histogram accumulators of the first AXES axes: G[a·kOneHotGroups + u/8] (C tiles, 16 rows x
// kOneHot columns u per axis a).
template <int AXES>
using OneHotHistOf = float[AXES * mma::kOneHot / 8][4];
using OneHotHist = OneHotHistOf<3>;

// G_a += X · E_a for the 16 tokens of k-step kk, X its A fragment (16 rows x 16 tokens), E the block's one-hot
// rows (onehot_block): the columns of G are those of E.
template <int AXES = 3, typename T>
__device__ __forceinline__ void onehot_hist_add(OneHotHistOf<AXES>& G, const uint32_t (&x)[4], const T* E, int kk) {
  mma::mma_ab<AXES * mma::kOneHot, mma::kOneHotLdOf<AXES>>(G, x, E, kk);
}

// The histogram rows of the thread's rows g and g+8 (hrow: the warp's 16 rows, pitch hlp, fp32) from G times
// f[i] per row: H[i][rel_a(c_i,a, u)·3 + a] = Σ_u G_a[i][u], c the rows' own coordinates. For one row and axis
// the relative index differs for every u, so an unclamped entry owns its bin; the entries clamped to either
// end of the table are summed per lane, then over the quad in lane order (bitwise reproducible). With AXES < 3
// the later axes' columns are left zero.
template <bool QUERY, int AXES = 3>
__device__ __forceinline__ void onehot_hist_store(float* hrow, int hlp, const OneHotHistOf<AXES>& G,
                                                  const int (&c)[2][3], const float (&f)[2], int L, int shift) {
  using namespace mma;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int i = lane; i < 16 * hlp; i += 32) hrow[i] = 0.f;
  __syncwarp();
  float edge[2][AXES][2] = {};
#pragma unroll
  for (int x = 0; x < AXES * kOneHot / 8; ++x) {
    const int col = x / (kOneHot / 8);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = e >> 1, u = (x % (kOneHot / 8)) * 8 + 2 * t + (e & 1);
      const int rel = QUERY ? c[i][col] - u + shift : u - c[i][col] + shift;
      const float val = G[x][e] * f[i];
      if (rel <= 0) edge[i][col][0] += val;
      else if (rel >= L - 1) edge[i][col][1] += val;
      else hrow[(g + 8 * i) * hlp + rel * 3 + col] = val;
    }
  }
  const int quad = lane & ~3;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int col = 0; col < AXES; ++col)
#pragma unroll
      for (int side = 0; side < 2; ++side) {
        float sum = 0.f;
#pragma unroll
        for (int src = 0; src < 4; ++src) sum += __shfl_sync(0xffffffffu, edge[i][col][side], quad + src);
        if (t == 0) hrow[(g + 8 * i) * hlp + (side ? L - 1 : 0) * 3 + col] += sum;
      }
  __syncwarp();
}

// The radial column (axis 2) of the histogram rows of the thread's rows g and g+8 (hrow: the warp's 16 rows,
// pitch hlp) from their radial histogram rows times f[i] (rad: the warp's 16 rows, pitch rp); the quad's lanes
// split the bins.
__device__ __forceinline__ void radial_column(float* hrow, int hlp, const float* rad, int rp, int L,
                                              const float (&f)[2]) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
  for (int i = 0; i < 2; ++i)
    for (int bin = t; bin < L; bin += 4) hrow[(g + 8 * i) * hlp + bin * 3 + 2] = rad[(g + 8 * i) * rp + bin] * f[i];
}

// 0 in *flag if a coordinate of the first `axes` axes lies outside [0, kOneHot) (the flag starts at 1).
__global__ void onehot_range_kernel(const int32_t* coords, int64_t n, int axes, int* flag) {
  SPTR_GRID_STRIDE(i, n) {
    const int c = coords[i];
    if (i % 3 < axes && (c < 0 || c >= mma::kOneHot)) *flag = 0;
  }
}

// A device flag, 1 while every coordinate of the one-hot axes (all three, or the two angular ones of tables
// with radial bins) lies inside the one-hot range: the one-hot kernels and the gather kernels are both launched
// and one of them returns at once, with no host sync.
inline at::Tensor onehot_flag(const FusedOperands& o) {
  at::Tensor flag = at::ones({1}, o.coords.options());
  onehot_range_kernel<<<grid_for(o.N * 3, 256), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      o.coords.const_data_ptr<int32_t>(), o.N * 3, o.radius.defined() ? 2 : 3, flag.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return flag;
}

}  // namespace
}  // namespace sptr
