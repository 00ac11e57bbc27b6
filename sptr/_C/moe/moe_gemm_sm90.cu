// The sm90 path of the grouped linear ops: problem lists for the CUTLASS kernels of moe_gemm_sm90.h (each
// layout in its own translation unit), and the zero fills for what those kernels do not write.
#include <ATen/cuda/CUDAContext.h>

#include <sptr/checks.h>
#include <sptr/env.h>

#include "moe_gemm_sm90.h"
#include "moe_groups.cuh"

namespace sptr::sm90 {

bool available(const at::Tensor& t) {
#ifdef SPTR_WITH_SM90A
  // SPTR_GROUPED_GEMM=mma keeps the mma.sync kernel on Hopper too: the benchmarks' A/B of the two kernels.
  if (env_is("SPTR_GROUPED_GEMM", "mma")) return false;
  return t.is_cuda() && (t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16) &&
         at::cuda::getDeviceProperties(t.get_device())->major == 9;
#else
  (void)t;
  return false;
#endif
}

#ifdef SPTR_WITH_SM90A
// Whether 64x64 tiles run these row-major problems (kTN, kNN): where 128x256 tiles could not give every
// multiprocessor one tile even if each group held all `rows` rows (the host knows their sum's bound, not the
// groups' sizes), as for a few dozen rows per group. Measured (benchmarks/RESULTS.md, twentieth session): 2.2x
// faster than 128x256 tiles at 64 rows per group, 1.7-2.7x slower on the large shapes; 64x128 tiles in between.
static bool small_tiles(const std::vector<Problem>& problems, Dynamic dynamic, int64_t rows, int64_t device) {
  int64_t tiles = 0;
  for (const Problem& p : problems) {
    const int64_t m = dynamic == Dynamic::kStatic ? p.m : rows;
    tiles += (p.n + 255) / 256 * ((m + 127) / 128);
  }
  return tiles <= at::cuda::getDeviceProperties(device)->multiProcessorCount;
}
#endif

void grouped_gemm(Layout layout, at::ScalarType dtype, Dynamic dynamic, const std::vector<Problem>& problems,
                  const at::Tensor& offsets, int64_t range_end) {
#ifdef SPTR_WITH_SM90A
  SPTR_CHECK_VALUE(dynamic == Dynamic::kStatic || offsets.defined(), "sm90 grouped GEMM: dynamic shapes need offsets");
  SPTR_CHECK_VALUE(dynamic != Dynamic::kRows || layout != Layout::kNT,
                   "sm90 grouped GEMM: rows from offsets need a row-major A");
  SPTR_CHECK_VALUE(dynamic != Dynamic::kReduction || layout == Layout::kNT,
                   "sm90 grouped GEMM: a reduction from offsets needs k-strided A and B (layout NT)");
  if (problems.empty()) return;
  const bool small = layout != Layout::kNT && small_tiles(problems, dynamic, range_end, at::cuda::current_device());
  switch (layout) {
    case Layout::kTN:
      if (small) return run_layout<Layout::kTN, Tiles64x64>(dtype, dynamic, problems, offsets, range_end);
      return run_layout<Layout::kTN, Tiles128x256>(dtype, dynamic, problems, offsets, range_end);
    case Layout::kNN:
      if (small) return run_layout<Layout::kNN, Tiles64x64>(dtype, dynamic, problems, offsets, range_end);
      return run_layout<Layout::kNN, Tiles128x256>(dtype, dynamic, problems, offsets, range_end);
    case Layout::kNT: return run_layout<Layout::kNT, Tiles128x256>(dtype, dynamic, problems, offsets, range_end);
  }
#else
  (void)layout, (void)dtype, (void)dynamic, (void)problems, (void)offsets, (void)range_end;
  SPTR_CHECK_VALUE(false, "sptr was built without the sm_90a grouped GEMM (TORCH_CUDA_ARCH_LIST without 9.0a)");
#endif
}

namespace {

constexpr int kMaxGroups = 256;

// Columns [covered[g], width) of group g's rows and every row of no group: what the GEMMs leave unwritten.
// 16-bit zeros are zero bits in fp16 and bf16 alike.
struct CoverParams {
  const int64_t* offsets;
  int64_t groups, rows, width;
  int32_t covered[kMaxGroups];
};

__global__ void zero_uncovered_kernel(uint16_t* out, const __grid_constant__ CoverParams P) {
  __shared__ int64_t off[kMaxGroups + 1];
  for (int64_t i = threadIdx.x; i <= P.groups; i += blockDim.x) off[i] = P.offsets[i];
  __syncthreads();
  for (int64_t r = blockIdx.x; r < P.rows; r += gridDim.x) {
    const int g = find_group(off, static_cast<int>(P.groups), r);
    for (int64_t c = (g >= 0 ? P.covered[g] : 0) + threadIdx.x; c < P.width; c += blockDim.x) out[r * P.width + c] = 0;
  }
}

// Weight gradients of groups without rows (the GEMM skips an empty reduction): zeros.
constexpr int kMaxZeroed = 32;
struct EmptyGroupParams {
  const int64_t* offsets;
  int64_t range_end;
  int32_t count;
  int32_t group[kMaxZeroed];
  uint16_t* ptr[kMaxZeroed];
  int64_t numel[kMaxZeroed];
};

__global__ void zero_empty_groups_kernel(const __grid_constant__ EmptyGroupParams P) {
  const int i = blockIdx.y;
  if (i >= P.count) return;
  int64_t lo, hi;
  group_range(P.offsets, P.group[i], P.range_end, lo, hi);
  if (hi > lo) return;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < P.numel[i]; e += int64_t(gridDim.x) * blockDim.x)
    P.ptr[i][e] = 0;
}

}  // namespace

