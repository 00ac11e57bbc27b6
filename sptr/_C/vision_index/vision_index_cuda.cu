// Qwen2.5-VL index kernels, one launch each and no host synchronisation once the output sizes are known.
// Vision grids: every CTA builds the per-grid table (prefix sums over the grids) in shared memory from the
// device grid_thw, then computes its output elements in closed form. rope_index: one CTA per row compacts
// the row and counts its vision blocks, takes the global grid counters from the rows before it (decoupled
// look-back over published counts, or after a grid-wide barrier), then thread 0 walks the row's blocks and all
// threads fill positions.
#include <array>
#include <mutex>

#include <cooperative_groups.h>

#include <torch/library.h>

#include <sptr/cuda_utils.cuh>

#include "vision_index_host.h"

namespace sptr {
namespace {

constexpr int kThreads = 256;

constexpr int64_t kMaxSharedGrids = (48 * 1024 / 8 - 3) / kGridColumns;  // larger tables go to global memory

// The per-grid table of vision_index_math.h from grid_thw, written by warp 0 of the calling CTA (a warp
// scan per 32 grids); totals = (entries, windows, tokens). Negative sizes count as 0, so unchecked input
// stays memory-safe. The caller synchronises before reading it.
__device__ void build_grid_table(IntView grid, int64_t n, int64_t merge, int64_t window, int64_t* table,
                                 int64_t* totals) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  int64_t carry[3] = {0, 0, 0};
  for (int64_t start = 0; start < n; start += 32) {
    const int64_t i = start + lane;
    int64_t row[kGridColumns] = {}, count[3] = {0, 0, 0};
    if (i < n)
      grid_row_sizes(max(grid[3 * i], int64_t(0)), max(grid[3 * i + 1], int64_t(0)), max(grid[3 * i + 2], int64_t(0)),
                     merge, window, row, count);
    int64_t inclusive[3] = {count[0], count[1], count[2]};
    for (int off = 1; off < 32; off *= 2)
      for (int c = 0; c < 3; ++c) {
        const int64_t v = __shfl_up_sync(0xffffffffu, inclusive[c], off);
        if (lane >= off) inclusive[c] += v;
      }
    if (i < n) {
      row[kEntryBase] = carry[0] + inclusive[0] - count[0];
      row[kWindowBase] = carry[1] + inclusive[1] - count[1];
      row[kTokenBase] = carry[2] + inclusive[2] - count[2];
      for (int c = 0; c < kGridColumns; ++c) table[i * kGridColumns + c] = row[c];
    }
    for (int c = 0; c < 3; ++c) carry[c] += __shfl_sync(0xffffffffu, inclusive[c], 31);
  }
  if (lane == 0)
    for (int c = 0; c < 3; ++c) totals[c] = carry[c];
}

// Where a kernel's grid table lives: built per CTA in shared memory, or (past kMaxSharedGrids grids) once in
// global memory by grid_table_kernel before the main launch.
struct GridSource {
  IntView grid;
  int64_t n, merge, window;
  int64_t* global;  // [n * kGridColumns + 3] built beforehand, or null
};

__device__ const int64_t* grid_table_for(const GridSource& src, int64_t* shared) {
  int64_t* table = src.global ? src.global : shared;
  if (!src.global) build_grid_table(src.grid, src.n, src.merge, src.window, table, table + src.n * kGridColumns);
  __syncthreads();
  return table;
}

__global__ void grid_table_kernel(GridSource src) {
  build_grid_table(src.grid, src.n, src.merge, src.window, src.global, src.global + src.n * kGridColumns);
}

// Rows p >= the grid's patch count (num_tokens larger than the grid) are zero.
template <typename T>
__global__ void rot_pos_emb_kernel(GridSource src, const T* inv_freq, int64_t F, int64_t tokens, T* out) {
  extern __shared__ int64_t shared_table[];
  const int64_t* grids = grid_table_for(src, shared_table);
  const int64_t total = grids[src.n * kGridColumns + 2], merge = src.merge;
  SPTR_GRID_STRIDE(e, tokens * F) {
    const int64_t p = e / F, j = e % F;
    if (p >= total) {
      out[p * 2 * F + j] = out[p * 2 * F + F + j] = T(0);
      continue;
    }
    const int64_t* g = grids + find_grid(grids, src.n, kTokenBase, p) * kGridColumns;
    const int64_t h = g[kHm] * merge, w = g[kWm] * merge;
    int64_t hp, wp;
    vision_patch_position((p - g[kTokenBase]) % (h * w), w, merge, hp, wp);
    out[p * 2 * F + j] = rotary_angle(hp, inv_freq[j]);
    out[p * 2 * F + F + j] = rotary_angle(wp, inv_freq[j]);
  }
}

// entries / offsets: the allocated lengths. Entries past the grid's (num_tokens larger than the grid) map to
// themselves; offsets past its windows repeat the total (empty windows).
__global__ void window_index_kernel(GridSource src, int64_t unit, int64_t entries, int64_t offsets, int32_t* index,
                                    int32_t* cu) {
  extern __shared__ int64_t shared_table[];
  const int64_t* grids = grid_table_for(src, shared_table);
  const int64_t total = grids[src.n * kGridColumns], windows = grids[src.n * kGridColumns + 1];
  const int64_t window = src.window;
  SPTR_GRID_STRIDE(e, entries) {
    if (e >= total) {
      index[e] = static_cast<int32_t>(e);
      continue;
    }
    const int64_t* g = grids + find_grid(grids, src.n, kEntryBase, e) * kGridColumns;
    const int64_t local = e - g[kEntryBase], hw = g[kHm] * g[kWm];
    const int64_t slot = window_slot(g, window, local / hw, (local % hw) / g[kWm], local % g[kWm]);
    if (slot >= 0 && slot < entries) index[slot] = static_cast<int32_t>(e);
  }
  SPTR_GRID_STRIDE(w, offsets - 1) {
    if (w >= windows) {
      cu[w + 1] = static_cast<int32_t>(min(total, entries) * unit);
      continue;
    }
    const int64_t* g = grids + find_grid(grids, src.n, kWindowBase, w) * kGridColumns;
    const int64_t local = w - g[kWindowBase], per_frame = g[kWinRows] * g[kWinCols];
    cu[w + 1] = static_cast<int32_t>(
        window_end(g, window, local / per_frame, (local % per_frame) / g[kWinCols], local % g[kWinCols]) * unit);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) cu[0] = 0;
}

constexpr int kRowThreads = 1024;  // rope_index: one CTA per row
constexpr int kRowWarps = kRowThreads / 32;
constexpr int kNone = INT_MAX;  // "no such token" in the suffix minima (row positions are < S < 2^31)

__device__ __forceinline__ int shfl_up(int v, int off) { return __shfl_up_sync(0xffffffffu, v, off); }
__device__ __forceinline__ int2 shfl_up(int2 v, int off) {
  return make_int2(__shfl_up_sync(0xffffffffu, v.x, off), __shfl_up_sync(0xffffffffu, v.y, off));
}
__device__ __forceinline__ int shfl(int v, int lane) { return __shfl_sync(0xffffffffu, v, lane); }
__device__ __forceinline__ int2 shfl(int2 v, int lane) {
  return make_int2(__shfl_sync(0xffffffffu, v.x, lane), __shfl_sync(0xffffffffu, v.y, lane));
}

struct SumOp {
  __device__ int operator()(int a, int b) const { return a + b; }
};
struct MinPairOp {  // the next image (x) and video (y) token: two minima in one scan
  __device__ int2 operator()(int2 a, int2 b) const { return make_int2(min(a.x, b.x), min(a.y, b.y)); }
};

// Block-wide inclusive scan (in thread order) of one value per thread: warp shuffles, the warp totals through
// shared memory, then every warp scans the totals itself; one barrier. `total` = the block's reduction.
// `warp_totals` holds kRowWarps values; consecutive scans must alternate between two such buffers (a warp may
// still read this scan's totals while another writes the next scan's: the one after that is past a barrier).
template <class V, class Op>
__device__ V block_inclusive_scan(V v, Op op, V* warp_totals, V& total) {
  static_assert(kRowWarps <= 32, "one warp scans the warp totals");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int off = 1; off < 32; off *= 2) {
    const V y = shfl_up(v, off);
    if (lane >= off) v = op(v, y);
  }
  if (lane == 31) warp_totals[warp] = v;
  __syncthreads();
  V w = warp_totals[lane < kRowWarps ? lane : kRowWarps - 1];
  for (int off = 1; off < kRowWarps; off *= 2) {
    const V y = shfl_up(w, off);
    if (lane >= off) w = op(w, y);
  }
  const V before = shfl(w, warp > 0 ? warp - 1 : 0);
  if (warp > 0) v = op(v, before);
  total = shfl(w, kRowWarps - 1);
  return v;
}

