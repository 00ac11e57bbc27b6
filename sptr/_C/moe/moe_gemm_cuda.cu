// Grouped GEMMs on CUDA: C = A · Bᵀ for a list of problems in one launch, A [m, k] and B [n, k] both with the
// reduction dimension contiguous (nn.Linear's x · Wᵀ), fp32 accumulation, one rounding, no split-K (bitwise
// reproducible). Problem rows (the MoE forward) or reduction ranges (the weight gradient) may come from
// device-side group offsets, so the MoE layers never wait for the host.
//
// fp16/bf16: 128x128x32 CTA tiles, 4 warps of 64x64, mma.sync m16n8k16 fed by ldmatrix from XOR-swizzled
// shared memory, a 4-stage cp.async pipeline (16-byte loads where a problem's rows and k range allow it, else
// element loads), CTAs rasterised in bands of 8 row tiles so that a wave shares its A and B panels in L2.
// fp32/fp64: 64x64x16 FMA tiles.
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <sptr/cuda_utils.cuh>
#include <sptr/dispatch.h>
#include <sptr/mma_primitives.cuh>

#include "moe_gemm_sm90.h"
#include "moe_groups.cuh"
#include "moe_host.h"

namespace sptr {
namespace {

constexpr int kMaxProblems = 64;

enum Mode : int32_t { kStatic = 0, kRowsFromOffsets = 1, kKFromOffsets = 2 };

struct Problem {
  const void* a;
  const void* b;
  void* c;
  int64_t lda, ldb, ldc;
  int32_t m, n, n_pad, k;  // static rows, computed columns, zero columns after them, static reduction length
  int32_t range;           // offsets range: group g -> [off[g], off[g+1]); -1 -> [0, off[0]); G -> [off[G], end)
  int32_t tile_begin;      // static row counts: first linear tile of this problem
};

struct GemmParams {
  Problem p[kMaxProblems];
  int32_t count, mode;
  const int64_t* offsets;
  int64_t groups, range_end;  // G, and the end of the last range (rows of x, or its reduction length)
};

__device__ __forceinline__ void offsets_range(const GemmParams& P, int range, int64_t& lo, int64_t& hi) {
  const int64_t end = P.range_end;
  if (range < 0) {
    lo = 0, hi = clamped_offset(P.offsets, 0, end);
  } else if (range >= P.groups) {
    lo = clamped_offset(P.offsets, range, end), hi = end;
  } else {
    group_range(P.offsets, range, end, lo, hi);
  }
}

struct Tile {
  int pi;
  int64_t row0, rows;  // problem rows [row0, row0 + rows) in A / C row coordinates
  int64_t k0, k1;      // reduction range
  int64_t m_base, n_base;
};

// Linear CTA index -> (problem, tile). Within a problem, bands of 8 row tiles sweep the column tiles.
template <int BM, int BN>
__device__ bool decode_tile(const GemmParams& P, int64_t t, Tile& out) {
  for (int i = 0; i < P.count; ++i) {
    const Problem& pr = P.p[i];
    int64_t row0 = 0, rows = pr.m, k0 = 0, k1 = pr.k;
    if (P.mode == kRowsFromOffsets) offsets_range(P, pr.range, row0, rows), rows -= row0;
    if (P.mode == kKFromOffsets) offsets_range(P, pr.range, k0, k1);
    const int64_t mt = (rows + BM - 1) / BM, nt = (pr.n + pr.n_pad + BN - 1) / BN;
    const int64_t local = P.mode == kRowsFromOffsets ? t : t - pr.tile_begin;
    if (P.mode != kRowsFromOffsets && (local < 0 || local >= mt * nt)) continue;
    if (P.mode == kRowsFromOffsets && local >= mt * nt) {
      t -= mt * nt;
      continue;
    }
    constexpr int64_t kBand = 8;
    const int64_t band = local / (kBand * nt), first = band * kBand, height = min(mt - first, kBand);
    const int64_t in_band = local - band * kBand * nt;
    out = Tile{i, row0, rows, k0, k1, (first + in_band % height) * BM, (in_band / height) * BN};
    return true;
  }
  return false;
}

// fp32 -> __half / __nv_bfloat16 (torch builds without the implicit 16-bit conversions).
template <typename T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, __half>) return __float2half_rn(v);
  else return __float2bfloat16_rn(v);
}

