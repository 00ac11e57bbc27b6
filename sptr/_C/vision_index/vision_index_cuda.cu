// Qwen2.5-VL index kernels. Vision grids: the per-grid table is built on the host (one small device-to-host
// copy when grid_thw lives on the GPU, none for host grids) and every output element is computed in closed
// form. rope_index: no host synchronisation; one block per row compacts the row, a scan of counts gives the
// global grid counters, then thread 0 walks the row's vision blocks and all threads fill positions.
#include <torch/library.h>

#include <sptr/cuda_utils.cuh>

#include "vision_index_host.h"

namespace sptr {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void rot_pos_emb_kernel(const int64_t* grids, int64_t n, int64_t merge, const T* inv_freq, int64_t F,
                                   int64_t tokens, T* out) {
  SPTR_GRID_STRIDE(e, tokens * F) {
    const int64_t p = e / F, j = e % F;
    const int64_t* g = grids + find_grid(grids, n, kTokenBase, p) * kGridColumns;
    const int64_t h = g[kHm] * merge, w = g[kWm] * merge;
    int64_t hp, wp;
    vision_patch_position((p - g[kTokenBase]) % (h * w), w, merge, hp, wp);
    out[p * 2 * F + j] = rotary_angle(hp, inv_freq[j]);
    out[p * 2 * F + F + j] = rotary_angle(wp, inv_freq[j]);
  }
}

__global__ void window_index_kernel(const int64_t* grids, int64_t n, int64_t window, int64_t unit, int64_t entries,
                                    int64_t windows, int32_t* index, int32_t* cu) {
  SPTR_GRID_STRIDE(e, entries) {
    const int64_t* g = grids + find_grid(grids, n, kEntryBase, e) * kGridColumns;
    const int64_t local = e - g[kEntryBase], hw = g[kHm] * g[kWm];
    index[window_slot(g, window, local / hw, (local % hw) / g[kWm], local % g[kWm])] = static_cast<int32_t>(e);
  }
  SPTR_GRID_STRIDE(w, windows) {
    const int64_t* g = grids + find_grid(grids, n, kWindowBase, w) * kGridColumns;
    const int64_t local = w - g[kWindowBase], per_frame = g[kWinRows] * g[kWinCols];
    cu[w + 1] = static_cast<int32_t>(
        window_end(g, window, local / per_frame, (local % per_frame) / g[kWinCols], local % g[kWinCols]) * unit);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) cu[0] = 0;
}

// Block-wide exclusive scan of one flag per thread; returns this thread's offset, `total` the block's sum.
__device__ int64_t block_exclusive_scan(int flag, int64_t* scratch, int64_t& total) {
  scratch[threadIdx.x] = flag;
  __syncthreads();
  for (int off = 1; off < blockDim.x; off *= 2) {
    const int64_t v = threadIdx.x >= off ? scratch[threadIdx.x - off] : 0;
    __syncthreads();
    scratch[threadIdx.x] += v;
    __syncthreads();
  }
  total = scratch[blockDim.x - 1];
  const int64_t inclusive = scratch[threadIdx.x];
  __syncthreads();
  return inclusive - flag;
}

// Row b: compacted ids x[b, :L], their slots valid[b, :L], and (L, n_img, n_vid) in info[b].
__global__ void rope_index_compact_kernel(const int64_t* ids, const int64_t* mask, int64_t S, RopeIndexConfig cfg,
                                          int64_t* x, int64_t* valid, int64_t* info) {
  __shared__ int64_t scratch[kThreads];
  __shared__ unsigned long long counts[2];
  const int64_t b = blockIdx.x;
  int64_t L = 0;
  for (int64_t start = 0; start < S; start += blockDim.x) {
    const int64_t i = start + threadIdx.x;
    const int flag = i < S && (!mask || mask[b * S + i] == 1);
    int64_t chunk;
    const int64_t at = L + block_exclusive_scan(flag, scratch, chunk);
    if (flag) {
      x[b * S + at] = ids[b * S + i];
      valid[b * S + at] = i;
    }
    L += chunk;
  }
  if (threadIdx.x < 2) counts[threadIdx.x] = 0;
  __syncthreads();
  const int64_t* row = x + b * S;
  for (int64_t i = threadIdx.x; i < L; i += blockDim.x) {
    if (starts_block(row, L, i, cfg.vision_start_token, cfg.image_token)) atomicAdd(&counts[0], 1ull);
    if (starts_block(row, L, i, cfg.vision_start_token, cfg.video_token)) atomicAdd(&counts[1], 1ull);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    info[3 * b] = L;
    info[3 * b + 1] = static_cast<int64_t>(counts[0]);
    info[3 * b + 2] = static_cast<int64_t>(counts[1]);
  }
}

__global__ void rope_index_fill_kernel(const int64_t* x, const int64_t* valid, const int64_t* info,
                                       const int64_t* first_image, const int64_t* first_video, int64_t B, int64_t S,
                                       RopeIndexConfig cfg, VisionBlock* blocks, int64_t* pos, int64_t* delta) {
  __shared__ int64_t nb, tail_st, tail_nxt;
  __shared__ long long row_max;
  const int64_t b = blockIdx.x, L = info[3 * b];
  const int64_t* row = x + b * S;
  VisionBlock* row_blocks = blocks + b * (S / 2 + 1);
  if (threadIdx.x == 0) {
    nb = rope_index_walk(row, L, info[3 * b + 1], info[3 * b + 2], first_image[b], first_video[b], cfg, row_blocks,
                         tail_st, tail_nxt);
    row_max = L ? LLONG_MIN : 1;
  }
  for (int64_t i = threadIdx.x; i < S; i += blockDim.x)
    for (int c = 0; c < 3; ++c) pos[(c * B + b) * S + i] = 1;
  __syncthreads();
  long long local_max = LLONG_MIN;
  for (int64_t i = threadIdx.x; i < L; i += blockDim.x) {
    int64_t p3[3];
    rope_index_position(cfg, row_blocks, nb, tail_st, tail_nxt, i, p3);
    for (int c = 0; c < 3; ++c) {
      pos[(c * B + b) * S + valid[b * S + i]] = p3[c];
      local_max = p3[c] > local_max ? p3[c] : local_max;
    }
  }
  atomicMax(&row_max, local_max);
  __syncthreads();
  if (threadIdx.x == 0) delta[b] = row_max + 1 - S;
}

at::Tensor device_table(const GridTable& t, const at::Device& device) {
  return t.rows.to(device, /*non_blocking=*/false);
}

}  // namespace

