// Tensor-core building blocks of the fp16/bf16 fused window attention kernels (sm_80+): the fragment moves
// between the primitives of <sptr/mma_primitives.cuh> (fragment layouts described there).
// Two C tiles side by side (16 x 16) hold exactly the A fragment of the next product, which is how the
// probabilities and logit gradients feed the second product without leaving registers.
#pragma once
#include <sptr/mma_primitives.cuh>

#include <cstdint>
#include <type_traits>

namespace sptr {
namespace mma {

// A fragment of keys [16·kk, 16·kk + 16) from the C tiles 2kk and 2kk + 1 of a 16-row product.
template <typename T, int NT>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c)[NT][4], int kk) {
  a[0] = pack2<T>(c[2 * kk][0], c[2 * kk][1]);
  a[1] = pack2<T>(c[2 * kk][2], c[2 * kk][3]);
  a[2] = pack2<T>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = pack2<T>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// A fragments of rows [row0, row0 + 16) of head h of x (N, H, DP), straight from global memory (read once
// per tile); rows at or past N are zero.
template <int DP, typename T>
__device__ __forceinline__ void load_a_rows(uint32_t (&f)[DP / 16][4], const T* x, int N, int H, int row0, int h) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + g + 8 * half;
    const T* base = x + ((int64_t)row * H + h) * DP + 2 * t;
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
      f[kk][half] = row < N ? *reinterpret_cast<const uint32_t*>(base + kk * 16) : 0u;
      f[kk][2 + half] = row < N ? *reinterpret_cast<const uint32_t*>(base + kk * 16 + 8) : 0u;
    }
  }
}

// acc[nt] += A · Bᵀ for the 16-column pair `np` (C tiles 2np, 2np + 1), B rows (keys) in shared memory as
// [row][LD] with the reduction dimension (DP) contiguous.
template <int DP, int LD, typename T, int NT>
__device__ __forceinline__ void mma_abt_pair(float (&acc)[NT][4], const uint32_t (&a)[DP / 16][4], const T* B,
                                             int np) {
  const int lane = threadIdx.x & 31;
  const T* rowp = B + (np * 16 + (lane >> 4) * 8 + (lane & 7)) * LD + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < DP / 16; ++kk) {
    uint32_t b[4];
    ldmatrix_x4(b, rowp + kk * 16);
    mma_16816<T>(acc[2 * np], a[kk], b[0], b[1]);
    mma_16816<T>(acc[2 * np + 1], a[kk], b[2], b[3]);
  }
}

// acc (16 x DP) += A (16 x 16 keys of pair kk) · B (keys x DP), B rows in shared memory as [key][LD].
template <int DP, int LD, typename T>
__device__ __forceinline__ void mma_ab(float (&acc)[DP / 8][4], const uint32_t (&a)[4], const T* B, int kk) {
  const int lane = threadIdx.x & 31;
  const T* rowp = B + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + (lane >> 4) * 8;
#pragma unroll
  for (int dp = 0; dp < DP / 16; ++dp) {
    uint32_t b[4];
    ldmatrix_x4_trans(b, rowp + dp * 16);
    mma_16816<T>(acc[2 * dp], a, b[0], b[1]);
    mma_16816<T>(acc[2 * dp + 1], a, b[2], b[3]);
  }
  if constexpr (DP % 16 != 0) {  // a last 8 columns (the one-hot histograms' 72)
    uint32_t b[2];
    ldmatrix_x2_trans(b, rowp + DP / 16 * 16);
    mma_16816<T>(acc[DP / 8 - 1], a, b[0], b[1]);
  }
}