// Published block counts of one row for the look-back: bit 63 = ready, bits 32..62 videos, 0..31 images.
constexpr unsigned long long kReady = 1ull << 63;

// One CTA per row. The row is compacted (ids x, slots valid), its image / video blocks counted and published in
// status[b]; the global grid counters at its start are the sums of the counts of rows < b. kGridSync: a
// cooperative launch (every row's CTA resident at once), row b = CTA b, and the counts are read after a
// grid-wide barrier, so status needs no zeroing (which would be a second launch). Otherwise rows are taken in
// launch order through `ticket` (a CTA only waits for rows whose CTAs already run, so the look-back cannot
// deadlock), and status and ticket start zeroed. A suffix-min scan gives every position its next image and
// video token, so thread 0's walk over the row's blocks does O(1) work per block; then all threads fill the
// positions. The row's arrays (x, valid, next image, next video: S words each, then S / 2 + 1 blocks, then the
// row's grids and seconds: S / 2 + 1 slots of four words) live in dynamic shared memory when `row_in_shared`
// (the walk and the fills then read on-chip memory only, not L2), else in the global scratch (x, valid [B, S],
// next [2, B, S], blocks; the walk then reads the grids where they are).
template <bool kGridSync>
__global__ void __launch_bounds__(kRowThreads) rope_index_kernel(
    const int64_t* ids, const int64_t* mask, int64_t B, int64_t S, RopeIndexConfig cfg, int64_t* x, int64_t* valid,
    int64_t* next, unsigned long long* status, unsigned int* ticket, VisionBlock* blocks, int64_t* pos,
    int64_t* delta, bool row_in_shared) {
  extern __shared__ int64_t row_shared[];
  __shared__ int count_totals[2][kRowWarps];
  __shared__ int2 next_totals[2][kRowWarps];
  __shared__ unsigned long long counts[2], before[2];
  __shared__ int64_t row_index, nb, tail_st, tail_nxt;
  __shared__ long long row_max;
  if (threadIdx.x == 0) row_index = kGridSync ? blockIdx.x : atomicAdd(ticket, 1u);
  if (threadIdx.x < 2) counts[threadIdx.x] = before[threadIdx.x] = 0;
  __syncthreads();
  const int64_t b = row_index, block_slots = S / 2 + 1;
  int64_t* const row = row_in_shared ? row_shared : x + b * S;
  int64_t* const slots = row_in_shared ? row_shared + S : valid + b * S;
  int64_t* const next_img = row_in_shared ? row_shared + 2 * S : next + b * S;
  int64_t* const next_vid = row_in_shared ? row_shared + 3 * S : next + (B + b) * S;
  VisionBlock* const row_blocks =
      row_in_shared ? reinterpret_cast<VisionBlock*>(row_shared + 4 * S) : blocks + b * block_slots;
  // Compaction; a masked position's three positions are 1 (the others are written by the fill at the end).
  int L = 0, parity = 0;
  for (int64_t start = 0; start < S; start += blockDim.x, parity ^= 1) {
    const int64_t i = start + threadIdx.x;
    const bool inside = i < S, flag = inside && (!mask || mask[b * S + i] == 1);
    int chunk;
    const int at = L + block_inclusive_scan(int(flag), SumOp(), count_totals[parity], chunk) - flag;
    if (flag) {
      row[at] = ids[b * S + i];
      slots[at] = i;
    } else if (inside) {
      for (int c = 0; c < 3; ++c) pos[(c * B + b) * S + i] = 1;
    }
    L += chunk;
  }
  __syncthreads();
  // Suffix minima from the row's end, one chunk at a time: thread t takes position end - 1 - t, so the scan
  // in thread order runs backwards over positions; images and videos in one scan.
  int2 carry = make_int2(kNone, kNone);
  parity = 0;
  for (int end = L; end > 0; end -= blockDim.x, parity ^= 1) {
    const int i = end - 1 - static_cast<int>(threadIdx.x);
    const int64_t id = i >= 0 ? row[i] : 0;
    const int2 mine =
        make_int2(i >= 0 && id == cfg.image_token ? i : kNone, i >= 0 && id == cfg.video_token ? i : kNone);
    int2 total;
    const int2 found = block_inclusive_scan(mine, MinPairOp(), next_totals[parity], total);
    if (i >= 0) {
      next_img[i] = min(found.x, carry.x);
      next_vid[i] = min(found.y, carry.y);
      if (starts_block(row, L, i, cfg.vision_start_token, cfg.image_token)) atomicAdd(&counts[0], 1ull);
      if (starts_block(row, L, i, cfg.vision_start_token, cfg.video_token)) atomicAdd(&counts[1], 1ull);
    }
    carry = MinPairOp()(carry, total);
  }
  __syncthreads();
  if (threadIdx.x == 0) atomicExch(&status[b], kReady | (counts[1] << 32) | counts[0]);
  if constexpr (kGridSync) cooperative_groups::this_grid().sync();
  // Look-back: every earlier row's published counts, read in parallel.
  unsigned long long img = 0, vid = 0;
  for (int64_t r = threadIdx.x; r < b; r += blockDim.x) {
    unsigned long long v;
    while (!((v = *reinterpret_cast<volatile unsigned long long*>(&status[r])) & kReady)) {
      // never spins after the grid barrier
    }
    img += v & 0xffffffffull;
    vid += (v >> 32) & 0x7fffffffull;
  }
  if (img) atomicAdd(&before[0], img);
  if (vid) atomicAdd(&before[1], vid);
  __syncthreads();  // next_* (written by other threads) and before[] are complete
  // The walk takes images before[0] .. before[0] + counts[0] - 1 (videos likewise): with the row in shared
  // memory, their grids and seconds are copied next to it in parallel first, and the walk and the fill index
  // those copies from 0, so that thread 0's walk waits on no global load.
  RopeIndexConfig local = cfg;
  int64_t gi = static_cast<int64_t>(before[0]), gv = static_cast<int64_t>(before[1]);
  if (row_in_shared) {
    const int64_t ni = max(int64_t(0), min(cfg.n_image - gi, static_cast<int64_t>(counts[0])));
    const int64_t nv = max(int64_t(0), min(cfg.n_video - gv, static_cast<int64_t>(counts[1])));
    int64_t* const grids = reinterpret_cast<int64_t*>(row_blocks + block_slots);
    for (int64_t j = threadIdx.x; j < 3 * (ni + nv); j += blockDim.x)
      grids[j] = j < 3 * ni ? cfg.image_grid[3 * gi + j] : cfg.video_grid[3 * gv + j - 3 * ni];
    void* const seconds = grids + 3 * (ni + nv);
    for (int64_t j = threadIdx.x; j < nv; j += blockDim.x) {
      if (cfg.sec64) static_cast<double*>(seconds)[j] = cfg.sec64[gv + j];
      else if (cfg.sec32) static_cast<float*>(seconds)[j] = cfg.sec32[gv + j];
    }
    local.image_grid = grids;
    local.n_image = ni;
    local.video_grid = grids + 3 * ni;
    local.n_video = nv;
    if (cfg.sec64) local.sec64 = static_cast<const double*>(seconds);
    if (cfg.sec32) local.sec32 = static_cast<const float*>(seconds);
    gi = gv = 0;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const auto next_token = [&](int64_t from, bool video) {
      if (from >= L) return INT64_MAX;
      const int64_t n = (video ? next_vid : next_img)[from];
      return n == kNone ? INT64_MAX : n;
    };
    nb = rope_index_walk(next_token, static_cast<int64_t>(counts[0]), static_cast<int64_t>(counts[1]), gi, gv,
                         local, row_blocks, tail_st, tail_nxt);
    row_max = L ? LLONG_MIN : 1;
  }
  __syncthreads();
  long long local_max = LLONG_MIN;
  for (int64_t i = threadIdx.x; i < L; i += blockDim.x) {
    int64_t p3[3];
    rope_index_position(local, row_blocks, nb, tail_st, tail_nxt, i, p3);
    for (int c = 0; c < 3; ++c) {
      pos[(c * B + b) * S + slots[i]] = p3[c];
      local_max = p3[c] > local_max ? p3[c] : local_max;
    }
  }
  atomicMax(&row_max, local_max);
  __syncthreads();
  if (threadIdx.x == 0) delta[b] = row_max + 1 - S;
}

