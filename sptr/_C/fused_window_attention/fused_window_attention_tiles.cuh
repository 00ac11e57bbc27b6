// Device building blocks of the fused window attention kernels (tiles, loads, per-warp products, the pair
// math) and their host-side launch helpers, shared by the forward and backward translation units.
//
// A CTA takes a tile of kBM tokens of one head (tiles may straddle windows) and walks the key blocks of
// the windows its rows belong to, masking pairs across windows. Products go through per-warp 16x16 tiles
// in shared memory: tensor cores (wmma, fp32 accumulation) for fp16/bf16 and, as 3xTF32, for fp32; FMAs for fp64.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <sptr/checks.h>
#include <sptr/cuda_utils.cuh>

#include <limits>
#include <type_traits>

#include "fused_window_attention_host.h"
#include "fused_window_attention_mma.cuh"

namespace sptr {
namespace {  // each translation unit keeps its own copy of these kernels and helpers


constexpr int kBM = 32;  // tokens per tile and keys per block
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kLDS = kBM + 4;  // leading dims (elements) of the kBM x kBM score tiles: float / 16-bit
constexpr int kLDP = kBM + 8;

// The threads that share a piece of a tile kernel's work: the whole CTA, or one of the groups of kThreads
// threads of the two-group backward kernels. `tid` is the thread's index in the team; teams are whole warps,
// so warp-level code (tiles, shuffles) is the same in every team.
template <int kSize>
struct Team {
  static constexpr int kWarpCount = kSize / 32;
  int index;
  int barrier;  // 0: the CTA's barrier; else a named barrier of this team's threads alone
  // The thread's index in the team; the range told to the compiler, which it cannot see through a struct field
  // (signed index arithmetic would cost divisions' fix-ups).
  __device__ int tid() const {
    __builtin_assume(index >= 0 && index < kSize);
    return index;
  }
  __device__ int warp() const { return tid() >> 5; }
  // One barrier instruction for every team: barrier 0 with the CTA's thread count (whole_cta's kSize is the
  // block size) is __syncthreads(). A branch on `barrier` made the compiler emit both forms, predicated.
  __device__ void sync() const { asm volatile("bar.sync %0, %1;" ::"r"(barrier), "n"(kSize) : "memory"); }
};
// The team of every thread of a CTA of `kSize` threads.
template <int kSize = kThreads>
__device__ __forceinline__ Team<kSize> whole_cta() { return {static_cast<int>(threadIdx.x), 0}; }

template <typename T> struct CudaType { using type = T; };
template <> struct CudaType<at::Half> { using type = __half; };
template <> struct CudaType<at::BFloat16> { using type = __nv_bfloat16; };
template <typename T> using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;
template <typename T> constexpr bool kTensorCores = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

__device__ __forceinline__ float widen(__half x) { return __half2float(x); }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ double widen(double x) { return x; }
template <typename T, typename A> __device__ __forceinline__ T narrow(A x) {
  if constexpr (std::is_same_v<T, __half>) return __float2half_rn(x);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(x);
  else return static_cast<T>(x);
}
template <typename T, typename A> __device__ __forceinline__ A exp_acc(A x) {
  if constexpr (kTensorCores<T>) return __expf(x);
  else return exp(x);
}

// Per-warp 16x16 accumulator tile: C += A(16 x K) · B(K x 16) from shared memory, A stored transposed
// (column-major) if AT, B if BT.
template <typename T>
struct WmmaTile {
  nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> c;
  __device__ void zero() { nvcuda::wmma::fill_fragment(c, 0.f); }
  template <bool AT, bool BT>
  __device__ void mma(const T* A, int lda, const T* B, int ldb, int K) {
    using namespace nvcuda::wmma;
    fragment<matrix_a, 16, 16, 16, T, std::conditional_t<AT, col_major, row_major>> a;
    fragment<matrix_b, 16, 16, 16, T, std::conditional_t<BT, col_major, row_major>> b;
    for (int k0 = 0; k0 < K; k0 += 16) {
      load_matrix_sync(a, AT ? A + k0 * lda : A + k0, lda);
      load_matrix_sync(b, BT ? B + k0 : B + k0 * ldb, ldb);
      mma_sync(c, a, b, c);
    }
  }
  __device__ void store(float* C, int ldc) const { nvcuda::wmma::store_matrix_sync(C, c, ldc, nvcuda::wmma::mem_row_major); }
};

template <typename T>
struct SimtTile {  // lane owns row lane/2, columns (lane%2)·8 + [0, 8)
  T v[8];
  __device__ void zero() {
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = T(0);
  }
  template <bool AT, bool BT>
  __device__ void mma(const T* A, int lda, const T* B, int ldb, int K) {
    const int lane = threadIdx.x & 31, r = lane >> 1, c0 = (lane & 1) * 8;
    for (int k = 0; k < K; ++k) {
      const T a = AT ? A[k * lda + r] : A[r * lda + k];
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] += a * (BT ? B[(c0 + e) * ldb + k] : B[k * ldb + c0 + e]);
    }
  }
  __device__ void store(T* C, int ldc) const {
    const int lane = threadIdx.x & 31, r = lane >> 1, c0 = (lane & 1) * 8;
#pragma unroll
    for (int e = 0; e < 8; ++e) C[r * ldc + c0 + e] = v[e];
  }
};

// fp32 tiles on the tensor cores with three TF32 products (3xTF32): each operand x = hi + lo with hi = tf32(x)
// and lo = tf32(x − hi), and C += lo·hi + hi·lo + hi·hi. The dropped lo·lo and the rounding of lo are ~2^-22 of
// a product, so the result keeps about fp32's accuracy; the FMA tile (SimtTile) took 4-6x the fp16 time.
struct Tf32Tile {
  float c[2][4] = {};  // mma C fragments of columns [0, 8) and [8, 16): rows g, g + 8, columns 2t, 2t + 1
  __device__ void zero() {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[j][e] = 0.f;
  }
  // hi = x rounded to TF32's 10 mantissa bits (half an ulp added to the bits, then the low 13 cleared: round to
  // nearest, ties away, as cvt.rna, which sm_90 emulates in ~6 instructions), lo = (x − hi) rounded the same way.
  __device__ static uint32_t round_tf32(uint32_t bits) { return (bits + 0x1000u) & 0xffffe000u; }
  __device__ static void split(float x, uint32_t& hi, uint32_t& lo) {
    hi = round_tf32(__float_as_uint(x));
    lo = round_tf32(__float_as_uint(x - __uint_as_float(hi)));
  }
  // Where A and Bᵀ are both row-major in k (AT false, BT true: gemm_nt), a lane's two k of an mma operand (its
  // slots t and t + 4) are taken as k0 + 2t and k0 + 2t + 1, adjacent in memory: one 64-bit load instead of two
  // 32-bit ones, and no bank conflicts at the feature tiles' pitch (DP + 8). The same permutation of k on both
  // operands leaves the product unchanged up to the order of the tensor core's sum.
  // A's fragments (hi and lo) of the k-step at k0.
  __device__ static void load_a_rows(const float* A, int lda, int k0, uint32_t (&a)[4], uint32_t (&a_lo)[4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float2 x0 = *reinterpret_cast<const float2*>(A + g * lda + k0 + 2 * t);
    const float2 x1 = *reinterpret_cast<const float2*>(A + (g + 8) * lda + k0 + 2 * t);
    split(x0.x, a[0], a_lo[0]);
    split(x1.x, a[1], a_lo[1]);
    split(x0.y, a[2], a_lo[2]);
    split(x1.y, a[3], a_lo[3]);
  }
  // C += A · Bᵀ over the k-step at k0, A's fragments given, B (16 x K) row-major in k.
  __device__ void mma_rows_step(const uint32_t (&a)[4], const uint32_t (&a_lo)[4], const float* B, int ldb, int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float2 y = *reinterpret_cast<const float2*>(B + (8 * j + g) * ldb + k0 + 2 * t);
      uint32_t b0, b0_lo, b1, b1_lo;
      split(y.x, b0, b0_lo);
      split(y.y, b1, b1_lo);
      mma::mma_1688_tf32(c[j], a_lo, b0, b1);
      mma::mma_1688_tf32(c[j], a, b0_lo, b1_lo);
      mma::mma_1688_tf32(c[j], a, b0, b1);
    }
  }
  template <bool AT, bool BT>
  __device__ void mma(const float* A, int lda, const float* B, int ldb, int K) {
    if constexpr (!AT && BT) {
      for (int k0 = 0; k0 < K; k0 += 8) {
        uint32_t a[4], a_lo[4];
        load_a_rows(A, lda, k0, a, a_lo);
        mma_rows_step(a, a_lo, B, ldb, k0);
      }
      return;
    }
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const auto a_at = [&](int r, int k) { return AT ? A[k * lda + r] : A[r * lda + k]; };
    const auto b_at = [&](int k, int n) { return BT ? B[n * ldb + k] : B[k * ldb + n]; };
    for (int k0 = 0; k0 < K; k0 += 8) {
      uint32_t a[4], a_lo[4];
      split(a_at(g, k0 + t), a[0], a_lo[0]);
      split(a_at(g + 8, k0 + t), a[1], a_lo[1]);
      split(a_at(g, k0 + t + 4), a[2], a_lo[2]);
      split(a_at(g + 8, k0 + t + 4), a[3], a_lo[3]);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t b0, b0_lo, b1, b1_lo;
        split(b_at(k0 + t, 8 * j + g), b0, b0_lo);
        split(b_at(k0 + t + 4, 8 * j + g), b1, b1_lo);
        mma::mma_1688_tf32(c[j], a_lo, b0, b1);
        mma::mma_1688_tf32(c[j], a, b0_lo, b1_lo);
        mma::mma_1688_tf32(c[j], a, b0, b1);
      }
    }
  }
  __device__ void store(float* C, int ldc) const {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int i = 0; i < 2; ++i)
        *reinterpret_cast<float2*>(C + (g + 8 * i) * ldc + 8 * j + 2 * t) = make_float2(c[j][2 * i], c[j][2 * i + 1]);
  }
  // f(row, column, value) for the lane's elements of the tile.
  template <typename F>
  __device__ void for_each(const F& f) const {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(g + 8 * (e >> 1), 8 * j + 2 * t + (e & 1), c[j][e]);
  }
  __device__ void scale(float f) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[j][e] *= f;
  }
  // Row i of the tile times f[i].
  __device__ void scale_rows(const float* f) {
    const int g = (threadIdx.x & 31) >> 2;
    const float f0 = f[g], f1 = f[g + 8];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[j][e] *= e < 2 ? f0 : f1;
  }
};