// o += C·B over a block's 16-row groups that touch the warp's windows (live), C's A operands made from the C
// tiles c (P for P·V, dS for dS·K); each group's operand also goes to also(ca, kk) (the one-hot kernels'
// histograms).
template <int DP, int LD, typename T, int NT, typename Also>
__device__ __forceinline__ void c_tiles_times(float (&o)[DP / 8][4], const float (&c)[NT][4], const bool (&live)[NT / 2],
                                              const T* B, const Also& also) {
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    if (!live[kk]) continue;
    uint32_t ca[4];
    c_to_a<T>(ca, c, kk);
    mma_ab<DP, LD>(o, ca, B, kk);
    also(ca, kk);
  }
}

// 16-byte chunk idx of rows [row0, ...) of head h of x (N, H, DP) into dst[row][LD] by cp.async; rows at or
// past nvalid are zero.
template <int DP, int LD, typename T>
__device__ __forceinline__ void async_chunk(T* dst, const T* x, int H, int row0, int nvalid, int h, int idx) {
  constexpr int CH = DP * sizeof(T) / 16;  // chunks per row
  const int r = idx / CH, c = (idx % CH) * (16 / sizeof(T));
  const bool ok = r < nvalid;
  cp_async_16(dst + r * LD + c, ok ? x + ((int64_t)(row0 + r) * H + h) * DP + c : x, ok);
}

// Rows [row0, row0 + nvalid) of head h of x into dst[rows][LD], zero past nvalid.
template <int DP, int LD, int THREADS, typename T>
__device__ __forceinline__ void async_rows(T* dst, const T* x, int H, int row0, int nvalid, int rows, int h) {
  for (int idx = threadIdx.x; idx < rows * (DP * (int)sizeof(T) / 16); idx += THREADS)
    async_chunk<DP, LD>(dst, x, H, row0, nvalid, h, idx);
}

// The same for ROWS known at compile time (the key and query blocks): an unrolled loop without bounds
// arithmetic when the threads divide the chunks.
template <int DP, int LD, int ROWS, int THREADS, typename T>
__device__ __forceinline__ void async_block(T* dst, const T* x, int H, int row0, int nvalid, int h) {
  constexpr int TOTAL = ROWS * DP * sizeof(T) / 16;
#pragma unroll
  for (int k = 0; k < (TOTAL + THREADS - 1) / THREADS; ++k) {
    const int idx = threadIdx.x + k * THREADS;
    if (TOTAL % THREADS == 0 || idx < TOTAL) async_chunk<DP, LD>(dst, x, H, row0, nvalid, h, idx);
  }
}

// A fragments of 16 rows of a [row][LD] tile in shared memory.
template <int DP, int LD, typename T>
__device__ __forceinline__ void ldmatrix_a_rows(uint32_t (&f)[DP / 16][4], const T* X) {
  const int lane = threadIdx.x & 31;
  const T* p = X + (lane & 15) * LD + (lane >> 4) * 8;
#pragma unroll
  for (int kk = 0; kk < DP / 16; ++kk) ldmatrix_x4(f[kk], p + kk * 16);
}

// The per-token table products X_r · T_n of the 16 rows whose A fragments are `a` and the table rows n in
// [16·np0, 16·np1) of T ([row][LD] in shared memory): store(col, c) gets each C tile c (rows g and g+8,
// columns col and col + 1).
template <int DP, int LD, typename T, typename Store>
__device__ __forceinline__ void each_table_product(const uint32_t (&a)[DP / 16][4], const T* table, int np0, int np1,
                                                   const Store& store) {
  const int t = threadIdx.x & 3;
  for (int np = np0; np < np1; ++np) {
    float c[2][4] = {};
    mma_abt_pair<DP, LD>(c, a, table + np * 16 * LD, 0);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) store(np * 16 + nt * 8 + 2 * t, c[nt]);
  }
}

// dst[r][n] = X_r · T_n (fp32, row pitch lp): each_table_product into shared memory.
template <int DP, int LD, typename T>
__device__ __forceinline__ void table_products(float* dst, int lp, const uint32_t (&a)[DP / 16][4], const T* table,
                                               int np0, int np1) {
  const int g = (threadIdx.x & 31) >> 2;
  each_table_product<DP, LD>(a, table, np0, np1, [&](int col, const float (&c)[4]) {
    *reinterpret_cast<float2*>(dst + g * lp + col) = make_float2(c[0], c[1]);
    *reinterpret_cast<float2*>(dst + (g + 8) * lp + col) = make_float2(c[2], c[3]);
  });
}