// Dynamic shared memory that rope_index_kernel may take on this device: the opt-in maximum, raised once per
// device (a function attribute, not a stream operation: nothing to redo inside a CUDA graph capture).
int64_t rope_index_shared_limit() {
  static std::array<std::once_flag, 64> raised;
  static std::array<int64_t, 64> limit{};
  const int device = c10::cuda::current_device();
  if (device >= static_cast<int>(raised.size())) return 0;
  std::call_once(raised[device], [&] {
    const auto* props = at::cuda::getCurrentDeviceProperties();
    const int64_t bytes = static_cast<int64_t>(props->sharedMemPerBlockOptin) - 1024;  // static shared memory
    for (const void* kernel : {reinterpret_cast<const void*>(rope_index_kernel<true>),
                               reinterpret_cast<const void*>(rope_index_kernel<false>)})
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
    limit[device] = bytes;
  });
  return limit[device];
}

// The grid table's place for a launch: shared memory of every CTA, or a global buffer built by one extra
// launch for tables past kMaxSharedGrids grids.
GridSource grid_source(const at::Tensor& grid, int64_t merge, int64_t window, at::Tensor& global, size_t& shared) {
  GridSource src{int_view(grid), grid.size(0), merge, window, nullptr};
  const int64_t words = src.n * kGridColumns + 3;
  shared = 0;
  if (src.n <= kMaxSharedGrids) {
    shared = static_cast<size_t>(words) * sizeof(int64_t);
    return src;
  }
  global = at::empty({words}, grid.options().dtype(at::kLong));
  src.global = global.mutable_data_ptr<int64_t>();
  grid_table_kernel<<<1, 32, 0, at::cuda::getCurrentCUDAStream()>>>(src);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return src;
}

