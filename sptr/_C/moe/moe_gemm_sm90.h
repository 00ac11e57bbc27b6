// Grouped GEMMs on Hopper: CUTLASS's pointer-array kernels (TMA loads and stores, wgmma, warp-specialised
// persistent CTAs). Every problem's shape, pointers and strides are written on the device from the group
// offsets, so a launch never reads the host: capturable in a CUDA graph, one graph under torch.compile.
// Built only for sm_90a (TORCH_CUDA_ARCH_LIST holding 9.0a) with the CUTLASS headers; elsewhere available()
// is false and the callers keep the mma.sync kernel.
#pragma once
#include <ATen/ATen.h>

#include <vector>

namespace sptr::sm90 {

// D [m, n] = A [m, k] · B [k, n], D row-major, fp32 accumulation, one rounding. The operand layouts:
//   kTN: A row-major, B k-contiguous  (x · Wᵀ with an nn.Linear weight [n, k]: the MoE forward)
//   kNN: A row-major, B n-contiguous  (grad · W: the input gradient)
//   kNT: A m-contiguous, B n-contiguous (gradᵀ · x: the weight gradient)
enum class Layout { kTN, kNN, kNT };

// kRows: group g's rows [off[g], off[g+1]) give m and move A and D down by off[g] rows (kTN, kNN).
// kReduction: they give k and move A and B along k by off[g] (kNT). kStatic: m, n, k as given.
enum class Dynamic { kStatic, kRows, kReduction };

struct Problem {
  const void* a;
  const void* b;
  void* d;
  int64_t lda, ldb, ldd;  // the strides of each operand's non-contiguous dimension, in elements
  int32_t m, n, k;        // the dynamic one is ignored
  int32_t group;
};

// Compiled for sm_90a, and t is an fp16/bf16 tensor on a compute capability 9.0 device (and the environment
// variable SPTR_GROUPED_GEMM is not "mma").
bool available(const at::Tensor& t);

// TMA's requirements on one operand: a 16-byte aligned base and leading stride (extents are free).
inline bool tma_aligned(const void* p, int64_t ld, int64_t element_size) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && (ld * element_size) % 16 == 0;
}

// The tile configurations (defined in moe_gemm_sm90.cuh; grouped_gemm picks one per call).
struct Tiles128x256;
struct Tiles64x64;

// One layout's kernels of one tile configuration, fp16 and bf16: defined in moe_gemm_sm90.cuh, instantiated each
// in a translation unit of its own (moe_gemm_sm90_<layout>[_<tiles>].cu) so that the build compiles them in
// parallel.
template <Layout L, class Tiles>
void run_layout(at::ScalarType dtype, Dynamic dynamic, const std::vector<Problem>& problems,
                const at::Tensor& offsets, int64_t range_end);

// Runs the problems on the current stream. offsets: int64 [G + 1] on the device (clamped into [0, range_end]),
// used by kRows / kReduction. A problem with m = 0 or k = 0 is skipped: its output is not written.
void grouped_gemm(Layout layout, at::ScalarType dtype, Dynamic dynamic, const std::vector<Problem>& problems,
                  const at::Tensor& offsets, int64_t range_end);

// The grouped linear ops (moe_host.h) on these kernels, or false (nothing written) where their conditions do
// not hold: x and grad with unit inner strides, every base and leading stride 16-byte aligned, the weights all
// k-contiguous (nn.Linear's [n, k]) or all n-contiguous (their transposes: the input gradient), every part's
// first output column a multiple of 8, no empty weight, at most 256 groups. `out` [R, width] is written whole.
bool grouped_linear(const at::Tensor& x, at::TensorList weights, const at::Tensor& offsets, const at::Tensor& out);
// dW_g = grad_gᵀ x_g into `dw` (contiguous, row length a multiple of 8); empty groups get zeros.
bool grouped_linear_wgrad(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& offsets,
                          const std::vector<at::Tensor>& dw);

}  // namespace sptr::sm90
