// MoE routing and grouped SwiGLU on CUDA, with no host synchronisation (capturable in a CUDA graph).
//
// permute: a counting sort over experts in three small kernels (per-chunk expert histograms, one flat
// exclusive scan over the expert-major histogram table, which directly gives every chunk's first row per
// expert, then ranks inside each chunk; small tables skip the scan kernel, every rank CTA laying the experts out
// itself), and a row gather with 16-byte loads where the rows allow it. On sm_90+ each is launched while the one
// before it still runs (programmatic dependent launch), so the chain does not wait for a launch at every step.
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <sptr/cuda_utils.cuh>
#include <sptr/dispatch.h>
#include <sptr/views.h>

#include "moe_groups.cuh"
#include "moe_host.h"

namespace sptr {
namespace {

constexpr int kChunk = 256;   // slots per CTA in the histogram and rank kernels (one per thread)
constexpr int kScanThreads = 1024;
constexpr int64_t kMaxExpertsCuda = 8192;

__global__ void moe_count_kernel(IntView ids, int64_t slots, int64_t E, int32_t* hist, int64_t chunks) {
  extern __shared__ int32_t counts[];
  allow_next_grid();
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  const int64_t s = blockIdx.x * (int64_t)kChunk + threadIdx.x;
  if (s < slots) {
    const int64_t e = ids[s];
    if (e >= 0 && e < E) atomicAdd(&counts[e], 1);  // integer counts: order-independent
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) hist[e * chunks + blockIdx.x] = counts[e];
}

// Exclusive scan of n ints in place by one CTA; returns the total to every thread.
__device__ int64_t block_exclusive_scan(int32_t* a, int64_t n, int64_t* warp_sums) {
  const int64_t per = (n + blockDim.x - 1) / blockDim.x;
  const int64_t lo = threadIdx.x * per, hi = min(n, lo + per);
  int64_t local = 0;
  for (int64_t i = lo; i < hi; ++i) local += a[i];
  // Inclusive scan of the per-thread sums: in warps, then over warp totals.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int64_t incl = local;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int64_t v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int64_t w = lane < (int)(blockDim.x >> 5) ? warp_sums[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int64_t v = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += v;
    }
    if (lane < (int)(blockDim.x >> 5)) warp_sums[lane] = w;
  }
  __syncthreads();
  int64_t run = incl - local + (warp ? warp_sums[warp - 1] : 0);
  const int64_t total = warp_sums[(blockDim.x >> 5) - 1];
  for (int64_t i = lo; i < hi; ++i) {
    const int32_t v = a[i];
    a[i] = static_cast<int32_t>(run);
    run += v;
  }
  __syncthreads();
  return total;
}

// Slots an expert keeps of its sorted positions [start, start + count): the first num_out positions stay.
__device__ __forceinline__ int64_t kept_slots(int64_t num_out, int64_t start, int64_t count) {
  return min(max(num_out - start, int64_t(0)), count);
}

// Rows an expert takes: its kept slots rounded up to a multiple of align.
__device__ __forceinline__ int64_t aligned_rows(int64_t kept, int64_t align) {
  return (kept + align - 1) / align * align;
}

// Per expert, from `first` (each expert's first position in the global sorted order at first[e * stride],
// `total` kept-or-not slots in all): the kept count (the first num_out positions stay), its aligned first row,
// delta = row - sorted position for kept slots, and the end of its kept positions. One thread.
__device__ void expert_layout(const int32_t* first, int64_t stride, int64_t total, int64_t E, int64_t num_out,
                              int64_t align, int64_t* tokens_per_expert, int64_t* offsets, int64_t* delta,
                              int64_t* kept_end) {
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t start = stride ? first[e * stride] : 0;
    const int64_t end = e + 1 < E ? (stride ? first[(e + 1) * stride] : 0) : total;
    const int64_t kept = kept_slots(num_out, start, end - start);
    tokens_per_expert[e] = kept;
    offsets[e] = row;
    delta[e] = row - start;
    kept_end[e] = start + kept;
    row += aligned_rows(kept, align);
  }
  offsets[E] = row;
}