at::Tensor vision_rot_pos_emb_cuda(const at::Tensor& inv_freq, const at::Tensor& grid_thw, int64_t merge) {
  c10::cuda::CUDAGuard guard(inv_freq.device());
  check_inv_freq(inv_freq);
  SPTR_CHECK_VALUE(inv_freq.is_cuda(), "inv_freq must be on the GPU for the CUDA kernel");
  const GridTable t = grid_table(grid_thw, merge, 0, /*need_divisible=*/true);
  const int64_t F = inv_freq.size(0);
  auto out = at::empty({t.tokens, 2 * F}, inv_freq.options());
  if (out.numel() == 0) return out;
  auto rows = device_table(t, inv_freq.device());
  auto freq = inv_freq.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, inv_freq.scalar_type(), "rot_pos_emb", [&] {
    rot_pos_emb_kernel<scalar_t><<<grid_for(t.tokens * F, kThreads), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        rows.const_data_ptr<int64_t>(), t.n, merge, freq.const_data_ptr<scalar_t>(), F, t.tokens,
        out.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> vision_window_index_cuda(const at::Tensor& grid_thw, int64_t merge, int64_t window,
                                                            int64_t unit) {
  c10::cuda::CUDAGuard guard(grid_thw.device());
  SPTR_CHECK_VALUE(window > 0, "window size (vit_merger_window_size) must be positive, got ", window);
  const GridTable t = grid_table(grid_thw, merge, window, /*need_divisible=*/false);
  auto opts = grid_thw.options().dtype(at::kInt);
  auto index = at::empty({t.entries}, opts), cu = at::empty({t.windows + 1}, opts);
  auto rows = device_table(t, grid_thw.device());
  window_index_kernel<<<grid_for(std::max(t.entries, t.windows), kThreads), kThreads, 0,
                        at::cuda::getCurrentCUDAStream()>>>(rows.const_data_ptr<int64_t>(), t.n, window, unit,
                                                            t.entries, t.windows, index.mutable_data_ptr<int32_t>(),
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
  auto x = at::empty({B, S}, opts), valid = at::empty({B, S}, opts), info = at::empty({B, 3}, opts);
  const int64_t block_slots = S / 2 + 1;
  auto blocks = at::empty({B * block_slots * static_cast<int64_t>(sizeof(VisionBlock) / sizeof(int64_t))}, opts);
  auto stream = at::cuda::getCurrentCUDAStream();
  rope_index_compact_kernel<<<B, kThreads, 0, stream>>>(in.ids.const_data_ptr<int64_t>(),
                                                       in.mask.defined() ? in.mask.const_data_ptr<int64_t>() : nullptr,
                                                       S, in.cfg, x.mutable_data_ptr<int64_t>(),
                                                       valid.mutable_data_ptr<int64_t>(), info.mutable_data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Grid counters run over the whole batch: exclusive prefix sums of the per-row image / video counts.
  auto img = info.select(1, 1), vid = info.select(1, 2);
  auto first_image = (at::cumsum(img, 0) - img).contiguous(), first_video = (at::cumsum(vid, 0) - vid).contiguous();
  rope_index_fill_kernel<<<B, kThreads, 0, stream>>>(
      x.const_data_ptr<int64_t>(), valid.const_data_ptr<int64_t>(), info.const_data_ptr<int64_t>(),
      first_image.const_data_ptr<int64_t>(), first_video.const_data_ptr<int64_t>(), B, S, in.cfg,
      reinterpret_cast<VisionBlock*>(blocks.mutable_data_ptr<int64_t>()), pos.mutable_data_ptr<int64_t>(),
      delta.mutable_data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {pos, delta};
}

TORCH_LIBRARY_IMPL(sptr, CUDA, m) {
  m.impl("rope_index", &rope_index_cuda);
  m.impl("vision_rot_pos_emb", &vision_rot_pos_emb_cuda);
  m.impl("vision_window_index", &vision_window_index_cuda);
}

}  // namespace sptr