template <typename T>
__device__ __forceinline__ void store_pair(T* c, int64_t ldc, int64_t r, int64_t col, int64_t limit_n,
                                           int64_t limit_z, float v0, float v1, bool pair_ok) {
  const float x0 = col < limit_n ? v0 : 0.f, x1 = col + 1 < limit_n ? v1 : 0.f;
  if (pair_ok && col + 1 < limit_z) {
    *reinterpret_cast<uint32_t*>(c + r * ldc + col) = mma::pack2<T>(x0, x1);
  } else {
    if (col < limit_z) c[r * ldc + col] = from_float<T>(x0);
    if (col + 1 < limit_z) c[r * ldc + col + 1] = from_float<T>(x1);
  }
}

// 4 warps of 64x64 each: 8 ldmatrix.x4 per 32 mma.sync per k16 step, the ratio at which shared memory keeps
// up with the tensor cores (64x32 warp tiles need 6 per 16 and are bound by ldmatrix bandwidth).
constexpr int kBM = 128, kBN = 128, kBK = 32, kStages = 4, kThreads = 128;
constexpr int kWarpN = 64, kNTiles = kWarpN / 8;
constexpr size_t kMmaSmem = size_t(kStages) * (kBM + kBN) * kBK * 2;  // 64 KB: dynamic shared memory

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) grouped_gemm_mma_kernel(const __grid_constant__ GemmParams P) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  auto As = reinterpret_cast<T(*)[kBM][kBK]>(smem_raw);
  auto Bs = reinterpret_cast<T(*)[kBN][kBK]>(smem_raw + size_t(kStages) * kBM * kBK * sizeof(T));
  Tile tile;
  if (!decode_tile<kBM, kBN>(P, blockIdx.x, tile)) return;
  const Problem& pr = P.p[tile.pi];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp & 1, warp_n = warp >> 1;
  T* C = static_cast<T*>(pr.c);
  const int64_t n_end = pr.n, z_end = pr.n + pr.n_pad;
  const bool pair_ok = (pr.ldc % 2 == 0) && (reinterpret_cast<uintptr_t>(C) % 4 == 0);
  const int64_t rows_left = min((int64_t)kBM, tile.rows - tile.m_base);

  if (tile.n_base >= n_end) {  // a tile of zero columns only
    for (int64_t i = tid; i < rows_left * kBN; i += kThreads) {
      const int64_t r = i / kBN, col = tile.n_base + i % kBN;
      if (col < z_end) C[(tile.row0 + tile.m_base + r) * pr.ldc + col] = from_float<T>(0.f);
    }
    return;
  }

  const T* A = static_cast<const T*>(pr.a);
  const T* B = static_cast<const T*>(pr.b);
  const int64_t k0 = tile.k0, k1 = tile.k1;
  const bool vec = (pr.lda % 8 == 0) && (pr.ldb % 8 == 0) && (k0 % 8 == 0) && (k1 % 8 == 0) &&
                   (reinterpret_cast<uintptr_t>(A) % 16 == 0) && (reinterpret_cast<uintptr_t>(B) % 16 == 0);
  const int64_t nk = (k1 - k0 + kBK - 1) / kBK;

  // Stage loads: 512 16-byte chunks per operand, four per thread. Chunk c of row r lives at c ^ ((r >> 1) & 3).
  auto load_stage = [&](int stage, int64_t kb) {
#pragma unroll
    for (int op = 0; op < 2; ++op) {
      const T* G = op == 0 ? A : B;
      const int64_t ld = op == 0 ? pr.lda : pr.ldb;
      const int64_t base = op == 0 ? tile.row0 + tile.m_base : tile.n_base;
      const int64_t limit = op == 0 ? tile.row0 + tile.m_base + rows_left : n_end;
#pragma unroll
      for (int j = 0; j < kBM * kBK / 8 / kThreads; ++j) {
        const int i = tid + j * kThreads, r = i >> 2, ch = i & 3;
        T* dst = (op == 0 ? &As[stage][r][0] : &Bs[stage][r][0]) + ((ch ^ ((r >> 1) & 3)) << 3);
        const int64_t gr = base + r, gk = k0 + kb * kBK + ch * 8;
        const bool row_ok = gr < limit;
        if (vec) {
          mma::cp_async_16(dst, row_ok && gk < k1 ? G + gr * ld + gk : G, row_ok && gk < k1);
        } else {
          alignas(16) T v[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = row_ok && gk + e < k1 ? G[gr * ld + gk + e] : from_float<T>(0.f);
          *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(v);
        }
      }
    }
  };

  float acc[4][kNTiles][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < kNTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) load_stage(s, s);
    mma::cp_async_commit();
  }
  for (int64_t kb = 0; kb < nk; ++kb) {
    mma::cp_async_wait<kStages - 2>();
    __syncthreads();
    const int64_t next = kb + kStages - 1;
    if (next < nk) load_stage(next % kStages, next);
    mma::cp_async_commit();
    const int stage = kb % kStages;
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      uint32_t af[4][4], bf[kNTiles / 2][4];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        const int r = warp_m * 64 + mi * 16 + (lane & 15), ch = ks * 2 + (lane >> 4);
        mma::ldmatrix_x4(af[mi], &As[stage][r][(ch ^ ((r >> 1) & 3)) << 3]);
      }