// table_products as two 16-bit planes, hi = T(x) in dst and lo = T(x − hi) in dst_lo (row pitch lp elements,
// even), for the one-hot kernel: its products are mma operands beside exact one-hot matrices, and hi + lo keeps
// the logits as close to the fp32 products as the gather kernel and the backward have them.
template <int DP, int LD, typename T>
__device__ __forceinline__ void table_products16(T* dst, T* dst_lo, int lp, const uint32_t (&a)[DP / 16][4],
                                                 const T* table, int np0, int np1) {
  const int g = (threadIdx.x & 31) >> 2;
  each_table_product<DP, LD>(a, table, np0, np1, [&](int col, const float (&c)[4]) {
    *reinterpret_cast<uint32_t*>(dst + g * lp + col) = pack2<T>(c[0], c[1]);
    *reinterpret_cast<uint32_t*>(dst + (g + 8) * lp + col) = pack2<T>(c[2], c[3]);
    *reinterpret_cast<uint32_t*>(dst_lo + g * lp + col) = pack2_residual<T>(c[0], c[1]);
    *reinterpret_cast<uint32_t*>(dst_lo + (g + 8) * lp + col) = pack2_residual<T>(c[2], c[3]);
  });
}

// One-hot coordinates as mma operands. Cell coordinates inside [0, kOneHot) (quantised_coords of a window with
// at most 24 cells a side: SphereFormer's quant_size = window_size / 24) make a pair's table terms products:
// with E[j][24·a + u] = [c_j,a = u], Σ_a q_i·Tq[rel_a(i,j)] = Σ_m Q̃[i][m]·E[j][m] (Q̃[i][24·a + u] =
// q_i·Tq[clamp(c_i,a − u + s)]) and Σ_a k_j·Tk[rel_a(i,j)] = Σ_m E[i][m]·K̃[j][m] (K̃[j][24·a + u] =
// k_j·Tk[clamp(u − c_j,a + s)]); reductions of 72 on the tensor cores instead of gathers per pair, in 5 k-steps
// of 16 whose last 8 columns are zero in E and in X̃ (80 columns per row). One-hot rows of the first AXES axes
// only (the spherical tables' two angular axes): 48 columns, three k-steps, no padding.
constexpr int kOneHot = 24;
constexpr int kOneHotGroups = kOneHot / 8;   // 8-column groups per axis
template <int AXES> constexpr int kOneHotStepsOf = (AXES * kOneHot + 15) / 16;
// 16-bit row pitch of E and X̃: the k-steps' columns and 8 more, so that ldmatrix has no bank conflicts.
template <int AXES> constexpr int kOneHotLdOf = 16 * kOneHotStepsOf<AXES> + 8;
constexpr int kOneHotSteps = kOneHotStepsOf<3>;  // all three axes (the cubic tables)
constexpr int kOneHotLd = kOneHotLdOf<3>;
static_assert(kOneHot % 8 == 0, "the one-hot rows are built in 8-column runs");

template <typename T>
__device__ __forceinline__ constexpr uint32_t one_bits() {
  return std::is_same_v<T, __half> ? 0x3C00u : 0x3F80u;
}
// The pair ([c0 == u], [c1 == u]) as two T, c0 in the low half.
template <typename T>
__device__ __forceinline__ uint32_t onehot2(int c0, int c1, int u) {
  return (c0 == u ? one_bits<T>() : 0u) | (c1 == u ? one_bits<T>() << 16 : 0u);
}
// Axis and first cell of the 8-column group `grp` of a one-hot row (grp < 3·kOneHotGroups; past it: padding).
__device__ __forceinline__ constexpr int onehot_axis(int grp) { return grp / kOneHotGroups; }
__device__ __forceinline__ constexpr int onehot_cell0(int grp) { return grp % kOneHotGroups * 8; }