// hist (E-major, [E][chunks]) becomes each (expert, chunk)'s first position in the global sorted order; one
// thread then lays out the experts (E <= kMaxExpertsCuda keeps that serial pass short).
__global__ void moe_scan_kernel(int32_t* hist, int64_t E, int64_t chunks, int64_t num_out, int64_t align,
                                int64_t* tokens_per_expert, int64_t* offsets, int64_t* delta, int64_t* kept_end) {
  __shared__ int64_t warp_sums[32];
  wait_for_previous_grid();
  allow_next_grid();
  const int64_t total = block_exclusive_scan(hist, E * chunks, warp_sums);
  if (threadIdx.x == 0) expert_layout(hist, chunks, total, E, num_out, align, tokens_per_expert, offsets, delta, kept_end);
}

// Histogram tables of at most this many entries are laid out by every rank CTA itself (a warp per expert sums
// its row of the table, then two block scans over the experts), so that the scan kernel and its launch drop out.
constexpr int64_t kLayoutInRank = 2048;

// Rank of each slot among the slots of its expert (stable in slot order) -> its row, or -1. The layout comes
// from the scan kernel (`first`: the scanned table, delta, kept_end) or, with `in_cta`, from the raw table
// `first`, laid out here; then CTA 0 also writes tokens_per_expert and offsets.
__global__ void moe_rank_kernel(IntView ids, int64_t slots, int64_t T, int64_t K, int64_t E,
                                const int32_t* first, int64_t chunks, const int64_t* delta,
                                const int64_t* kept_end, bool in_cta, int64_t num_out, int64_t align,
                                int64_t* tokens_per_expert, int64_t* offsets, int32_t* row_id_map,
                                int32_t* src_token) {
  __shared__ alignas(16) int32_t chunk_ids[kChunk];
  __shared__ int64_t warp_sums[32];
  extern __shared__ int32_t layout[];  // in_cta: [4][E] slots before this chunk, first position, kept, first row
  int32_t *before = layout, *start = layout + E, *kept = layout + 2 * E, *row0 = layout + 3 * E;
  wait_for_previous_grid();
  allow_next_grid();
  const int64_t s = blockIdx.x * (int64_t)kChunk + threadIdx.x;
  int64_t e = s < slots ? ids[s] : -1;
  if (e < 0 || e >= E) e = -1;
  chunk_ids[threadIdx.x] = static_cast<int32_t>(e);
  if (in_cta) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int64_t x = warp; x < E; x += kChunk / 32) {
      int mine = 0, all = 0;
      for (int64_t c = lane; c < chunks; c += 32) {
        const int h = first[x * chunks + c];
        all += h;
        mine += c < static_cast<int64_t>(blockIdx.x) ? h : 0;
      }
      mine = warp_sum(mine);
      all = warp_sum(all);
      if (lane == 0) {
        before[x] = mine;
        start[x] = kept[x] = all;
      }
    }
    __syncthreads();
    block_exclusive_scan(start, E, warp_sums);
    for (int64_t x = threadIdx.x; x < E; x += kChunk) {
      kept[x] = static_cast<int32_t>(kept_slots(num_out, start[x], kept[x]));
      row0[x] = static_cast<int32_t>(aligned_rows(kept[x], align));
    }
    __syncthreads();
    const int64_t rows = block_exclusive_scan(row0, E, warp_sums);
    if (blockIdx.x == 0) {
      for (int64_t x = threadIdx.x; x < E; x += kChunk) {
        tokens_per_expert[x] = kept[x];
        offsets[x] = row0[x];
      }
      if (threadIdx.x == 0) offsets[E] = rows;
    }
  }
  __syncthreads();
  // Lanes of this warp before this one (a match over the whole warp), then the earlier warps' ids, four at a
  // time (every lane reads the same word: a broadcast).
  const unsigned peers = __match_any_sync(0xffffffffu, static_cast<int>(e));
  int32_t row = -1;
  if (e >= 0) {
    int64_t rank = __popc(peers & ((1u << (threadIdx.x & 31)) - 1));
    const int4* words = reinterpret_cast<const int4*>(chunk_ids);
    const int ie = static_cast<int>(e);
    for (int j = 0; j < static_cast<int>(threadIdx.x >> 5) * 8; ++j) {
      const int4 w = words[j];
      rank += (w.x == ie) + (w.y == ie) + (w.z == ie) + (w.w == ie);
    }
    const int64_t pos = in_cta ? start[e] + before[e] + rank : first[e * chunks + blockIdx.x] + rank;
    const int64_t end = in_cta ? start[e] + kept[e] : kept_end[e];
    if (pos < end) row = static_cast<int32_t>(pos + (in_cta ? row0[e] - start[e] : delta[e]));
  }
  if (s >= slots) return;
  const int64_t t = s / K, k = s % K;
  row_id_map[k * T + t] = row;
  if (row >= 0) src_token[row] = static_cast<int32_t>(t);
}