// Per-warp 16x16 tile of the tile kernels: wmma for fp16/bf16, 3xTF32 for fp32, FMAs for fp64.
template <typename T>
using Tile = std::conditional_t<kTensorCores<T>, WmmaTile<T>,
                                std::conditional_t<std::is_same_v<T, float>, Tf32Tile, SimtTile<T>>>;

// The fp16/bf16 backward's stored probabilities and logit gradients (bwd_onehot: the dk/dv kernel writes them,
// a light dq kernel reads them instead of recomputing both). A pair (q, k) of the window of n tokens from s is
// the 32-bit word off[s] + (q − s)·n + (k − s) of its head's slot (M = off[N] words): P in the low half, dS in
// the high one, rounded to T as the mma operands that use them. Null `off` without them.
struct PairStore {
  uint32_t* words;     // heads_per_pass slots of M words
  const int64_t* off;  // [N + 1]: exclusive prefix of the tokens' window sizes
  int64_t capacity;    // words
  int pass;            // heads [pass·g, pass·g + g) of this launch, g = min(H, capacity / M)
};

template <typename T>
struct Args {
  using A = acc_t<T>;
  const T *q, *k, *v, *tq, *tk, *tv, *dout, *out;
  T *o, *dq, *dk, *dv;
  A *lse, *delta, *dtq, *dtk, *dtv;
  const A* lse_in;
  const int2* bounds;  // [lo, hi) of each token's window
  // Device flag of the cubic-table forward: 1 while every coordinate lies inside the one-hot range (then
  // fwd_onehot_kernel does the work and the gather kernel returns at once), 0 otherwise; null without it.
  const int* onehot;
  int* tile_counter;   // per head, for dynamic tile scheduling
  int N, H, d, L3, L3p;
  A scale;
  bool vec;      // rows are 16-byte aligned with d == DP: vector loads
  bool dynamic;  // backward: tiles handed out by an atomic counter (else a fixed round-robin)
  RelPosParams rel;
  PairStore pairs;
  __host__ __device__ bool has_rel() const { return rel.coords != nullptr; }
};