// A fragment of k-step kk (columns [16·kk, 16·kk + 16) of E) of rows g (coordinates c0) and g+8 (c1): its
// halves are the 8-column groups 2·kk and 2·kk + 1, each of one axis (kk is a constant after unrolling).
template <typename T>
__device__ __forceinline__ void onehot_a(uint32_t (&e)[4], const int (&c0)[3], const int (&c1)[3], int kk) {
  const int t2 = 2 * (threadIdx.x & 3);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int grp = 2 * kk + half;
    if (grp >= 3 * kOneHotGroups) {
      e[2 * half] = e[2 * half + 1] = 0u;
      continue;
    }
    const int col = onehot_axis(grp), u = onehot_cell0(grp) + t2;
    e[2 * half] = onehot2<T>(c0[col], c0[col] - 1, u);
    e[2 * half + 1] = onehot2<T>(c1[col], c1[col] - 1, u);
  }
}

// A fragment of columns [16·kk, 16·kk + 16) of 16 fp32 rows (pitch lp) in shared memory, row g scaled by
// f0 and row g+8 by f1, rounded to T.
template <typename T>
__device__ __forceinline__ void smem_rows_to_a(uint32_t (&a)[4], const float* X, int lp, int kk, float f0, float f1) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const float2 x0 = *reinterpret_cast<const float2*>(X + g * lp + kk * 16 + 2 * t);
  const float2 x1 = *reinterpret_cast<const float2*>(X + (g + 8) * lp + kk * 16 + 2 * t);
  const float2 x2 = *reinterpret_cast<const float2*>(X + g * lp + kk * 16 + 8 + 2 * t);
  const float2 x3 = *reinterpret_cast<const float2*>(X + (g + 8) * lp + kk * 16 + 8 + 2 * t);
  a[0] = pack2<T>(x0.x * f0, x0.y * f0);
  a[1] = pack2<T>(x1.x * f1, x1.y * f1);
  a[2] = pack2<T>(x2.x * f0, x2.y * f0);
  a[3] = pack2<T>(x3.x * f1, x3.y * f1);
}

// Stores rows g and g+8 of a 16 x DP fp32 accumulator (times f) to head h of y (N, H, DP).
template <int DP, typename T>
__device__ __forceinline__ void store_c_rows(T* y, const float (&c)[DP / 8][4], int N, int H, int row0, int h,
                                             float f0, float f1) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + g + 8 * half;
    if (row >= N) continue;
    const float f = half ? f1 : f0;
    T* base = y + ((int64_t)row * H + h) * DP + 2 * t;
#pragma unroll
    for (int dt = 0; dt < DP / 8; ++dt)
      *reinterpret_cast<uint32_t*>(base + dt * 8) = pack2<T>(c[dt][2 * half] * f, c[dt][2 * half + 1] * f);
  }
}

// Max / sum over the four lanes of a quad (the lanes that share a C row).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// 2^x on the special-function unit, denormal results flushed to zero (exp2f adds a range fix-up around the
// same instruction); 2^-inf = 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kWarps = 4, kThreads = kWarps * 32;
constexpr int kRows = kWarps * 16;  // query (or key) rows of a CTA, 16 per warp
// Keys (or queries) per block of the inner loop, and the shared-memory row pitch (16-byte rows spread over
// all banks, so ldmatrix is conflict-free).
template <int DP> constexpr int kBlock = DP <= 64 ? 64 : 32;
template <int DP> constexpr int kLd = DP + 8;