// Row copies in vectors of V elements: thread (x, y) of a block takes columns x, x + bx, ... of row y.
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

// Row r holds a kept copy iff it lies in [off[e], off[e] + kept[e]) of its expert e; then src[r] is set.
__device__ __forceinline__ bool kept_row(const int64_t* off, const int64_t* kept, int64_t E, int64_t r) {
  int64_t lo = 0, hi = E;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (off[mid + 1] <= r) lo = mid + 1;
    else hi = mid;
  }
  return lo < E && r >= off[lo] && r - off[lo] < kept[lo];
}

template <typename T, int V>
__global__ void moe_gather_rows_kernel(const T* __restrict__ x, const int32_t* __restrict__ src,
                                       const int64_t* offsets, const int64_t* kept, int64_t E, int64_t rows,
                                       int64_t tokens, int64_t cols, T* __restrict__ out) {
  using VT = Vec<T, V>;
  wait_for_previous_grid();
  for (int64_t r = blockIdx.x * (int64_t)blockDim.y + threadIdx.y; r < rows; r += (int64_t)gridDim.x * blockDim.y) {
    const int64_t t = kept_row(offsets, kept, E, r) ? src[r] : -1;
    VT* o = reinterpret_cast<VT*>(out + r * cols * V);
    if (t >= 0 && t < tokens) {
      const VT* in = reinterpret_cast<const VT*>(x + t * cols * V);
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) o[c] = in[c];
    } else {
      VT z;
#pragma unroll
      for (int i = 0; i < V; ++i) z.v[i] = T(0);
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) o[c] = z;
    }
  }
}