__host__ __device__ constexpr size_t align128(size_t x) { return (x + 127) & ~size_t(127); }

// Bump allocation of the dynamic shared memory; run on the host with a null base to size it. On the device
// every pointer it returns is the shared-memory base plus an offset, never null: so the compiler knows them
// all for shared memory and uses shared loads and stores (a null or an integer-made pointer would make every
// access through it a generic one, with 64-bit address arithmetic).
struct Bump {
  char* base;
  size_t off = 0;
  __host__ __device__ explicit Bump(void* b) : base(static_cast<char*>(b)) {}
  // The address `o` bytes from the base (on the host, where the base is null, only an offset to size with).
  __host__ __device__ char* at(size_t o) const {
#ifdef __CUDA_ARCH__
    return base + o;
#else
    return reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(base) + o);
#endif
  }
  template <typename U>
  __host__ __device__ U* take(size_t n) {
    off = (off + 127) & ~size_t(127);
    U* p = reinterpret_cast<U*>(at(off));
    off += n * sizeof(U);
    return p;
  }
  // A buffer of n elements if cond, else of none (a valid pointer that is never read).
  template <typename U>
  __host__ __device__ U* take_if(bool cond, size_t n) { return take<U>(cond ? n : 0); }
};

// At least `need` bytes of `b` from `start` on: a buffer that overlays the ones taken since `start`.
__host__ __device__ inline void reserve_from(Bump& b, const char* start, size_t need) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(b.at(b.off)), from = reinterpret_cast<uintptr_t>(start);
  const size_t used = end > from ? end - from : 0;
  if (need > used) b.take<char>(need - used);
}
// The 128-byte aligned address the next take of `b` returns.
__host__ __device__ inline char* next_take(const Bump& b) { return b.at(align128(b.off)); }

// Coordinates of the thread's own rows g and g+8 from w0 (0 past N) and, with `radius`, their radii.
template <typename T>
__device__ __forceinline__ void own_coords(const Args<T>& a, int w0, int (&c)[2][3], float (*radius)[2] = nullptr) {
  const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = w0 + g + 8 * i;
    for (int k = 0; k < 3; ++k) c[i][k] = row < a.N ? a.rel.coords[(int64_t)row * 3 + k] : 0;
    if (radius) (*radius)[i] = (a.rel.radius && row < a.N) ? a.rel.radius[row] : 0.f;
  }
}

// cp.async of the coordinates of block rows [r0, r0 + n) into `coords` ([BN][3]) and, when the tables have
// radial bins, their radii into `radius` ([BN]); rows past n are zero-filled.
template <int BN, typename T>
__device__ __forceinline__ void async_coords(int* coords, float* radius, const Args<T>& a, int r0, int n) {
  for (int i = threadIdx.x; i < BN; i += mma::kThreads) {
    const bool ok = i < n;
    const int j = ok ? r0 + i : 0;
    for (int c = 0; c < 3; ++c) mma::cp_async_4(coords + i * 3 + c, a.rel.coords + (int64_t)j * 3 + c, ok);
    if (a.rel.radius) mma::cp_async_4(radius + i, a.rel.radius + j, ok);
  }
}

// cp.async of key block `blk` of the span [kbeg, kend) (BN keys from kbeg + blk·BN, zero past kend) into buffer
// blk % 2 of K and V ([BN][kLd<DP>] each) and, with `coords`, their coordinates (and radii into `radius` when
// the tables have radial bins); one commit group.
template <int DP, int BN, typename T>
__device__ __forceinline__ void load_key_block(T* K, T* V, int* coords, float* radius, const Args<T>& a, int kbeg,
                                               int kend, int blk, int h) {
  constexpr int LD = mma::kLd<DP>;
  const int c0 = kbeg + blk * BN, n = min(BN, kend - c0), buf = blk & 1;
  mma::async_block<DP, LD, BN, mma::kThreads>(K + buf * BN * LD, a.k, a.H, c0, n, h);
  mma::async_block<DP, LD, BN, mma::kThreads>(V + buf * BN * LD, a.v, a.H, c0, n, h);
  if (coords != nullptr) async_coords<BN>(coords + buf * BN * 3, radius ? radius + buf * BN : nullptr, a, c0, n);
  mma::cp_async_commit();
}

// The backward's row statistics of the thread's rows g and g+8 from w0 of head h: the saved log-sum-exp in
// log2 units and delta = dO·O (0 past N).
template <typename T>
__device__ __forceinline__ void row_stats(const Args<T>& a, int w0, int h, float (&lse2)[2], float (&delta)[2]) {
  const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = w0 + g + 8 * i;
    lse2[i] = row < a.N ? a.lse_in[(int64_t)row * a.H + h] * mma::kLog2e : 0.f;
    delta[i] = row < a.N ? a.delta[(int64_t)row * a.H + h] : 0.f;
  }
}