// The products of a block of BN rows (16-row groups of rows_tile, [row][LD] in shared memory) with a staged
// table of L3p rows, split over the warps: warp w takes row group w % RG and a share of the table's 16-row
// pairs; products(f, rg, np0, np1) gets the group's A fragments f and the pairs [np0, np1).
template <int DP, int BN, typename T, typename Products>
__device__ __forceinline__ void split_block_products(const T* rows_tile, int L3p, const Products& products) {
  constexpr int LD = kLd<DP>, RG = BN / 16, PARTS = kWarps / RG;
  const int warp = threadIdx.x >> 5, rg = warp % RG, part = warp / RG, npairs = L3p / 16;
  uint32_t f[DP / 16][4];
  ldmatrix_a_rows<DP, LD>(f, rows_tile + rg * 16 * LD);
  products(f, rg, part * npairs / PARTS, (part + 1) * npairs / PARTS);
}

// dst (BN x lp, fp32) = the block's rows times the staged table of row pitch TLD (split_block_products).
template <int DP, int BN, int TLD = kLd<DP>, typename T>
__device__ void block_products(float* dst, int lp, const T* rows_tile, const T* table, int L3p) {
  split_block_products<DP, BN>(rows_tile, L3p, [&](const uint32_t (&f)[DP / 16][4], int rg, int np0, int np1) {
    table_products<DP, TLD>(dst + rg * 16 * lp, lp, f, table, np0, np1);
  });
}

// acc (16 x DP) += Σ_n X[r][n] · B[n] for the warp's 16 fp32 rows X (pitch lp; row g scaled by f0, g+8 by f1,
// rounded to T) and the first L3p rows of B ([n][LD] in shared memory): a histogram times its table.
template <int DP, int LD, typename T>
__device__ __forceinline__ void add_rows_times_table(float (&acc)[DP / 8][4], const float* X, int lp, const T* B,
                                                     int L3p, float f0, float f1) {
  for (int kk = 0; kk < L3p / 16; ++kk) {
    uint32_t xa[4];
    smem_rows_to_a<T>(xa, X, lp, kk, f0, f1);
    mma_ab<DP, LD>(acc, xa, B, kk);
  }
}

// Walks blocks 0..nblocks-1 of a double-buffered cp.async pipeline: load(b) issues and commits block b into
// buffer b % 2, and block b + 1 is in flight while body(b) runs. Barriers before and after each body.
template <typename Load, typename Body>
__device__ __forceinline__ void double_buffered(int nblocks, const Load& load, const Body& body) {
  if (nblocks > 0) load(0);
  for (int blk = 0; blk < nblocks; ++blk) {
    if (blk + 1 < nblocks) {
      load(blk + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    body(blk);
    __syncthreads();
  }
}

// Window [lo, hi) of token i, or an empty one past the last token.
__device__ __forceinline__ int2 row_bounds(const int2* bounds, int N, int i) {
  return i < N ? bounds[i] : make_int2(0, 0);
}

// Work item `item` of the mma kernels ((64-row tile, head) pairs, heads adjacent) as this warp sees it: the
// tile's rows [r0, r0 + n) and the span [lo, hi) of the other side that their windows cover; the warp's 16
// rows from w0 (none past N: !active), the span of their windows (wrange) and the windows of the thread's
// rows g and g+8 (win0, win1).
struct WarpItem {
  int h, r0, n, lo, hi, w0;
  bool active;
  int2 wrange, win0, win1;
  __device__ __forceinline__ WarpItem(const int2* bounds, int N, int H, int item) {
    const int g = (threadIdx.x & 31) >> 2;
    h = item % H, r0 = (item / H) * kRows;
    n = min(kRows, N - r0);
    lo = bounds[r0].x, hi = bounds[r0 + n - 1].y;
    w0 = r0 + (threadIdx.x >> 5) * 16;
    active = w0 < N;
    wrange = active ? make_int2(bounds[w0].x, bounds[min(w0 + 15, N - 1)].y) : make_int2(0, 0);
    win0 = row_bounds(bounds, N, w0 + g), win1 = row_bounds(bounds, N, w0 + g + 8);
  }
  // The window of all 16 rows of the warp if they share one (key groups inside it need no mask), else empty.
  __device__ __forceinline__ int2 shared_window(const int2* bounds, int N) const {
    return active && w0 + 15 < N && bounds[w0 + 15].x == wrange.x ? wrange : make_int2(0, 0);
  }
};

// The softmax sums of the thread's rows g and g+8 (per-thread partial sums in l) over their quads, and their
// inverses (0 for a row with nothing in its window).
__device__ __forceinline__ void row_inverse(float (&l)[2], float (&inv)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] = quad_sum(l[i]);
    inv[i] = l[i] > 0.f ? 1.f / l[i] : 0.f;
  }
}

