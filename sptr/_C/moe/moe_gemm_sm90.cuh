// The CUTLASS side of moe_gemm_sm90.h: one kernel type per (layout, tiles, dtype), instantiated in its own
// translation unit (moe_gemm_sm90_<layout>[_<tiles>].cu) so that the build compiles them in parallel.
//
// Kernels (the tile configurations below): TMA loads and stores, wgmma, the pipeline depth that fills the rest
// of shared memory; a persistent grid of one CTA per SM walks the tiles of all problems. The problem list lives
// in device memory and is written by setup_kernel from the group offsets, so the host never learns the groups'
// sizes.
#pragma once
// Without NDEBUG, device asserts are function calls inside the mainloop and ptxas serialises the wgmma pipeline
// (warning C7510). A unit includes this header first, so that every header sees it.
#ifndef NDEBUG
#define NDEBUG
#endif
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <sptr/checks.h>

#include "moe_gemm_sm90.h"
#include "moe_groups.cuh"

namespace sptr::sm90 {

template <Layout L>
struct OperandLayouts;
template <>
struct OperandLayouts<Layout::kTN> {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::ColumnMajor;
};
template <>
struct OperandLayouts<Layout::kNN> {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::RowMajor;
};
template <>
struct OperandLayouts<Layout::kNT> {
  using A = cutlass::layout::ColumnMajor;
  using B = cutlass::layout::RowMajor;
};

// The tile configurations (grouped_gemm picks one per call). Tiles128x256: 128x256x64 tiles, 2x1 clusters,
// cooperative kernel and epilogue, for every layout. (Cooperative and ping-pong 128x128x64 tiles without clusters
// measured 1.2-1.6x slower on the large shapes, 256x128 tiles 1.0-1.1x slower: benchmarks/RESULTS.md, grouped
// GEMM step 3 and the twentieth session.) Tiles64x64: ping-pong 64x64x64 tiles for problems of few rows (kTN,
// kNN): 2x more multiprocessors busy per 64 rows than 64x128 tiles.
struct Tiles128x256 {
  using Shape = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Tiles64x64 {
  using Shape = cute::Shape<cute::_64, cute::_64, cute::_64>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

template <Layout L, class Element, class TileConfig>
struct GroupedGemm {
  using LayoutA = typename OperandLayouts<L>::A;
  using LayoutB = typename OperandLayouts<L>::B;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlign = 16 / sizeof(Element);  // 16-byte TMA alignment

  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using TileShape = typename TileConfig::Shape;
  using ClusterShape = typename TileConfig::Cluster;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlign, Element, LayoutD*, kAlign,
      typename TileConfig::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<Element, float, void, float>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element, LayoutB*, kAlign, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      typename TileConfig::Schedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using Shape = typename ProblemShape::UnderlyingProblemShape;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

constexpr int kMaxProblems = 32;  // per setup launch: its parameter block stays under 4 KB

struct SetupParams {
  Problem p[kMaxProblems];
  int32_t count;
  Dynamic dynamic;
  const int64_t* offsets;
  int64_t groups, range_end;
};

// The one dynamic (int64) mode of a packed CUTLASS stride: modes 0 or 1 hold it, the rest are static.
template <class Stride>
__device__ Stride leading_stride(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_static<cute::remove_cvref_t<decltype(cute::get<0>(s))>>::value) {
    cute::get<1>(s) = ld;
  } else {
    cute::get<0>(s) = ld;
  }
  return s;
}

// The device arrays a grouped launch reads: written by setup_kernel, one entry per problem.
template <class G, class Element>
struct DeviceArrays {
  typename G::Shape* shapes;
  const Element** a;
  const Element** b;
  Element** d;
  typename G::StrideA* sa;
  typename G::StrideB* sb;
  typename G::StrideD* sd;
};

template <class G, class Element>
__global__ void setup_kernel(SetupParams P, DeviceArrays<G, Element> out) {
  const int i = threadIdx.x;
  if (i >= P.count) return;
  const Problem pr = P.p[i];
  int64_t m = pr.m, k = pr.k;
  const Element* a = static_cast<const Element*>(pr.a);
  const Element* b = static_cast<const Element*>(pr.b);
  Element* d = static_cast<Element*>(pr.d);
  if (P.dynamic != Dynamic::kStatic) {
    int64_t lo, hi;
    group_range(P.offsets, pr.group, P.range_end, lo, hi);
    if (P.dynamic == Dynamic::kRows) {
      m = hi - lo;
      a += lo * pr.lda;
      d += lo * pr.ldd;
    } else {
      k = hi - lo;
      a += lo * pr.lda;
      b += lo * pr.ldb;
    }
  }
  if (k == 0) m = 0;  // an empty reduction would store unset accumulators: skipped (the caller zero-fills)
  out.shapes[i] = typename G::Shape(static_cast<int>(m), pr.n, static_cast<int>(k));
  out.a[i] = a;
  out.b[i] = b;
  out.d[i] = d;
  out.sa[i] = leading_stride<typename G::StrideA>(pr.lda);
  out.sb[i] = leading_stride<typename G::StrideB>(pr.ldb);
  out.sd[i] = leading_stride<typename G::StrideD>(pr.ldd);
}

inline int64_t align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

template <Layout L, class Element, class Tiles>
void run_grouped(Dynamic dynamic, const std::vector<Problem>& problems, const at::Tensor& offsets, int64_t range_end) {
  using G = GroupedGemm<L, Element, Tiles>;
  const int device = at::cuda::current_device();
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto bytes = at::TensorOptions(at::kByte).device(at::kCUDA, device);
  const int count = static_cast<int>(problems.size());
  // One device buffer for every problem's arrays (stream-ordered by the caching allocator: capturable).
  const int64_t sizes[7] = {align16(count * sizeof(typename G::Shape)), align16(count * sizeof(void*)),
                            align16(count * sizeof(void*)),           align16(count * sizeof(void*)),
                            align16(count * sizeof(typename G::StrideA)), align16(count * sizeof(typename G::StrideB)),
                            align16(count * sizeof(typename G::StrideD))};
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  at::Tensor buffer = at::empty({total}, bytes);
  char* base = static_cast<char*>(buffer.data_ptr());
  char* next[7];
  for (int j = 0; j < 7; ++j) next[j] = base, base += sizes[j];
  const DeviceArrays<G, Element> arrays{reinterpret_cast<typename G::Shape*>(next[0]),
                                        reinterpret_cast<const Element**>(next[1]),
                                        reinterpret_cast<const Element**>(next[2]),
                                        reinterpret_cast<Element**>(next[3]),
                                        reinterpret_cast<typename G::StrideA*>(next[4]),
                                        reinterpret_cast<typename G::StrideB*>(next[5]),
                                        reinterpret_cast<typename G::StrideD*>(next[6])};
  // The problems reach the device as kernel parameters, kMaxProblems per setup launch; one GEMM runs them all.
  for (int first = 0; first < count; first += kMaxProblems) {
    SetupParams params{};
    params.count = std::min(kMaxProblems, count - first);
    for (int i = 0; i < params.count; ++i) params.p[i] = problems[first + i];
    params.dynamic = dynamic;
    params.offsets = offsets.defined() ? offsets.const_data_ptr<int64_t>() : nullptr;
    params.groups = offsets.defined() ? offsets.numel() - 1 : 0;
    params.range_end = range_end;
    const DeviceArrays<G, Element> slice{arrays.shapes + first, arrays.a + first, arrays.b + first, arrays.d + first,
                                         arrays.sa + first,     arrays.sb + first, arrays.sd + first};
    setup_kernel<G, Element><<<1, kMaxProblems, 0, stream>>>(params, slice);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = at::cuda::getDeviceProperties(device)->multiProcessorCount;
  typename G::Device::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {count, arrays.shapes, nullptr},  // no host shapes: a persistent grid of sm_count CTAs
      {arrays.a, arrays.sa, arrays.b, arrays.sb},
      {{}, nullptr, arrays.sd, arrays.d, arrays.sd},
      hw};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  // CUTLASS's grouped default tile order (M fastest, no swizzle): N fastest and swizzles of 2-8 measured no
  // faster (H200, interleaved A/B, 0.96-1.01x; benchmarks/RESULTS.md, nineteenth session).
  typename G::Device gemm;
  SPTR_CHECK_VALUE(gemm.can_implement(args) == cutlass::Status::kSuccess,
                   "sm90 grouped GEMM: CUTLASS cannot run these problems");
  at::Tensor workspace = at::empty({static_cast<int64_t>(G::Device::get_workspace_size(args))}, bytes);
  SPTR_CHECK_VALUE(gemm.initialize(args, workspace.data_ptr(), stream) == cutlass::Status::kSuccess,
                   "sm90 grouped GEMM: initialisation failed");
  SPTR_CHECK_VALUE(gemm.run(stream) == cutlass::Status::kSuccess, "sm90 grouped GEMM: launch failed");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Declared in moe_gemm_sm90.h; each translation unit instantiates one (layout, tiles) pair, fp16 and bf16.
template <Layout L, class Tiles>
void run_layout(at::ScalarType dtype, Dynamic dynamic, const std::vector<Problem>& problems,
                const at::Tensor& offsets, int64_t range_end) {
  if (dtype == at::kHalf) {
    run_grouped<L, cutlass::half_t, Tiles>(dynamic, problems, offsets, range_end);
  } else {
    run_grouped<L, cutlass::bfloat16_t, Tiles>(dynamic, problems, offsets, range_end);
  }
}

}  // namespace sptr::sm90

// The explicit instantiation of run_layout<Layout::L, Tiles> that a translation unit holds.
#define SPTR_SM90_INSTANTIATE(L, Tiles)                                                                         \
  namespace sptr::sm90 {                                                                                        \
  template void run_layout<Layout::L, Tiles>(at::ScalarType, Dynamic, const std::vector<Problem>&,               \
                                             const at::Tensor&, int64_t);                                       \
  }