// The forward's end for the warp's 16 rows from w0 of head h: out = o · inv per row, and the rows'
// log-sum-exp (m in log2 units, l the row sums; 0 for a row with nothing in its window).
template <int DP, typename T>
__device__ __forceinline__ void store_out_and_lse(const Args<T>& a, const float (&o)[DP / 8][4], int w0, int h,
                                                  const float (&inv)[2], const float (&m)[2], const float (&l)[2]) {
  mma::store_c_rows<DP>(a.o, o, a.N, a.H, w0, h, inv[0], inv[1]);
  if ((threadIdx.x & 3) != 0) return;
  const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = w0 + g + 8 * i;
    if (row < a.N) a.lse[(int64_t)row * a.H + h] = l[i] > 0.f ? (m[i] + log2f(l[i])) * mma::kLn2 : 0.f;
  }
}

// Shared memory of one side (queries or keys) of a tile: window bounds, coordinates, radii.
struct TokenInfo {
  int *lo, *hi, *coords;
  float* radius;
  template <typename T>
  __host__ __device__ TokenInfo(Bump& b, const Args<T>& a)
      : lo(b.take<int>(kBM)), hi(b.take<int>(kBM)), coords(b.take_if<int>(a.has_rel(), kBM * 3)),
        radius(b.take_if<float>(a.rel.radius != nullptr, kBM)) {}
};

__host__ __device__ constexpr int imax(int x, int y) { return x > y ? x : y; }

template <int DP> constexpr int kLDT = DP + 8;  // leading dim of 16-bit / fp32 feature tiles
template <int DP> constexpr int kLDO = DP + 4;  // leading dim of the accumulator staging tile

// ------------------------------------------------------------------------------------------ tile helpers
__device__ __forceinline__ int2 window_of(const int32_t* offsets, int W, int i) {
  int lo = 0, hi = W - 1;  // largest w with offsets[w] <= i
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (offsets[mid] <= i) lo = mid;
    else hi = mid - 1;
  }
  return make_int2(offsets[lo], offsets[lo + 1]);
}

// Window bounds, coordinates and radii of tokens [t0, t0 + n) (tokens past n: empty windows).
// Window of every token, clamped so that lo <= i < hi <= N whatever the offsets hold (memory safety without
// the Python-side value checks).
__global__ void token_bounds_kernel(const int32_t* offsets, int W, int N, int2* out) {
  SPTR_GRID_STRIDE(i, N) {
    const int2 b = window_of(offsets, W, static_cast<int>(i));
    out[i] = make_int2(min(max(b.x, 0), (int)i), min(max(b.y, (int)i + 1), N));
  }
}

// Coordinates and radii of tokens [t0, t0 + n), and their window bounds if `bounds` (tokens past n: empty).
template <int kTeam, typename T>
__device__ void load_token_info(Team<kTeam> team, const TokenInfo& s, const Args<T>& a, int t0, int n,
                                bool bounds) {
  for (int t = team.tid(); t < kBM; t += kTeam) {
    if (bounds) {
      const int2 b = t < n ? a.bounds[t0 + t] : make_int2(0, 0);
      s.lo[t] = b.x;
      s.hi[t] = b.y;
    }
    if (a.has_rel())
      for (int c = 0; c < 3; ++c) s.coords[t * 3 + c] = t < n ? a.rel.coords[(int64_t)(t0 + t) * 3 + c] : 0;
    if (a.rel.radius) s.radius[t] = t < n ? a.rel.radius[t0 + t] : 0.f;
  }
}

// rows x DP tile from global rows row_ptr(r), r < nvalid, into dst[rows][LDT], zero-padded.
template <int DP, int kTeam, typename T, typename RowPtr>
__device__ void load_tile(Team<kTeam> team, T* dst, int rows, int nvalid, const Args<T>& a,
                          const RowPtr& row_ptr) {
  if (a.vec) {
    constexpr int V = 16 / sizeof(T), C = DP / V;
    for (int idx = team.tid(); idx < rows * C; idx += kTeam) {
      const int r = idx / C, c = (idx % C) * V;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (r < nvalid) val = *reinterpret_cast<const uint4*>(row_ptr(r) + c);
      *reinterpret_cast<uint4*>(dst + r * kLDT<DP> + c) = val;
    }
    return;
  }
  for (int idx = team.tid(); idx < rows * DP; idx += kTeam) {
    const int r = idx / DP, c = idx % DP;
    dst[r * kLDT<DP> + c] = (r < nvalid && c < a.d) ? row_ptr(r)[c] : narrow<T>(acc_t<T>(0));
  }
}

// Rows [t0, t0 + n) of head h of x (N, H, d) into dst[kBM][LDT].
template <int DP, int kTeam, typename T>
__device__ void load_rows(Team<kTeam> team, T* dst, const T* x, const Args<T>& a, int t0, int n, int h) {
  load_tile<DP>(team, dst, kBM, n, a, [&](int r) { return x + ((int64_t)(t0 + r) * a.H + h) * a.d; });
}

// Head h of a table (L, 3, H, d) as rows n = rel·3 + a of dst[L3p][LDT].
template <int DP, int kTeam, typename T>
__device__ void stage_table(Team<kTeam> team, T* dst, const T* table, const Args<T>& a, int h) {
  load_tile<DP>(team, dst, a.L3p, a.L3, a, [&](int n) { return table + ((int64_t)n * a.H + h) * a.d; });
}

// The three table rows of a pair, 10 bits each (so 3L <= 1023 on CUDA): one register instead of three.
constexpr int kMaxRows3 = 1023;
__device__ __forceinline__ int table_row(uint32_t rows, int a) { return (rows >> (10 * a)) & 1023u; }

// hist_row[row] += val[e] for the three rows of each valid pair of the four threads of a quad (threads sharing
// one histogram row). Bins of distinct columns are distinct (n = rel·3 + column), so lane t < 3 of the quad adds
// column t of all the quad's pairs, taken from the other lanes by shuffles: no lane waits for another, and
// each bin still sums in the fixed order (source lane, pair), bitwise reproducible.
template <typename A>
__device__ __forceinline__ void quad_ordered_add(A* hist_row, const uint32_t (&rows)[8], const A (&val)[8],
                                                 unsigned valid) {
  const int lane = threadIdx.x & 31, t = lane & 3, quad = lane & ~3;
#pragma unroll
  for (int src = 0; src < 4; ++src) {
    const unsigned vs = __shfl_sync(0xffffffffu, valid, quad + src);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const A v = __shfl_sync(0xffffffffu, val[e], quad + src);
      const uint32_t r = __shfl_sync(0xffffffffu, rows[e], quad + src);
      if (t < 3 && (vs >> e & 1u)) hist_row[table_row(r, t)] += v;
    }
  }
  __syncwarp();
}