// One block of the forward's online softmax: the new row maxima from the block's logits (mx: per-thread
// maxima including the old m, log2 units), the factor alpha by which the rows' earlier sums l and outputs o
// shrink (the caller rescales whatever else it accumulates by it), and s becomes P = 2^(s − max) in the live
// 16-column groups, into l.
template <int DT, int NT>
__device__ __forceinline__ void online_softmax(float (&s)[NT][4], const bool (&live)[NT / 2], float (&mx)[2],
                                               float (&m)[2], float (&l)[2], float (&o)[DT][4], float (&alpha)[2]) {
  float ref[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    mx[i] = quad_max(mx[i]);
    ref[i] = mx[i] == -INFINITY ? 0.f : mx[i];  // a row with nothing valid yet keeps p = 0, no NaN
    alpha[i] = fast_exp2(m[i] - ref[i]);
    m[i] = mx[i];
    l[i] *= alpha[i];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      o[dt][2 * i] *= alpha[i];
      o[dt][2 * i + 1] *= alpha[i];
    }
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    if (!live[nt / 2]) continue;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[nt][e] = fast_exp2(s[nt][e] - ref[e >> 1]);
      l[e >> 1] += s[nt][e];
    }
  }
}

// Whether the 16 columns from c0 touch [range.x, range.y) (warp-uniform: skips products that are all masked).
__device__ __forceinline__ bool overlaps16(int c0, int2 range) { return c0 < range.y && c0 + 16 > range.x; }

// The backward's P and dS of a block, in place: s (Q·Kᵀ) becomes P = 2^(f·s + table terms − lse2), dp
// (dO·Vᵀ) becomes dS = P·(dp + value-table term − delta), where column c0 + (local column) lies in the window
// of the thread's row (rows g: w0, g+8: w1); elsewhere P = dS = 0. stats(col, i) gives (lse2, delta) of the
// pair of local column col and row i; terms(col, i, logit2, dp) adds the pair's table terms and returns its
// packed table rows (into `rows`). 16-column groups that miss the warp's windows (`range`) are skipped: the
// products skip them too.
template <int NT, typename Stats, typename Terms>
__device__ __forceinline__ void backward_probs(float (&s)[NT][4], float (&dp)[NT][4], uint32_t (&rows)[NT][4], int c0,
                                               int2 w0, int2 w1, int2 range, float f, const Stats& stats,
                                               const Terms& terms) {
  const int t = threadIdx.x & 3;
  const int lo[2] = {w0.x - c0 - 2 * t, w1.x - c0 - 2 * t}, hi[2] = {w0.y - c0 - 2 * t, w1.y - c0 - 2 * t};
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    if (!overlaps16(c0 + 16 * (nt / 2), range)) continue;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = nt * 8 + (e & 1), i = e >> 1;
      float p = 0.f, ds = 0.f;
      if (c >= lo[i] && c < hi[i]) {
        const float2 st = stats(c + 2 * t, i);
        float logit2 = s[nt][e] * f, dpv = dp[nt][e];
        rows[nt][e] = terms(c + 2 * t, i, logit2, dpv);
        p = fast_exp2(logit2 - st.x);
        ds = p * (dpv - st.y);
      }
      s[nt][e] = p;
      dp[nt][e] = ds;
    }
  }
}

}  // namespace mma
}  // namespace sptr