#pragma unroll
      for (int nj = 0; nj < kNTiles / 2; ++nj) {
        const int r = warp_n * kWarpN + nj * 16 + (lane & 7) + ((lane >> 4) << 3), ch = ks * 2 + ((lane >> 3) & 1);
        mma::ldmatrix_x4(bf[nj], &Bs[stage][r][(ch ^ ((r >> 1) & 3)) << 3]);
      }
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < kNTiles; ++ni)
          mma::mma_16816<T>(acc[mi][ni], af[mi], bf[ni >> 1][(ni & 1) * 2], bf[ni >> 1][(ni & 1) * 2 + 1]);
    }
  }
  mma::cp_async_wait<0>();

  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t r = warp_m * 64 + mi * 16 + g + 8 * half;
      if (r >= rows_left) continue;
#pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni) {
        const int64_t col = tile.n_base + warp_n * kWarpN + ni * 8 + 2 * t4;
        store_pair<T>(C, pr.ldc, tile.row0 + tile.m_base + r, col, n_end, z_end, acc[mi][ni][2 * half],
                      acc[mi][ni][2 * half + 1], pair_ok);
      }
    }
}

constexpr int kFmaBM = 64, kFmaBN = 64, kFmaBK = 16;

template <typename T>
__global__ void __launch_bounds__(256) grouped_gemm_fma_kernel(const __grid_constant__ GemmParams P) {
  using acc_t = at::opmath_type<T>;
  __shared__ acc_t As[kFmaBK][kFmaBM + 1];
  __shared__ acc_t Bs[kFmaBK][kFmaBN + 1];
  Tile tile;
  if (!decode_tile<kFmaBM, kFmaBN>(P, blockIdx.x, tile)) return;
  const Problem& pr = P.p[tile.pi];
  const T* A = static_cast<const T*>(pr.a);
  const T* B = static_cast<const T*>(pr.b);
  T* C = static_cast<T*>(pr.c);
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t rows_left = min((int64_t)kFmaBM, tile.rows - tile.m_base), n_end = pr.n, z_end = pr.n + pr.n_pad;
  acc_t acc[4][4] = {};
  if (tile.n_base < n_end) {
    for (int64_t kb = tile.k0; kb < tile.k1; kb += kFmaBK) {
      for (int i = threadIdx.x; i < kFmaBK * kFmaBM; i += 256) {
        const int r = i / kFmaBK, kk = i % kFmaBK;
        const int64_t gk = kb + kk, ar = tile.row0 + tile.m_base + r, bn = tile.n_base + r;
        As[kk][r] = r < rows_left && gk < tile.k1 ? static_cast<acc_t>(A[ar * pr.lda + gk]) : acc_t(0);
        Bs[kk][r] = bn < n_end && gk < tile.k1 ? static_cast<acc_t>(B[bn * pr.ldb + gk]) : acc_t(0);
      }
      __syncthreads();
      // Two-level sum (a partial per k block, then the running total): error growth ~(BK + k / BK) ulps
      // instead of ~k, as accurate as cuBLAS's blocked reductions.
      acc_t part[4][4] = {};
#pragma unroll
      for (int kk = 0; kk < kFmaBK; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) part[i][j] += As[kk][ty * 4 + i] * Bs[kk][tx * 4 + j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += part[i][j];
      __syncthreads();
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t r = ty * 4 + i;
    if (r >= rows_left) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t col = tile.n_base + tx * 4 + j;
      if (col < z_end) C[(tile.row0 + tile.m_base + r) * pr.ldc + col] = static_cast<T>(col < n_end ? acc[i][j] : acc_t(0));
    }
  }
}

bool use_mma(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// Launches the problems in chunks of kMaxProblems. Static tilings are numbered on the host. With rows from
// offsets, the ranges of one part (`parts[i]`) partition the rows, so each part needs at most
// ceil(rows / BM) + (its ranges) row tiles; the grid covers that and the surplus CTAs return at once.
// The mma kernels use more than the default 48 KB of dynamic shared memory: raised once per device.
void allow_mma_smem() {
  static bool done[64] = {};
  const int dev = at::cuda::current_device();
  if (dev < 64 && done[dev]) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_mma_kernel<__half>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(kMmaSmem)));
  C10_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_mma_kernel<__nv_bfloat16>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kMmaSmem)));
  if (dev < 64) done[dev] = true;
}