// Persistent backward CTAs: the first / next tile of this CTA, round-robin or from the per-head counter.
template <typename T>
__device__ __forceinline__ int next_tile(const Args<T>& a, int current, int* shared_slot) {
  if (!a.dynamic) return current < 0 ? (int)blockIdx.x : current + (int)gridDim.x;
  __syncthreads();
  if (threadIdx.x == 0) *shared_slot = atomicAdd(a.tile_counter + blockIdx.y, 1);
  __syncthreads();
  return *shared_slot;
}

// dst[kBM][col_tiles·16] = X[kBM][DP] · Y[col_tiles·16][DP]ᵀ, spread over the team's warps: a warp keeps one row
// tile of X and takes every kWarpsPerRowTile-th column tile. With kKeepRows (the table products: many column tiles
// per row tile), fp32 up to DP 32 splits the warp's X rows into TF32 fragments once and keeps them in registers
// (DP of them) for all its column tiles.
template <int DP, bool kKeepRows = false, int kTeam, typename T>
__device__ void gemm_nt(Team<kTeam> team, acc_t<T>* dst, int ldd, const T* X, const T* Y, int col_tiles) {
  constexpr int kTeamWarps = Team<kTeam>::kWarpCount, kWarpsPerRowTile = kTeamWarps / (kBM / 16);
  static_assert(kTeamWarps % (kBM / 16) == 0, "gemm_nt: the warps must divide evenly over the row tiles");
  const int warp = team.warp(), rt = warp / kWarpsPerRowTile;
  const T* Xr = X + rt * 16 * kLDT<DP>;
  if constexpr (kKeepRows && std::is_same_v<T, float> && DP <= 32) {
    uint32_t a[DP / 8][4], a_lo[DP / 8][4];
#pragma unroll
    for (int ks = 0; ks < DP / 8; ++ks) Tf32Tile::load_a_rows(Xr, kLDT<DP>, 8 * ks, a[ks], a_lo[ks]);
    for (int ct = warp % kWarpsPerRowTile; ct < col_tiles; ct += kWarpsPerRowTile) {
      Tf32Tile c;
#pragma unroll
      for (int ks = 0; ks < DP / 8; ++ks) c.mma_rows_step(a[ks], a_lo[ks], Y + ct * 16 * kLDT<DP>, kLDT<DP>, 8 * ks);
      c.store(dst + rt * 16 * ldd + ct * 16, ldd);
    }
  } else {
    for (int ct = warp % kWarpsPerRowTile; ct < col_tiles; ct += kWarpsPerRowTile) {
      Tile<T> c;
      c.zero();
      c.template mma<false, true>(Xr, kLDT<DP>, Y + ct * 16 * kLDT<DP>, kLDT<DP>, DP);
      c.store(dst + rt * 16 * ldd + ct * 16, ldd);
    }
  }
}

// The per-token table products dst[kBM][L3p] = X · Tsᵀ of a staged table Ts (L3p x DP).
template <int DP, int kTeam, typename T>
__device__ void tile_table_products(Team<kTeam> team, acc_t<T>* dst, const T* X, const T* Ts,
                                    const Args<T>& a) {
  gemm_nt<DP, true>(team, dst, a.L3p, X, Ts, a.L3p / 16);
}

// A warp's share of a kBM x DP accumulator kept in registers across key blocks, spread over a team of kWarps warps
// (the CTA of the forward, a group of the backward).
template <int DP, typename T>
struct OutTiles {
  static constexpr int kColTiles = DP / 16, kTiles = (kBM / 16) * kColTiles;
  static constexpr int kPerWarp = (kTiles + kWarps - 1) / kWarps;
  Tile<T> t[kPerWarp];
  __device__ void zero() {
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) t[i].zero();
  }
  // += X · Y with X (kBM x K, pitch ldx) row-major, or stored transposed (column-major) if XT; Y (K x DP)
  // row-major. X is P or dS (kBM x kBM) or, for fp32 (kHistTiles), a histogram (kBM x L3p).
  template <bool XT>
  __device__ void mma(Team<kThreads> team, const T* X, int ldx, const T* Y, int K) {
    const int warp = team.warp();
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) {
      const int tile = warp + i * kWarps;
      if (tile >= kTiles) break;
      const int rt = tile / kColTiles, ct = tile % kColTiles;
      t[i].template mma<XT, false>(XT ? X + rt * 16 : X + rt * 16 * ldx, ldx, Y + ct * 16, kLDT<DP>, K);
    }
  }
  __device__ void scale(T f) {
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) t[i].scale(f);
  }
  // Row r of the accumulator times f[r] (kBM factors in shared memory).
  __device__ void scale_rows(Team<kThreads> team, const T* f) {
    const int warp = team.warp();
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) {
      const int tile = warp + i * kWarps;
      if (tile >= kTiles) break;
      t[i].scale_rows(f + tile / kColTiles * 16);
    }
  }
  __device__ void store(Team<kThreads> team, acc_t<T>* O) const {
    const int warp = team.warp();
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) {
      const int tile = warp + i * kWarps;
      if (tile >= kTiles) break;
      t[i].store(O + (tile / kColTiles) * 16 * kLDO<DP> + (tile % kColTiles) * 16, kLDO<DP>);
    }
  }
};

// Packed table rows of the pair (query with coordinates ci and radius ri, key with cj, rj).
__device__ __forceinline__ uint32_t pack_rows(const RelPosParams& p, const int* ci, const int* cj, float ri, float rj) {
  uint32_t rows = 0;
#pragma unroll
  for (int a = 0; a < 3; ++a) rows |= uint32_t(rel_row(p, ci, cj, ri, rj, a)) << (10 * a);
  return rows;
}