bool grouped_linear(const at::Tensor& x, at::TensorList weights, const at::Tensor& offsets, const at::Tensor& out) {
  const int64_t G = offsets.numel() - 1, P = weights.size() / G, R = x.size(0), width = out.size(1);
  const int64_t es = x.element_size();
  if (!available(x) || G > kMaxGroups || R >= (int64_t(1) << 31) || x.stride(1) != 1 ||
      !tma_aligned(x.const_data_ptr(), x.stride(0), es) || !tma_aligned(out.data_ptr(), width, es))
    return false;
  bool k_major = true, n_major = true;
  for (const at::Tensor& w : weights) {
    if (w.numel() == 0) return false;
    k_major = k_major && w.stride(1) == 1 && tma_aligned(w.const_data_ptr(), w.stride(0), es);
    n_major = n_major && w.stride(0) == 1 && tma_aligned(w.const_data_ptr(), w.stride(1), es);
  }
  if (!k_major && !n_major) return false;
  std::vector<Problem> problems;
  CoverParams cover{};
  char* d = static_cast<char*>(out.data_ptr());
  for (int64_t g = 0; g < G; ++g) {
    int64_t col = 0;
    for (int64_t p = 0; p < P; ++p) {
      const at::Tensor& w = weights[g * P + p];
      if (col % 8) return false;  // the part's first column: a 16-byte aligned base for its TMA store
      problems.push_back(Problem{x.const_data_ptr(), w.const_data_ptr(), d + col * es, x.stride(0),
                                 k_major ? w.stride(0) : w.stride(1), width, 0, static_cast<int32_t>(w.size(0)),
                                 static_cast<int32_t>(w.size(1)), static_cast<int32_t>(g)});
      col += w.size(0);
    }
    cover.covered[g] = static_cast<int32_t>(col);
  }
  grouped_gemm(k_major ? Layout::kTN : Layout::kNN, x.scalar_type(), Dynamic::kRows, problems, offsets, R);
  cover.offsets = offsets.const_data_ptr<int64_t>();
  cover.groups = G;
  cover.rows = R;
  cover.width = width;
  const int blocks = static_cast<int>(std::min<int64_t>(R, 4096));
  zero_uncovered_kernel<<<blocks, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<uint16_t*>(out.data_ptr()), cover);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

bool grouped_linear_wgrad(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& offsets,
                          const std::vector<at::Tensor>& dw) {
  const int64_t es = x.element_size(), R = x.size(0);
  if (!available(x) || R >= (int64_t(1) << 31) || grad.stride(1) != 1 || x.stride(1) != 1 ||
      !tma_aligned(grad.const_data_ptr(), grad.stride(0), es) || !tma_aligned(x.const_data_ptr(), x.stride(0), es))
    return false;
  for (const at::Tensor& w : dw)
    if (w.numel() == 0 || !w.is_contiguous() || !tma_aligned(w.const_data_ptr(), w.size(1), es)) return false;
  std::vector<Problem> problems;
  for (size_t g = 0; g < dw.size(); ++g) {
    problems.push_back(Problem{grad.const_data_ptr(), x.const_data_ptr(), dw[g].data_ptr(), grad.stride(0),
                               x.stride(0), dw[g].size(1), static_cast<int32_t>(dw[g].size(0)),
                               static_cast<int32_t>(dw[g].size(1)), 0, static_cast<int32_t>(g)});
  }
  grouped_gemm(Layout::kNT, x.scalar_type(), Dynamic::kReduction, problems, offsets, R);
  auto stream = at::cuda::getCurrentCUDAStream();
  for (size_t first = 0; first < dw.size(); first += kMaxZeroed) {
    EmptyGroupParams zero{};
    zero.offsets = offsets.const_data_ptr<int64_t>();
    zero.range_end = R;
    zero.count = static_cast<int32_t>(std::min<size_t>(kMaxZeroed, dw.size() - first));
    for (int i = 0; i < zero.count; ++i) {
      zero.group[i] = static_cast<int32_t>(first + i);
      zero.ptr[i] = static_cast<uint16_t*>(dw[first + i].data_ptr());
      zero.numel[i] = dw[first + i].numel();
    }
    zero_empty_groups_kernel<<<dim3(64, zero.count), 256, 0, stream>>>(zero);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return true;
}

}  // namespace sptr::sm90