void launch_grouped(GemmParams P, const std::vector<Problem>& problems, const std::vector<int>& parts,
                    at::ScalarType dtype, int64_t rows) {
  const bool mma = use_mma(dtype);
  if (mma) allow_mma_smem();
  const int64_t BM = mma ? kBM : kFmaBM, BN = mma ? kBN : kFmaBN;
  auto stream = at::cuda::getCurrentCUDAStream();
  for (size_t first = 0; first < problems.size(); first += kMaxProblems) {
    const size_t count = std::min<size_t>(kMaxProblems, problems.size() - first);
    int64_t tiles = 0;
    std::vector<int64_t> ranges, widest;  // per part: ranges in this chunk, most column tiles
    for (size_t i = 0; i < count; ++i) {
      Problem& pr = P.p[i];
      pr = problems[first + i];
      const int64_t nt = (pr.n + pr.n_pad + BN - 1) / BN;
      pr.tile_begin = static_cast<int32_t>(tiles);
      if (P.mode != kRowsFromOffsets) {
        tiles += (pr.m + BM - 1) / BM * nt;
        continue;
      }
      const size_t part = parts[first + i];
      if (ranges.size() <= part) ranges.resize(part + 1, 0), widest.resize(part + 1, 0);
      ranges[part] += 1;
      widest[part] = std::max(widest[part], nt);
    }
    for (size_t part = 0; part < ranges.size(); ++part) tiles += ((rows + BM - 1) / BM + ranges[part]) * widest[part];
    P.count = static_cast<int32_t>(count);
    SPTR_CHECK_VALUE(tiles < (int64_t(1) << 31), "grouped GEMM too large: ", tiles, " tiles");
    if (tiles == 0) continue;
    switch (dtype) {
      case at::kHalf: grouped_gemm_mma_kernel<__half><<<tiles, kThreads, kMmaSmem, stream>>>(P); break;
      case at::kBFloat16:
        grouped_gemm_mma_kernel<__nv_bfloat16><<<tiles, kThreads, kMmaSmem, stream>>>(P);
        break;
      case at::kFloat: grouped_gemm_fma_kernel<float><<<tiles, 256, 0, stream>>>(P); break;
      case at::kDouble: grouped_gemm_fma_kernel<double><<<tiles, 256, 0, stream>>>(P); break;
      default: SPTR_CHECK_TYPE(false, "grouped GEMM: unsupported dtype ", dtype);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// Rows with a unit inner stride (what the kernels read), copying otherwise.
at::Tensor k_contiguous(const at::Tensor& t) { return t.stride(1) == 1 && t.size(1) > 0 ? t : t.contiguous(); }

at::Tensor moe_grouped_linear_cuda(const at::Tensor& x_in, at::TensorList weights, const at::Tensor& offsets) {
  c10::cuda::CUDAGuard guard(x_in.device());
  const int64_t width = check_grouped_linear_args(x_in, weights, offsets);
  const at::Tensor x = k_contiguous(x_in), off = offsets.contiguous();
  const int64_t R = x.size(0), G = off.numel() - 1, P = weights.size() / G;
  auto out = at::empty({R, width}, x.options());
  if (out.numel() == 0 || sm90::grouped_linear(x, weights, off, out)) return out;
  std::vector<at::Tensor> ws;
  for (const at::Tensor& w : weights) ws.push_back(k_contiguous(w));
  GemmParams params{};
  params.mode = kRowsFromOffsets;
  params.offsets = off.const_data_ptr<int64_t>();
  params.groups = G;
  params.range_end = R;
  std::vector<Problem> problems;
  std::vector<int> parts;
  const int64_t es = x.element_size();
  char* c = static_cast<char*>(out.data_ptr());
  for (int64_t g = 0; g < G; ++g) {
    int64_t col = 0;
    for (int64_t p = 0; p < P; ++p) {
      const at::Tensor& w = ws[g * P + p];
      Problem pr{x.const_data_ptr(), w.const_data_ptr(), c + col * es, x.stride(0), w.stride(0), width,
                 0, static_cast<int32_t>(w.size(0)), 0, static_cast<int32_t>(w.size(1)), static_cast<int32_t>(g), 0};
      col += w.size(0);
      if (p == P - 1) pr.n_pad = static_cast<int32_t>(width - col);
      problems.push_back(pr);
      parts.push_back(static_cast<int>(p));
    }
  }
  for (int32_t range : {-1, static_cast<int32_t>(G)}) {  // zero rows before the first and after the last group
    problems.push_back(Problem{x.const_data_ptr(), x.const_data_ptr(), c, x.stride(0), x.stride(0), width, 0, 0,
                               static_cast<int32_t>(width), 0, range, 0});
    parts.push_back(static_cast<int>(P));
  }
  launch_grouped(params, problems, parts, x.scalar_type(), R);
  return out;
}

// [rows, cols] -> its transpose [cols, rows padded to a multiple of 8] (16-byte aligned rows for the kernel).
at::Tensor transposed_rows(const at::Tensor& t) {
  const int64_t padded = (t.size(0) + 7) / 8 * 8;
  auto out = at::empty({t.size(1), padded}, t.options());
  out.slice(1, 0, t.size(0)).copy_(t.t());
  return out;
}

std::vector<at::Tensor> moe_grouped_linear_wgrad_cuda(const at::Tensor& grad, const at::Tensor& x,
                                                      const at::Tensor& offsets, at::IntArrayRef out_features,
                                                      at::IntArrayRef in_features) {
  c10::cuda::CUDAGuard guard(x.device());
  check_wgrad_args(grad, x, offsets, out_features, in_features);
  const int64_t G = offsets.numel() - 1;
  std::vector<at::Tensor> dw;
  for (int64_t g = 0; g < G; ++g) dw.push_back(at::empty({out_features[g], in_features[g]}, x.options()));
  if (sm90::grouped_linear_wgrad(grad, x, offsets.contiguous(), dw)) return dw;
  const at::Tensor gT = transposed_rows(grad), xT = transposed_rows(x), off = offsets.contiguous();
  GemmParams params{};
  params.mode = kKFromOffsets;
  params.offsets = off.const_data_ptr<int64_t>();
  params.groups = G;
  params.range_end = x.size(0);
  std::vector<Problem> problems;
  for (int64_t g = 0; g < G; ++g) {
    if (dw[g].numel() == 0) continue;
    problems.push_back(Problem{gT.const_data_ptr(), xT.const_data_ptr(), dw[g].data_ptr(), gT.stride(0), xT.stride(0),
                               in_features[g], static_cast<int32_t>(out_features[g]),
                               static_cast<int32_t>(in_features[g]), 0, 0, static_cast<int32_t>(g), 0});
  }
  launch_grouped(params, problems, {}, x.scalar_type(), 0);
  return dw;
}

// cuBLAS's Hopper kernels beat the mma.sync tiles except where k, n or a leading dimension is odd, which drops
// cuBLAS to slow unaligned kernels: measured on the H200 (benchmarks/RESULTS.md), the grouped kernel is
// 1.1-1.8x faster there once the problem has a few row tiles. The row count m does not matter.
bool cublas_unaligned(const at::Tensor& op_a, const at::Tensor& op_w) {  // op(a) [m, k], op(w) [k, n]
  auto odd_ld = [](const at::Tensor& t) {
    return (t.stride(0) != 1 && t.size(0) > 1 && t.stride(0) % 2) || (t.stride(1) != 1 && t.size(1) > 1 && t.stride(1) % 2);
  };
  return op_a.size(1) % 2 || op_w.size(1) % 2 || odd_ld(op_a) || odd_ld(op_w);
}

void dual_gemm_out_cuda(const at::Tensor& a0, const at::Tensor& a1, const at::Tensor& w0, const at::Tensor& w1,
                        bool trans_a, bool trans_b, const at::Tensor& c0, const at::Tensor& c1) {
  c10::cuda::CUDAGuard guard(a0.device());
  check_dual_args(a0, a1, w0, w1);
  const at::Tensor* cs[2] = {&c0, &c1};
  at::Tensor A[2], W[2];  // op(a) [m, k], op(w) [k, n]
  for (int e = 0; e < 2; ++e) {
    const at::Tensor& a = e ? a1 : a0;
    const at::Tensor& w = e ? w1 : w0;
    check_dual_out(*cs[e], dual_shape(a, w, trans_a, trans_b, e), a0, e, {&a0, &a1, &w0, &w1});
    A[e] = trans_a ? a.t() : a;
    W[e] = trans_b ? w.t() : w;
  }
  // Per expert: the grouped kernel where cuBLAS would run unaligned and there are >= 2 row tiles, else cuBLAS.
  // The fused kernel reads A [m, k] and Bᵀ [n, k] with k contiguous, and writes row-major C.
  GemmParams params{};
  params.mode = kStatic;
  std::vector<Problem> problems;
  at::Tensor keep[2][3];
  for (int e = 0; e < 2; ++e) {
    if (A[e].size(0) == 0 || W[e].size(1) == 0) continue;
    if (!use_mma(a0.scalar_type()) || !cublas_unaligned(A[e], W[e]) || A[e].size(0) < 2 * kBM) {
      at::mm_out(const_cast<at::Tensor&>(*cs[e]), A[e], W[e]);
      continue;
    }
    const at::Tensor Ak = k_contiguous(A[e]), Bt = k_contiguous(W[e].t());
    const at::Tensor C = cs[e]->stride(1) == 1 ? *cs[e] : at::empty(cs[e]->sizes(), a0.options());
    keep[e][0] = Ak, keep[e][1] = Bt, keep[e][2] = C;
    problems.push_back(Problem{Ak.const_data_ptr(), Bt.const_data_ptr(), C.data_ptr(), Ak.stride(0), Bt.stride(0),
                               C.stride(0), static_cast<int32_t>(Ak.size(0)), static_cast<int32_t>(Bt.size(0)), 0,
                               static_cast<int32_t>(Ak.size(1)), -1, 0});
  }
  if (problems.empty()) return;
  launch_grouped(params, problems, {}, a0.scalar_type(), 0);
  for (int e = 0; e < 2; ++e)
    if (keep[e][2].defined() && !keep[e][2].is_same(*cs[e])) cs[e]->copy_(keep[e][2]);
}

}  // namespace

TORCH_LIBRARY_IMPL(sptr, CUDA, m) {
  m.impl("moe_grouped_linear", &moe_grouped_linear_cuda);
  m.impl("moe_grouped_linear_wgrad", &moe_grouped_linear_wgrad_cuda);
  m.impl("dual_gemm", &dual_gemm_alloc<dual_gemm_out_cuda>);
  m.impl("dual_gemm_out", &dual_gemm_out_cuda);
}

}  // namespace sptr