// Packed table rows of pair (query row r of `qs`, key row c of `ks`).
__device__ __forceinline__ uint32_t pair_rows(const RelPosParams& p, const TokenInfo& qs, const TokenInfo& ks,
                                              int r, int c) {
  return pack_rows(p, qs.coords + r * 3, ks.coords + c * 3, p.radius ? qs.radius[r] : 0.f,
                   p.radius ? ks.radius[c] : 0.f);
}

// Σ over the pair's three table rows of a per-token row of table products.
__device__ __forceinline__ float gather3(const float* x, uint32_t rows) {
  return x[table_row(rows, 0)] + x[table_row(rows, 1)] + x[table_row(rows, 2)];
}

// hist0[k] (row g) / hist1[k] (row g+8) [table row] += val(k, nt, e) for the nonzero C entries of an mma tile
// of the four lanes of a quad (which share the rows), for NH histograms k. As in quad_ordered_add, lane t < 3
// adds column t of the quad's entries, in a fixed order (source lane t, t + 1, t + 2, t + 3 mod 4, then tile,
// entry): bitwise reproducible, and no lane waits for another. A lane's own entries come first and need no
// shuffle (at NT = 4, 96 shuffles a call instead of 128; 144 for two histograms). Entries e and e + 2 (rows g
// and g + 8, never the same bin) and the NH histograms are read together and written together: 2·NH
// read-add-write chains in flight instead of one, as a bin of one chain may be the next entry's (the Nsight
// profile of the spherical windows: 16-23 % of the gather kernels' stall samples were this loop waiting on its
// shared-memory round trips).
template <int NH, int NT, typename Val>
__device__ __forceinline__ void quad_hist_add_n(float* const (&hist0)[NH], float* const (&hist1)[NH],
                                                const uint32_t (&rows)[NT][4], const Val& val) {
  const int lane = threadIdx.x & 31, t = lane & 3, quad = lane & ~3;
  __syncwarp();  // the rows' rescaling by other lanes is done
#pragma unroll
  for (int step = 0; step < 4; ++step) {
    const int src = quad + ((t + step) & 3);
    auto take = [&](auto x) { return step == 0 ? x : __shfl_sync(0xffffffffu, x, src); };
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const uint32_t r0 = take(rows[nt][e]), r1 = take(rows[nt][e + 2]);
        float v0[NH], v1[NH], x0[NH], x1[NH];
#pragma unroll
        for (int k = 0; k < NH; ++k) {
          v0[k] = take(val(k, nt, e));
          v1[k] = take(val(k, nt, e + 2));
        }
        if (t < 3) {
          const int n0 = table_row(r0, t), n1 = table_row(r1, t);
          // A zero entry's bin is not read: a masked pair's rows are 0, which is column 0's bin (lane 0's).
#pragma unroll
          for (int k = 0; k < NH; ++k) {
            x0[k] = v0[k] != 0.f ? hist0[k][n0] : 0.f;
            x1[k] = v1[k] != 0.f ? hist1[k][n1] : 0.f;
          }
#pragma unroll
          for (int k = 0; k < NH; ++k) {
            if (v0[k] != 0.f) hist0[k][n0] = x0[k] + v0[k];
            if (v1[k] != 0.f) hist1[k][n1] = x1[k] + v1[k];
          }
        }
      }
  }
  __syncwarp();
}

// One histogram: hist0 / hist1 [table row] += val.
template <int NT>
__device__ __forceinline__ void quad_hist_add(float* hist0, float* hist1, const uint32_t (&rows)[NT][4],
                                              const float (&val)[NT][4]) {
  float* const h0[1] = {hist0};
  float* const h1[1] = {hist1};
  quad_hist_add_n<1>(h0, h1, rows, [&](int, int nt, int e) { return val[nt][e]; });
}

// Two histograms of the same pairs (the rows shuffled once): a0 / a1 += va, b0 / b1 += vb.
template <int NT>
__device__ __forceinline__ void quad_hist_add2(float* a0, float* a1, const float (&va)[NT][4], float* b0, float* b1,
                                               const float (&vb)[NT][4], const uint32_t (&rows)[NT][4]) {
  float* const h0[2] = {a0, b0};
  float* const h1[2] = {a1, b1};
  quad_hist_add_n<2>(h0, h1, rows, [&](int k, int nt, int e) { return k == 0 ? va[nt][e] : vb[nt][e]; });
}

// hist0[k] (row g) / hist1[k] (row g+8) [bins[nt][e]] += val(k, nt, e) for the nonzero C entries of an mma tile
// of the quad's four lanes, one bin per entry (a single axis, so two entries of the quad may share a bin), for
// NH histograms k: lane 0 adds the row-g entries and lane 1 the row-(g+8) ones, each in a fixed order (source
// lane, tile, entry), so the sums are bitwise reproducible.
template <int NH, int NT, typename Val>
__device__ __forceinline__ void quad_bin_add_n(float* const (&hist0)[NH], float* const (&hist1)[NH],
                                               const int (&bins)[NT][4], const Val& val) {
  const int lane = threadIdx.x & 31, t = lane & 3, quad = lane & ~3;
  __syncwarp();  // the rows' rescaling by other lanes is done
#pragma unroll
  for (int src = 0; src < 4; ++src)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int b0 = __shfl_sync(0xffffffffu, bins[nt][e], quad + src);
        const int b1 = __shfl_sync(0xffffffffu, bins[nt][e + 2], quad + src);
#pragma unroll
        for (int k = 0; k < NH; ++k) {
          const float v0 = __shfl_sync(0xffffffffu, val(k, nt, e), quad + src);
          const float v1 = __shfl_sync(0xffffffffu, val(k, nt, e + 2), quad + src);
          const float v = t == 0 ? v0 : v1;
          if (t < 2 && v != 0.f) (t == 0 ? hist0[k] : hist1[k])[t == 0 ? b0 : b1] += v;
        }
      }
  __syncwarp();
}