// Thread (x, y) of a block combines columns x + 2j·bx and x + (2j + 1)·bx of token row y: two loads in flight
// per thread (one left the kernel bound by the memory latency at its occupancy). ONE (K = 1) keeps no
// accumulators: its combine 0 + w·v is computed per loaded vector (the same bits), for fewer registers.
template <typename T, typename acc_t, int V, bool ONE>
__global__ void __launch_bounds__(256, ONE ? 5 : 4)
    moe_unpermute_kernel(const T* __restrict__ y, const int32_t* __restrict__ map, const acc_t* __restrict__ w,
                         int64_t T_, int64_t K, int64_t R, int64_t cols, T* __restrict__ out) {
  using VT = Vec<T, V>;
  const int64_t bx = blockDim.x;
  for (int64_t t = blockIdx.x * (int64_t)blockDim.y + threadIdx.y; t < T_; t += (int64_t)gridDim.x * blockDim.y) {
    VT* o = reinterpret_cast<VT*>(out + t * cols * V);
    for (int64_t c = threadIdx.x; c < cols; c += 2 * bx) {
      const bool second = c + bx < cols;
      VT o0, o1;
      if constexpr (ONE) {
        const int64_t r = map[t];
        const bool kept = r >= 0 && r < R;
        const acc_t wk = w && kept ? w[t] : acc_t(1);
        const VT* row = reinterpret_cast<const VT*>(y + (kept ? r : 0) * cols * V);
        VT v0, v1;
        if (kept) v0 = row[c];
        if (kept && second) v1 = row[c + bx];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          o0.v[i] = static_cast<T>(kept ? acc_t(0) + wk * static_cast<acc_t>(v0.v[i]) : acc_t(0));
          o1.v[i] = static_cast<T>(kept ? acc_t(0) + wk * static_cast<acc_t>(v1.v[i]) : acc_t(0));
        }
      } else {
        acc_t acc[2][V];
#pragma unroll
        for (int i = 0; i < V; ++i) acc[0][i] = acc[1][i] = acc_t(0);
        for (int64_t k = 0; k < K; ++k) {  // increasing k: the fixed combine order
          const int64_t r = map[k * T_ + t];
          if (r < 0 || r >= R) continue;
          const acc_t wk = w ? w[t * K + k] : acc_t(1);
          const VT* row = reinterpret_cast<const VT*>(y + r * cols * V);
          const VT v0 = row[c];
          VT v1;
          if (second) v1 = row[c + bx];
#pragma unroll
          for (int i = 0; i < V; ++i) acc[0][i] += wk * static_cast<acc_t>(v0.v[i]);
          if (second) {
#pragma unroll
            for (int i = 0; i < V; ++i) acc[1][i] += wk * static_cast<acc_t>(v1.v[i]);
          }
        }
#pragma unroll
        for (int i = 0; i < V; ++i) {
          o0.v[i] = static_cast<T>(acc[0][i]);
          o1.v[i] = static_cast<T>(acc[1][i]);
        }
      }
      o[c] = o0;
      if (second) o[c + bx] = o1;
    }
  }
}

// One CTA per token (grid-stride): d x_perm rows of its kept slots and, when asked, d probs by a fixed-order
// block reduction (bitwise reproducible).
template <typename T, typename acc_t, int V>
__global__ void moe_unpermute_bwd_kernel(const T* __restrict__ g, const T* __restrict__ y,
                                         const int32_t* __restrict__ map, const acc_t* __restrict__ w, int64_t T_,
                                         int64_t K, int64_t R, int64_t cols, T* __restrict__ grad_perm,
                                         acc_t* __restrict__ grad_probs) {
  using VT = Vec<T, V>;
  __shared__ acc_t partial[32];
  for (int64_t t = blockIdx.x; t < T_; t += gridDim.x) {
    const VT* gr = reinterpret_cast<const VT*>(g + t * cols * V);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = map[k * T_ + t];
      if (r < 0 || r >= R) {
        if (grad_probs && threadIdx.x == 0) grad_probs[t * K + k] = acc_t(0);
        continue;
      }
      const acc_t wk = w ? w[t * K + k] : acc_t(1);
      const VT* yr = reinterpret_cast<const VT*>(y + r * cols * V);
      VT* dr = reinterpret_cast<VT*>(grad_perm + r * cols * V);
      acc_t dot = 0;
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
        const VT gv = gr[c];
        VT o;
#pragma unroll
        for (int i = 0; i < V; ++i) o.v[i] = static_cast<T>(wk * static_cast<acc_t>(gv.v[i]));
        dr[c] = o;
        if (grad_probs) {
          const VT yv = yr[c];
#pragma unroll
          for (int i = 0; i < V; ++i) dot += static_cast<acc_t>(gv.v[i]) * static_cast<acc_t>(yv.v[i]);
        }
      }
      if (!grad_probs) continue;
      dot = warp_sum(dot);
      if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = dot;
      __syncthreads();
      if (threadIdx.x == 0) {
        acc_t sum = 0;
        for (int i = 0; i < (int)(blockDim.x >> 5); ++i) sum += partial[i];
        grad_probs[t * K + k] = sum;
      }
      __syncthreads();
    }
  }
}