// grid_thw on the kernel's device without a host sync (a host grid is copied asynchronously).
at::Tensor device_grid(const at::Tensor& grid_thw, const at::Device& device) {
  return grid_thw.to(device, /*non_blocking=*/true).contiguous();
}

}  // namespace

at::Tensor vision_rot_pos_emb_cuda(const at::Tensor& inv_freq, const at::Tensor& grid_thw, int64_t merge,
                                   std::optional<int64_t> num_tokens) {
  c10::cuda::CUDAGuard guard(inv_freq.device());
  check_inv_freq(inv_freq);
  SPTR_CHECK_VALUE(inv_freq.is_cuda(), "inv_freq must be on the GPU for the CUDA kernel");
  const VisionSizes z = vision_sizes(grid_thw, merge, 0, /*need_divisible=*/true, num_tokens);
  const int64_t F = inv_freq.size(0);
  auto out = at::empty({z.tokens, 2 * F}, inv_freq.options());
  if (out.numel() == 0) return out;
  auto grid = device_grid(grid_thw, inv_freq.device());
  auto freq = inv_freq.contiguous();
  at::Tensor global;
  size_t shared;
  const GridSource src = grid_source(grid, merge, 0, global, shared);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, inv_freq.scalar_type(), "rot_pos_emb", [&] {
    rot_pos_emb_kernel<scalar_t><<<grid_for(z.tokens * F, kThreads), kThreads, shared,
                                   at::cuda::getCurrentCUDAStream()>>>(src, freq.const_data_ptr<scalar_t>(), F,
                                                                       z.tokens, out.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> vision_window_index_cuda(const at::Tensor& grid_thw, int64_t merge, int64_t window,
                                                            int64_t unit, std::optional<int64_t> num_tokens) {
  c10::cuda::CUDAGuard guard(grid_thw.device());
  SPTR_CHECK_VALUE(window > 0, "window size (vit_merger_window_size) must be positive, got ", window);
  const VisionSizes z = vision_sizes(grid_thw, merge, window, /*need_divisible=*/false, num_tokens);
  check_window_unit(unit, z.entries);
  auto opts = grid_thw.options().dtype(at::kInt);
  auto index = at::empty({z.entries}, opts), cu = at::empty({z.offsets}, opts);
  auto grid = grid_thw.contiguous();
  at::Tensor global;
  size_t shared;
  const GridSource src = grid_source(grid, merge, window, global, shared);
  window_index_kernel<<<grid_for(std::max(z.entries, z.offsets), kThreads), kThreads, shared,
                        at::cuda::getCurrentCUDAStream()>>>(src, unit, z.entries, z.offsets,
                                                            index.mutable_data_ptr<int32_t>(),
                                                            cu.mutable_data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {index, cu};
}

std::tuple<at::Tensor, at::Tensor> rope_index_cuda(const at::Tensor& input_ids, const std::optional<at::Tensor>& image_grid_thw,
                                                   const std::optional<at::Tensor>& video_grid_thw,
                                                   const std::optional<at::Tensor>& second_per_grid_ts,
                                                   const std::optional<at::Tensor>& attention_mask, int64_t merge,
                                                   int64_t image_token, int64_t video_token, int64_t vision_start,
                                                   double tokens_per_second) {
  c10::cuda::CUDAGuard guard(input_ids.device());
  RopeIndexInputs in = rope_index_inputs(input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts,
                                         attention_mask, merge, image_token, video_token, vision_start,
                                         tokens_per_second);
  if (!in.vision) return rope_index_text_only(in);
  const int64_t B = in.ids.size(0), S = in.ids.size(1);
  auto opts = in.ids.options();
  auto pos = at::empty({3, B, S}, opts), delta = at::empty({B, 1}, opts);
  if (B == 0) return {pos, delta};
  SPTR_CHECK_VALUE(B < (int64_t(1) << 31), "input_ids has too many rows for the CUDA kernel: ", B);
  SPTR_CHECK_VALUE(S < INT_MAX, "input_ids has too many columns for the CUDA kernel: ", S);
  // Up to one row per SM the rows' CTAs are resident together (one CTA of kRowThreads fits an SM whenever the
  // kernel fits at all): a cooperative launch, whose grid barrier replaces the zeroed look-back flags and so
  // the fill before the kernel. More rows: the look-back over flags zeroed by one fill.
  const bool grid_sync = B <= at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // B published counts and the row ticket
  auto status = grid_sync ? at::empty({B + 1}, opts) : at::zeros({B + 1}, opts);
  auto* st = reinterpret_cast<unsigned long long*>(status.mutable_data_ptr<int64_t>());
  // Per row: x, valid, next image, next video (S words each), the blocks, the row's grids and seconds.
  const int64_t block_slots = S / 2 + 1;
  const int64_t row_bytes = (4 * S + 4 * block_slots) * static_cast<int64_t>(sizeof(int64_t)) +
                            block_slots * static_cast<int64_t>(sizeof(VisionBlock));
  const bool row_in_shared = row_bytes <= rope_index_shared_limit();
  // Global scratch only for rows too long for shared memory.
  at::Tensor x, valid, next, blocks;
  if (!row_in_shared) {
    x = at::empty({B, S}, opts);
    valid = at::empty({B, S}, opts);
    next = at::empty({2, B, S}, opts);
    blocks = at::empty({B * block_slots * static_cast<int64_t>(sizeof(VisionBlock) / sizeof(int64_t))}, opts);
  }
  const auto ptr = [](at::Tensor& t) { return t.defined() ? t.mutable_data_ptr<int64_t>() : nullptr; };
  cudaLaunchAttribute cooperative{};
  cooperative.id = cudaLaunchAttributeCooperative;
  cooperative.val.cooperative = 1;
  launch_with(grid_sync ? &cooperative : nullptr, grid_sync ? rope_index_kernel<true> : rope_index_kernel<false>,
              dim3(static_cast<unsigned>(B)), dim3(kRowThreads), row_in_shared ? static_cast<size_t>(row_bytes) : 0,
              at::cuda::getCurrentCUDAStream(), in.ids.const_data_ptr<int64_t>(),
              in.mask.defined() ? in.mask.const_data_ptr<int64_t>() : nullptr, B, S, in.cfg, ptr(x), ptr(valid),
              ptr(next), st, reinterpret_cast<unsigned int*>(st + B), reinterpret_cast<VisionBlock*>(ptr(blocks)),
              pos.mutable_data_ptr<int64_t>(), delta.mutable_data_ptr<int64_t>(), row_in_shared);
  return {pos, delta};
}

TORCH_LIBRARY_IMPL(sptr, CUDA, m) {
  m.impl("rope_index", &rope_index_cuda);
  m.impl("vision_rot_pos_emb", &vision_rot_pos_emb_cuda);
  m.impl("vision_window_index", &vision_window_index_cuda);
}

}  // namespace sptr