// One histogram: hist0 / hist1 [bins] += val.
template <int NT>
__device__ __forceinline__ void quad_bin_add(float* hist0, float* hist1, const int (&bins)[NT][4],
                                             const float (&val)[NT][4]) {
  float* const h0[1] = {hist0};
  float* const h1[1] = {hist1};
  quad_bin_add_n<1>(h0, h1, bins, [&](int, int nt, int e) { return val[nt][e]; });
}

// Table gradient of a 64-row tile on the tensor cores: slot[n][h][c] += f · Σ_r Hist[r][n] · X[r][c] for
// n < L3, with Hist (64 x lp, fp32) and X (64 x LD, rows of T) in shared memory; warps take 16 table rows
// at a time. The slot (L3, H, DP) belongs to this CTA alone.
template <int DP, int LD, typename T>
__device__ void table_grad_mma(float* slot, const float* hist, int lp, const T* X, int L3, int L3p, int H, int h,
                               float f) {
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  for (int n0 = warp * 16; n0 < L3p; n0 += mma::kWarps * 16) {
    float acc[DP / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < mma::kRows / 16; ++kk) {
      const float* hr = hist + (kk * 16 + 2 * t) * lp + n0 + g;  // A[n][r] = Hist[r][n]
      uint32_t a[4];
      a[0] = mma::pack2<T>(hr[0], hr[lp]);
      a[1] = mma::pack2<T>(hr[8], hr[lp + 8]);
      a[2] = mma::pack2<T>(hr[8 * lp], hr[9 * lp]);
      a[3] = mma::pack2<T>(hr[8 * lp + 8], hr[9 * lp + 8]);
      mma::mma_ab<DP, LD>(acc, a, X, kk);
    }
    // A row's slot entries are loaded before any is stored, so that their latencies overlap.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int n = n0 + g + 8 * half;
      if (n >= L3) continue;
      float2* dst = reinterpret_cast<float2*>(slot + ((int64_t)n * H + h) * DP + 2 * t);
      float2 v[DP / 8];
#pragma unroll
      for (int dt = 0; dt < DP / 8; ++dt) v[dt] = dst[dt * 4];
#pragma unroll
      for (int dt = 0; dt < DP / 8; ++dt) {
        v[dt].x += f * acc[dt][2 * half];
        v[dt].y += f * acc[dt][2 * half + 1];
        dst[dt * 4] = v[dt];
      }
    }
  }
}

// The table-product row `row` of a per-token table in shared memory; a table that is absent gets a
// stand-in that is never read (branches test the kernel arguments), so no pointer is ever null.
template <typename A>
__device__ __forceinline__ const A* products_row(const A* table, int row, int L3p, const A* stand_in) {
  return table ? table + row * L3p : stand_in;
}

// Logit of a pair from its q·k score and the table products of its query row and key row.
template <bool REL, typename T, typename A>
__device__ __forceinline__ A pair_logit(const Args<T>& a, A qk, const A* qt, const A* kt, uint32_t rows) {
  A qside = qk, kside = 0;
  if constexpr (REL) {
#pragma unroll
    for (int c = 0; c < 3; ++c) {
      if (a.tq) qside += qt[table_row(rows, c)];
      if (a.tk) kside += kt[table_row(rows, c)];
    }
  }
  return a.scale * qside + kside;
}

// fp32: the histogram terms (H·T for the outputs, Hᵀ·X for the table gradients) as 3xTF32 tile products. The
// histograms are fp32 while fp16/bf16 tiles are 16-bit, so those keep the loops of write_rows / table_grad, and
// so does fp64 (which no user runs for speed).
template <typename T> constexpr bool kHistTiles = std::is_same_v<T, float>;

// Table gradient of one tile: slot[n][h][c] += f · Σ_r hist[r][n] · X[r][c] into this CTA's own slot of
// dst (slots, L, 3, H, d), which no other CTA touches (summed over slots on the host).
template <int DP, int kTeam, typename T>
__device__ void table_grad(Team<kTeam> team, acc_t<T>* dst, const acc_t<T>* hist, const T* X,
                           const Args<T>& a, int h, acc_t<T> f) {
  using A = acc_t<T>;
  dst += (int64_t)blockIdx.x * a.L3 * a.H * a.d;
  if constexpr (kHistTiles<T>) {  // 16 table rows x 16 columns per warp tile, A = histᵀ (kBM x L3p, pitch L3p)
    constexpr int kColTiles = DP / 16;
    for (int tile = team.warp(); tile < a.L3p / 16 * kColTiles; tile += Team<kTeam>::kWarpCount) {
      const int n0 = tile / kColTiles * 16, c0 = tile % kColTiles * 16;
      Tile<T> c;
      c.zero();
      c.template mma<true, false>(hist + n0, a.L3p, X + c0, kLDT<DP>, kBM);
      c.for_each([&](int i, int j, A g) {
        const int n = n0 + i, col = c0 + j;
        if (n < a.L3 && col < a.d && g != A(0)) dst[((int64_t)n * a.H + h) * a.d + col] += f * g;
      });
    }
  } else {
    for (int idx = team.tid(); idx < a.L3 * a.d; idx += kTeam) {
      const int n = idx / a.d, c = idx % a.d;
      A g = 0;
      for (int r = 0; r < kBM; ++r) g += hist[r * a.L3p + n] * widen(X[r * kLDT<DP> + c]);
      if (g != A(0)) dst[((int64_t)n * a.H + h) * a.d + c] += f * g;
    }
  }
}

