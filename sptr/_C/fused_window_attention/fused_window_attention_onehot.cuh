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
// are worked out once per run, with shifts and constant divisions. A row's runs past the three axes (up to
// kOneHotKP columns) are zero: the last k-step's padding.
constexpr int kOneHotRun = 8;
constexpr int kOneHotRowRuns = mma::kOneHotKP / kOneHotRun;  // runs per row, padding included

// Tilde rows (hi and lo planes, [row][kOneHotLd] 16-bit) of ROWS tokens from their table products (hi and lo
// planes, [row][lp] 16-bit, column n = rel·3 + a) and coordinates ([row][3] in shared memory); all threads of
// the CTA take part, a thread per run and both planes. Along a run the relative index steps by one (down on the
// query side, up on the key side), so a run clamped nowhere (SphereFormer's tables: 2·kOneHot rows) is 8 loads
// per plane at fixed offsets from one address.
template <bool QUERY, int ROWS, typename T>
__device__ void onehot_tilde(T* til, T* til_lo, const T* prod, const T* prod_lo, int lp, const int* coords, int L,
                             int shift) {
  using namespace mma;
  constexpr int step = QUERY ? -3 : 3;  // product columns from cell u to u + 1
  for (int idx = threadIdx.x; idx < ROWS * kOneHotRowRuns; idx += kThreads) {
    const int run = idx % kOneHotRowRuns, j = idx / kOneHotRowRuns;
    uint32_t w[2][kOneHotRun / 2] = {};
    if (run < 3 * kOneHotGroups) {
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
    const int at = j * kOneHotLd + run * kOneHotRun;
    *reinterpret_cast<uint4*>(til + at) = make_uint4(w[0][0], w[0][1], w[0][2], w[0][3]);
    *reinterpret_cast<uint4*>(til_lo + at) = make_uint4(w[1][0], w[1][1], w[1][2], w[1][3]);
  }
}

// Tilde rows of a block of BN tokens (rows_tile: [row][LD] in shared memory, coordinates `coords`) with the
// staged table `table`: their table products into prod/prod_lo (warps split the 16-row groups and the table
// columns), then the tilde rows. Ends with the CTA synchronised.
template <bool QUERY, int DP, int BN, typename T>
__device__ void block_tilde(T* til, T* til_lo, T* prod, T* prod_lo, int lp, const T* rows_tile, const T* table,
                            const int* coords, int L3p, int L, int shift) {
  using namespace mma;
  split_block_products<DP, BN>(rows_tile, L3p, [&](const uint32_t (&f)[DP / 16][4], int rg, int np0, int np1) {
    table_products16<DP, kLd<DP>>(prod + rg * 16 * lp, prod_lo + rg * 16 * lp, lp, f, table, np0, np1);
  });
  __syncthreads();
  onehot_tilde<QUERY, BN>(til, til_lo, prod, prod_lo, lp, coords, L, shift);
  __syncthreads();
}

// acc (16 rows x 16 tokens of group np, C tiles 2np and 2np+1) += A · Ẽᵀ-style products with the tilde rows of
// a block in shared memory: acc[i][j] += Σ_m E_i[m] · X̃_j[m], E from the coordinates of the thread's rows g and
// g+8 (c0, c1), both planes of X̃.
template <typename T, int NT>
__device__ __forceinline__ void onehot_rows_times_tilde(float (&acc)[NT][4], const int (&c0)[3], const int (&c1)[3],
                                                        const T* til, const T* til_lo, int np) {
  using namespace mma;
  const int lane = threadIdx.x & 31;
  const int rowo = (np * 16 + (lane >> 4) * 8 + (lane & 7)) * kOneHotLd + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < kOneHotSteps; ++kk) {
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
// and read by every warp with ldmatrix, instead of compares per mma operand.
template <int ROWS, typename T>
__device__ __forceinline__ void onehot_block(T* E, const int* coords) {
  using namespace mma;
  for (int idx = threadIdx.x; idx < ROWS * kOneHotRowRuns; idx += kThreads) {
    const int run = idx % kOneHotRowRuns, j = idx / kOneHotRowRuns;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (run < 3 * kOneHotGroups) {
      const int c = coords[j * 3 + onehot_axis(run)] - onehot_cell0(run);
      v = make_uint4(onehot2<T>(c, c - 1, 0), onehot2<T>(c, c - 1, 2), onehot2<T>(c, c - 1, 4), onehot2<T>(c, c - 1, 6));
    }
    *reinterpret_cast<uint4*>(E + j * kOneHotLd + run * kOneHotRun) = v;
  }
}

// acc (C tiles 2np, 2np+1) += X̃ · Eᵀ for the warp's 16 own tilde rows (shared memory, from row `own`) and the
// 16 tokens of group np of a block whose one-hot rows are E (onehot_block).
template <typename T, int NT>
__device__ __forceinline__ void tilde_times_onehot(float (&acc)[NT][4], const T* til, const T* til_lo, const T* E,
                                                   int np) {
  using namespace mma;
  const int lane = threadIdx.x & 31;
  const T* arow = til + (lane & 15) * kOneHotLd + (lane >> 4) * 8;
  const T* arow_lo = til_lo + (lane & 15) * kOneHotLd + (lane >> 4) * 8;
  const T* brow = E + (np * 16 + (lane >> 4) * 8 + (lane & 7)) * kOneHotLd + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < kOneHotSteps; ++kk) {
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

// Per-axis one-hot histogram accumulators: G[a·kOneHotGroups + u/8] (C tiles, 16 rows x kOneHot columns u per
// axis a).
using OneHotHist = float[3 * mma::kOneHot / 8][4];

// G_a += X · E_a for the 16 tokens of k-step kk, X its A fragment (16 rows x 16 tokens), E the block's one-hot
// rows (onehot_block): the columns of G are those of E.
template <typename T>
__device__ __forceinline__ void onehot_hist_add(OneHotHist& G, const uint32_t (&x)[4], const T* E, int kk) {
  mma::mma_ab<mma::kOneHotK, mma::kOneHotLd>(G, x, E, kk);
}

// The histogram rows of the thread's rows g and g+8 (hrow: the warp's 16 rows, pitch hlp, fp32) from G times
// f[i] per row: H[i][rel_a(c_i,a, u)·3 + a] = Σ_u G_a[i][u], c the rows' own coordinates. For one row and axis
// the relative index differs for every u, so an unclamped entry owns its bin; the entries clamped to either
// end of the table are summed per lane, then over the quad in lane order (bitwise reproducible).
template <bool QUERY>
__device__ __forceinline__ void onehot_hist_store(float* hrow, int hlp, const OneHotHist& G, const int (&c)[2][3],
                                                  const float (&f)[2], int L, int shift) {
  using namespace mma;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int i = lane; i < 16 * hlp; i += 32) hrow[i] = 0.f;
  __syncwarp();
  float edge[2][3][2] = {};
#pragma unroll
  for (int x = 0; x < 3 * kOneHot / 8; ++x) {
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
    for (int col = 0; col < 3; ++col)
#pragma unroll
      for (int side = 0; side < 2; ++side) {
        float sum = 0.f;
#pragma unroll
        for (int src = 0; src < 4; ++src) sum += __shfl_sync(0xffffffffu, edge[i][col][side], quad + src);
        if (t == 0) hrow[(g + 8 * i) * hlp + (side ? L - 1 : 0) * 3 + col] += sum;
      }
  __syncwarp();
}

// 0 in *flag if a coordinate lies outside [0, kOneHot) (the flag starts at 1).
__global__ void onehot_range_kernel(const int32_t* coords, int64_t n, int* flag) {
  SPTR_GRID_STRIDE(i, n) {
    const int c = coords[i];
    if (c < 0 || c >= mma::kOneHot) *flag = 0;
  }
}

// A device flag, 1 while every coordinate lies inside the one-hot range: the one-hot kernels and the gather
// kernels are both launched and one of them returns at once, with no host sync.
inline at::Tensor onehot_flag(const FusedOperands& o) {
  at::Tensor flag = at::ones({1}, o.coords.options());
  onehot_range_kernel<<<grid_for(o.N * 3, 256), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      o.coords.const_data_ptr<int32_t>(), o.N * 3, flag.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return flag;
}

}  // namespace
}  // namespace sptr