// Elements per vector for rows of `cols` elements at `ptrs` (16 bytes when every row allows it, else 1).
template <typename T>
int vector_width(int64_t cols, std::initializer_list<const void*> ptrs) {
  constexpr int V = 16 / sizeof(T) > 0 ? 16 / sizeof(T) : 1;
  if (cols % V) return 1;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16) return 1;
  return V;
}

// Block shape for row kernels: x over a row's vectors (a warp multiple), y over rows; 256 threads.
dim3 row_block(int64_t vec_cols) {
  int bx = 32;
  while (bx < 256 && bx < vec_cols) bx *= 2;
  return dim3(bx, 256 / bx);
}

unsigned int row_grid(int64_t rows, const dim3& block) {
  return grid_for(rows, static_cast<int>(block.y));
}

template <typename T, int V>
void launch_gather(const at::Tensor& x, const int32_t* src, const at::Tensor& offsets, const at::Tensor& kept,
                   at::Tensor& out) {
  const int64_t cols = x.size(1) / V;
  const dim3 block = row_block(cols);
  launch_after_previous(moe_gather_rows_kernel<T, V>, dim3(row_grid(out.size(0), block)), block, 0,
                        at::cuda::getCurrentCUDAStream(), x.const_data_ptr<T>(), src,
                        offsets.const_data_ptr<int64_t>(), kept.const_data_ptr<int64_t>(), kept.numel(), out.size(0),
                        x.size(0), cols, out.mutable_data_ptr<T>());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_permute_cuda(const at::Tensor& x_in,
                                                                            const at::Tensor& expert_ids,
                                                                            int64_t E, int64_t num_out,
                                                                            int64_t align) {
  c10::cuda::CUDAGuard guard(x_in.device());
  const int64_t K = check_permute_args(x_in, expert_ids, E, num_out, align);
  SPTR_CHECK_VALUE(E <= kMaxExpertsCuda, "num_experts must be <= ", kMaxExpertsCuda, " on CUDA, got ", E);
  const at::Tensor x = x_in.contiguous(), ids = expert_ids.contiguous();
  const int64_t T = x.size(0), H = x.size(1), slots = T * K, chunks = (slots + kChunk - 1) / kChunk;
  const int64_t rows = permuted_rows(num_out, E, align);
  auto stream = at::cuda::getCurrentCUDAStream();
  auto idx = x.options().dtype(at::kLong);
  auto tokens_per_expert = at::empty({E}, idx), offsets = at::empty({E + 1}, idx);
  auto row_id_map = at::empty({slots}, x.options().dtype(at::kInt));
  auto x_perm = at::empty({rows, H}, x.options());
  // Scratch: the source token of every kept row and the histogram table, int32; per-expert delta / kept end.
  auto scratch32 = at::empty({rows + E * chunks}, x.options().dtype(at::kInt));
  int32_t* src = scratch32.mutable_data_ptr<int32_t>();
  int32_t* hist = src + rows;
  const IntView iv = int_view(ids);
  auto scratch64 = at::empty({2 * E}, idx);
  if (chunks > 0) {
    moe_count_kernel<<<chunks, kChunk, E * sizeof(int32_t), stream>>>(iv, slots, E, hist, chunks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const bool in_cta = chunks > 0 && E * chunks <= kLayoutInRank;
  if (!in_cta)
    launch_after_previous(moe_scan_kernel, dim3(1), dim3(kScanThreads), 0, stream, hist, E, chunks, num_out, align,
                          tokens_per_expert.mutable_data_ptr<int64_t>(), offsets.mutable_data_ptr<int64_t>(),
                          scratch64.mutable_data_ptr<int64_t>(), scratch64.mutable_data_ptr<int64_t>() + E);
  if (chunks > 0) {
    launch_after_previous(moe_rank_kernel, dim3(static_cast<unsigned>(chunks)), dim3(kChunk),
                          in_cta ? 4 * E * sizeof(int32_t) : 0, stream, iv, slots, T, K, E,
                          static_cast<const int32_t*>(hist), chunks, scratch64.const_data_ptr<int64_t>(),
                          scratch64.const_data_ptr<int64_t>() + E, in_cta, num_out, align,
                          tokens_per_expert.mutable_data_ptr<int64_t>(), offsets.mutable_data_ptr<int64_t>(),
                          row_id_map.mutable_data_ptr<int32_t>(), src);
  }
  if (rows > 0 && H > 0) {
    SPTR_DISPATCH_FLOATING(x.scalar_type(), "moe_permute_cuda", [&] {
      constexpr int V = 16 / sizeof(scalar_t);
      if (vector_width<scalar_t>(H, {x.const_data_ptr(), x_perm.const_data_ptr()}) == V)
        launch_gather<scalar_t, V>(x, src, offsets, tokens_per_expert, x_perm);
      else
        launch_gather<scalar_t, 1>(x, src, offsets, tokens_per_expert, x_perm);
    });
  }
  return {x_perm, row_id_map, tokens_per_expert, offsets};
}

at::Tensor moe_unpermute_fwd_cuda(const at::Tensor& x_perm, const at::Tensor& row_id_map,
                                  const c10::optional<at::Tensor>& probs, int64_t T) {
  c10::cuda::CUDAGuard guard(x_perm.device());
  const int64_t K = check_unpermute_args(x_perm, row_id_map, probs, T);
  const at::Tensor y = x_perm.contiguous(), map = row_id_map.contiguous(), w = combine_weights(probs, x_perm);
  const int64_t H = y.size(1), R = y.size(0);
  auto out = at::empty({T, H}, y.options());
  if (T == 0 || H == 0) return out;
  SPTR_DISPATCH_FLOATING(y.scalar_type(), "moe_unpermute_fwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t* wp = w.defined() ? w.const_data_ptr<acc_t>() : nullptr;
    auto run = [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      const int64_t cols = H / V;
      const dim3 block = row_block((cols + 1) / 2);
      auto kernel = K == 1 ? moe_unpermute_kernel<scalar_t, acc_t, V, true>
                           : moe_unpermute_kernel<scalar_t, acc_t, V, false>;
      kernel<<<row_grid(T, block), block, 0, at::cuda::getCurrentCUDAStream()>>>(
          y.const_data_ptr<scalar_t>(), map.const_data_ptr<int32_t>(), wp, T, K, R, cols,
          out.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    constexpr int V = 16 / sizeof(scalar_t);
    if (vector_width<scalar_t>(H, {y.const_data_ptr(), out.const_data_ptr()}) == V)
      run(std::integral_constant<int, V>());
    else
      run(std::integral_constant<int, 1>());
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> moe_unpermute_bwd_cuda(const at::Tensor& grad, const at::Tensor& x_perm,
                                                          const at::Tensor& row_id_map,
                                                          const c10::optional<at::Tensor>& probs, bool probs_grad) {
  c10::cuda::CUDAGuard guard(x_perm.device());
  const int64_t T = grad.size(0);
  const int64_t K = check_unpermute_args(x_perm, row_id_map, probs, T);
  SPTR_CHECK_VALUE(grad.dim() == 2 && grad.size(1) == x_perm.size(1), "grad must be [T, H] with H = ",
                    x_perm.size(1), ", got ", grad.sizes());
  SPTR_CHECK_SAME_DTYPE(grad, x_perm);
  SPTR_CHECK_SAME_DEVICE(grad, x_perm);
  const at::Tensor g = grad.contiguous(), y = x_perm.contiguous(), map = row_id_map.contiguous(),
                   w = combine_weights(probs, x_perm);
  const int64_t H = y.size(1), R = y.size(0);
  const bool want_pg = probs_grad && probs.has_value();
  auto grad_perm = at::zeros({R, H}, y.options());
  auto grad_probs = at::zeros({want_pg ? T : 0, want_pg ? K : 0},
                              y.options().dtype(y.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
  if (T == 0 || K == 0) return {grad_perm, grad_probs};
  SPTR_DISPATCH_FLOATING(y.scalar_type(), "moe_unpermute_bwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t* wp = w.defined() ? w.const_data_ptr<acc_t>() : nullptr;
    acc_t* pg = want_pg ? grad_probs.mutable_data_ptr<acc_t>() : nullptr;
    auto run = [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      moe_unpermute_bwd_kernel<scalar_t, acc_t, V><<<grid_for(T, 1), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
          g.const_data_ptr<scalar_t>(), y.const_data_ptr<scalar_t>(), map.const_data_ptr<int32_t>(), wp, T, K, R,
          H / V, grad_perm.mutable_data_ptr<scalar_t>(), pg);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    constexpr int V = 16 / sizeof(scalar_t);
    if (vector_width<scalar_t>(H, {g.const_data_ptr(), y.const_data_ptr(), grad_perm.const_data_ptr()}) == V)
      run(std::integral_constant<int, V>());
    else
      run(std::integral_constant<int, 1>());
  });
  return {grad_perm, grad_probs};
}

// Group widths travel as a kernel parameter (no host-to-device copy: capturable), the offsets are copied to
// shared memory; each row finds its group there.
constexpr int kSwigluGroups = 256;
struct GroupWidths {
  int32_t w[kSwigluGroups];
};

// Row r of group g (width w = widths[g]; none: w = 0), V elements per vector (V divides ld, W and every w).
// Forward: out [R, W] = silu(gate) · up over the row's w columns, zeros past them. Backward: out = dh [R, ld],
// the gate and up columns of a pair from one load of gate, up and grad (the row's other columns zero). The
// arithmetic per element is the scalar kernel's (V = 1), so both widths give the same bits.
template <typename T, int V, bool BACKWARD>
__global__ void moe_swiglu_kernel(const T* __restrict__ h, const T* __restrict__ grad, const int64_t* offsets,
                                  GroupWidths widths, int G, int64_t R, int64_t ld, int64_t W, T* __restrict__ out) {
  using acc_t = at::opmath_type<T>;
  using VT = Vec<T, V>;
  __shared__ int64_t off[kSwigluGroups + 1];
  for (int i = threadIdx.x + threadIdx.y * blockDim.x; i <= G; i += blockDim.x * blockDim.y) off[i] = offsets[i];
  __syncthreads();
  const int64_t cols = BACKWARD ? ld : W, step = int64_t(blockDim.x) * V;
  for (int64_t r = blockIdx.x * (int64_t)blockDim.y + threadIdx.y; r < R; r += (int64_t)gridDim.x * blockDim.y) {
    const int g = find_group(off, G, r);
    const int64_t w = g >= 0 ? widths.w[g] : 0;
    const T* hr = h + r * ld;
    T* o = out + r * cols;
    for (int64_t j = threadIdx.x * int64_t(V); j < w; j += step) {
      const VT gate = *reinterpret_cast<const VT*>(hr + j), up = *reinterpret_cast<const VT*>(hr + w + j);
      VT d, dgate, dup;
      if constexpr (BACKWARD) d = *reinterpret_cast<const VT*>(grad + r * W + j);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const acc_t x = static_cast<acc_t>(gate.v[i]), u = static_cast<acc_t>(up.v[i]);
        const acc_t sg = acc_t(1) / (acc_t(1) + exp(-x));
        if constexpr (!BACKWARD) {
          dgate.v[i] = static_cast<T>(x * sg * u);
        } else {
          const acc_t dd = static_cast<acc_t>(d.v[i]);
          dgate.v[i] = static_cast<T>(dd * u * sg * (acc_t(1) + x * (acc_t(1) - sg)));
          dup.v[i] = static_cast<T>(dd * x * sg);
        }
      }
      *reinterpret_cast<VT*>(o + j) = dgate;
      if constexpr (BACKWARD) *reinterpret_cast<VT*>(o + w + j) = dup;
    }
    VT zero;
#pragma unroll
    for (int i = 0; i < V; ++i) zero.v[i] = T(0);
    for (int64_t j = (BACKWARD ? 2 * w : w) + threadIdx.x * int64_t(V); j < cols; j += step)
      *reinterpret_cast<VT*>(o + j) = zero;
  }
}

at::Tensor swiglu_cuda(const at::Tensor* grad, const at::Tensor& h_in, const at::Tensor& offsets,
                       at::IntArrayRef widths) {
  c10::cuda::CUDAGuard guard(h_in.device());
  check_swiglu_args(h_in, offsets, widths);
  SPTR_CHECK_VALUE(static_cast<int64_t>(widths.size()) <= kSwigluGroups, "at most ", kSwigluGroups,
                    " groups on CUDA, got ", widths.size());
  const at::Tensor h = h_in.contiguous();
  const int64_t R = h.size(0), ld = h.size(1), W = max_width(widths);
  at::Tensor g;
  if (grad) {
    SPTR_CHECK_VALUE(grad->dim() == 2 && grad->size(0) == R && grad->size(1) == W, "grad must be [", R, ", ", W,
                      "], got ", grad->sizes());
    SPTR_CHECK_SAME_DTYPE((*grad), h);
    g = grad->contiguous();
  }
  auto out = at::empty({R, grad ? ld : W}, h.options());
  if (out.numel() == 0) return out;
  const at::Tensor off = offsets.contiguous();
  GroupWidths wid;
  for (size_t i = 0; i < widths.size(); ++i) wid.w[i] = static_cast<int32_t>(widths[i]);
  SPTR_DISPATCH_FLOATING(h.scalar_type(), "moe_swiglu_cuda", [&] {
    auto run = [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      const dim3 block = row_block((grad ? ld : W) / V);
      auto* kernel = grad ? moe_swiglu_kernel<scalar_t, V, true> : moe_swiglu_kernel<scalar_t, V, false>;
      kernel<<<row_grid(R, block), block, 0, at::cuda::getCurrentCUDAStream()>>>(
          h.const_data_ptr<scalar_t>(), grad ? g.const_data_ptr<scalar_t>() : nullptr, off.const_data_ptr<int64_t>(),
          wid, static_cast<int>(widths.size()), R, ld, W, out.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    constexpr int V = 16 / sizeof(scalar_t);
    bool wide = vector_width<scalar_t>(ld, {h.const_data_ptr(), out.const_data_ptr()}) == V &&
                vector_width<scalar_t>(W, {grad ? g.const_data_ptr() : out.const_data_ptr()}) == V;
    for (int64_t w : widths) wide = wide && w % V == 0;
    if (wide) run(std::integral_constant<int, V>());
    else run(std::integral_constant<int, 1>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(sptr, CUDA, m) {
  m.impl("moe_permute", &moe_permute_cuda);
  m.impl("moe_unpermute_fwd", &moe_unpermute_fwd_cuda);
  m.impl("moe_unpermute_bwd", &moe_unpermute_bwd_cuda);
  m.impl("moe_swiglu_fwd", [](const at::Tensor& h, const at::Tensor& off, at::IntArrayRef widths) {
    return swiglu_cuda(nullptr, h, off, widths);
  });
  m.impl("moe_swiglu_bwd", [](const at::Tensor& g, const at::Tensor& h, const at::Tensor& off,
                              at::IntArrayRef widths) { return swiglu_cuda(&g, h, off, widths); });
}

}  // namespace sptr