// out[r][c] = f · (O[r][c] + Σ_n hist[r][n] · Ts[n][c]) (the sum only with_hist) for rows [t0, t0 + n) of head h.
// kParts > 1: O is the sum of that many partial tiles, `part_stride` elements apart, added in order.
template <int DP, int kParts = 1, int kTeam, typename T>
__device__ void write_rows(Team<kTeam> team, T* out, const acc_t<T>* O, bool with_hist, const acc_t<T>* hist,
                           const T* Ts, const Args<T>& a, int t0, int n, int h, acc_t<T> f, size_t part_stride = 0) {
  using A = acc_t<T>;
  for (int idx = team.tid(); idx < n * a.d; idx += kTeam) {
    const int r = idx / a.d, c = idx % a.d;
    A val = O[r * kLDO<DP> + c];
#pragma unroll
    for (int part = 1; part < kParts; ++part) val += O[part * part_stride + r * kLDO<DP> + c];
    if (with_hist)
      for (int m = 0; m < a.L3; ++m) val += hist[r * a.L3p + m] * widen(Ts[m * kLDT<DP> + c]);
    out[((int64_t)(t0 + r) * a.H + h) * a.d + c] = narrow<T>(f * val);
  }
}

template <int kTeam, typename A>
__device__ void zero_smem(Team<kTeam> team, A* p, int n) {
  for (int i = team.tid(); i < n; i += kTeam) p[i] = A(0);
}

// ----------------------------------------------------------------------------------------------- host
template <typename Smem, typename T>
size_t smem_bytes(const Args<T>& a) {
  Bump b(nullptr);
  Smem s(b, a);
  (void)s;
  return b.off + 128;
}

// Dynamic shared memory of `kernel` if it fits the device (opting in above 48 KB), else 0.
template <typename Kernel>
size_t fit_smem(Kernel* kernel, size_t bytes) {
  if (bytes > at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin) return 0;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
  return bytes;
}

// Dynamic shared memory of `kernel`, after checking it fits; opts in above the 48 KB default.
template <typename Smem, typename T>
size_t prepare(void (*kernel)(const Args<T>), const Args<T>& a, const char* name) {
  const size_t need = smem_bytes<Smem>(a), bytes = fit_smem(kernel, need);
  SPTR_CHECK_VALUE(bytes > 0, name, ": head_dim ", a.d, " with table length ", a.L3 / 3, " needs ", need,
                    " bytes of shared memory, the device has ",
                    at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin,
                    "; use shorter tables or the step-by-step ops");
  return bytes;
}

template <typename T>
void launch(void (*kernel)(const Args<T>), const Args<T>& a, int grid_x, size_t bytes, int threads = kThreads) {
  kernel<<<dim3(grid_x, a.H), threads, bytes, at::cuda::getCurrentCUDAStream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Backward CTAs are persistent (each owns a slot of the table-gradient partials): as many as fit at once,
// spread over `rows` grid rows, at most `work` in a row.
template <typename T>
int persistent_grid(void (*kernel)(const Args<T>), size_t bytes, int work, int rows, int threads = kThreads) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, bytes));
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return std::max(1, std::min(work, std::max(1, per_sm) * sms / rows));
}

// f(std::integral_constant<bool, rel>) for the kernels with or without relative-position tables.
template <typename F>
void dispatch_rel(const FusedOperands& o, const F& f) {
  SPTR_CHECK_VALUE(3 * o.L <= kMaxRows3, "window_attention on CUDA supports tables of up to ", kMaxRows3 / 3,
                    " rows, got L = ", o.L);
  if (o.has_rel()) f(std::true_type());
  else f(std::false_type());
}

template <typename F>
void dispatch_head_dim(int64_t d, const F& f) {
  SPTR_CHECK_VALUE(d >= 1 && d <= 128, "window_attention on CUDA supports head_dim 1..128, got ", d);
  if (d <= 16) f(std::integral_constant<int, 16>());
  else if (d <= 32) f(std::integral_constant<int, 32>());
  else if (d <= 64) f(std::integral_constant<int, 64>());
  else f(std::integral_constant<int, 128>());
}

bool aligned16(const at::Tensor& t) { return !t.defined() || reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0; }

template <typename T, typename S>
Args<T> make_args(const FusedOperands& o, double scale, const at::Tensor& bounds) {
  Args<T> a{};
  auto c = [](const at::Tensor& t) { return t.defined() ? reinterpret_cast<const T*>(t.const_data_ptr<S>()) : nullptr; };
  a.q = c(o.q);
  a.k = c(o.k);
  a.v = c(o.v);
  a.tq = c(o.table_q);
  a.tk = c(o.table_k);
  a.tv = c(o.table_v);
  a.bounds = reinterpret_cast<const int2*>(bounds.const_data_ptr<int32_t>());
  a.N = static_cast<int>(o.N);
  a.H = static_cast<int>(o.H);
  a.d = static_cast<int>(o.d);
  a.L3 = static_cast<int>(3 * o.L);
  a.L3p = (a.L3 + 15) / 16 * 16;
  a.scale = static_cast<acc_t<T>>(scale);
  a.rel = o.rel_params();
  const bool pow2 = a.d == 16 || a.d == 32 || a.d == 64 || a.d == 128;
  a.vec = pow2 && aligned16(o.q) && aligned16(o.k) && aligned16(o.v) && aligned16(o.table_q) &&
          aligned16(o.table_k) && aligned16(o.table_v);
  return a;
}

int num_tiles(const FusedOperands& o) { return static_cast<int>((o.N + kBM - 1) / kBM); }

// Work items of the mma.sync kernels: one per 64-row tile and head, heads adjacent (they read the same tokens).
unsigned int mma_grid(const FusedOperands& o) {
  const int64_t ctas = (o.N + mma::kRows - 1) / mma::kRows * o.H;
  SPTR_CHECK_VALUE(ctas < (int64_t(1) << 31), "window_attention: too many tokens x heads for one launch (", o.N,
                   " x ", o.H, ")");
  return static_cast<unsigned int>(ctas);
}

at::Tensor token_bounds(const FusedOperands& o) {
  at::Tensor bounds = at::empty({o.N, 2}, o.offsets.options());
  if (o.N > 0) {
    token_bounds_kernel<<<grid_for(o.N, 256), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        o.offsets.const_data_ptr<int32_t>(), static_cast<int>(o.W), static_cast<int>(o.N),
        reinterpret_cast<int2*>(bounds.data_ptr<int32_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return bounds;
}

}  // namespace
}  // namespace sptr
