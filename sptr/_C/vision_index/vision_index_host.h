// Host-side checks and tables of the Qwen2.5-VL index ops, shared by the CPU and CUDA implementations.
#pragma once
#include <sptr/checks.h>

#include "vision_index_math.h"

namespace sptr {

inline void check_grid_thw(const at::Tensor& grid_thw, int64_t merge) {
  SPTR_CHECK_VALUE(grid_thw.dim() == 2 && grid_thw.size(1) == 3, "grid_thw must be [num_grids, 3], got ",
                    grid_thw.sizes());
  SPTR_CHECK_TYPE(grid_thw.scalar_type() == at::kInt || grid_thw.scalar_type() == at::kLong,
                   "grid_thw must be int32 or int64, got ", grid_thw.scalar_type());
  SPTR_CHECK_VALUE(merge > 0, "spatial_merge_size must be positive, got ", merge);
}

// The per-grid table of vision_index_math.h, on the host (needs grid values: one copy from the device).
struct GridTable {
  at::Tensor rows;  // int64 [n, kGridColumns], CPU
  int64_t n = 0, entries = 0, windows = 0, tokens = 0;
  const int64_t* row(int64_t g) const { return rows.const_data_ptr<int64_t>() + g * kGridColumns; }
};

inline GridTable grid_table(const at::Tensor& grid_thw, int64_t merge, int64_t window, bool need_divisible) {
  check_grid_thw(grid_thw, merge);
  auto g = grid_thw.to(at::kCPU, at::kLong).contiguous();
  GridTable t;
  t.n = g.size(0);
  t.rows = at::empty({t.n, kGridColumns}, g.options());
  const int64_t* src = g.const_data_ptr<int64_t>();
  int64_t* dst = t.rows.mutable_data_ptr<int64_t>();
  for (int64_t i = 0; i < t.n; ++i) {
    const int64_t T = src[3 * i], H = src[3 * i + 1], W = src[3 * i + 2];
    SPTR_CHECK_VALUE(T >= 0 && H >= 0 && W >= 0, "grid_thw[", i, "] must be non-negative, got (", T, ", ", H,
                      ", ", W, ")");
    if (need_divisible)
      SPTR_CHECK_VALUE(H % merge == 0 && W % merge == 0, "grid_thw[", i, "] = (", T, ", ", H, ", ", W,
                        "): h and w must be divisible by spatial_merge_size ", merge);
    int64_t* r = dst + i * kGridColumns;
    int64_t count[3];
    grid_row_sizes(T, H, W, merge, window, r, count);
    r[kEntryBase] = t.entries;
    r[kWindowBase] = t.windows;
    r[kTokenBase] = t.tokens;
    t.entries += count[0];
    t.windows += count[1];
    t.tokens += count[2];
  }
  return t;
}

// Output sizes of the vision ops. num_tokens (Σ t·h·w, the vision tower's sequence length; h, w divisible by
// merge) fixes them without reading the grid: `entries` = num_tokens / merge², and the window offsets are padded to entries + 1 (every
// window holds at least one entry; the padding repeats the total, empty windows). Otherwise they are exact,
// from the grid values (for a GPU grid that is one device-to-host copy, a host sync).
struct VisionSizes {
  int64_t tokens = 0, entries = 0, offsets = 1;
};

inline VisionSizes vision_sizes(const at::Tensor& grid_thw, int64_t merge, int64_t window, bool need_divisible,
                                std::optional<int64_t> num_tokens) {
  check_grid_thw(grid_thw, merge);
  VisionSizes z;
  if (num_tokens.has_value()) {
    z.tokens = *num_tokens;
    SPTR_CHECK_VALUE(z.tokens >= 0 && z.tokens % (merge * merge) == 0, "num_tokens must be a non-negative "
                      "multiple of spatial_merge_size^2 = ", merge * merge, ", got ", z.tokens);
    z.entries = z.tokens / (merge * merge);
    z.offsets = z.entries + 1;
    if (grid_thw.is_cpu()) {  // host grid: checking costs nothing
      const GridTable t = grid_table(grid_thw, merge, window, /*need_divisible=*/true);
      SPTR_CHECK_VALUE(t.tokens == z.tokens, "num_tokens = ", z.tokens, " but grid_thw holds sum(t*h*w) = ",
                        t.tokens, " patches");
    }
    return z;
  }
  const GridTable t = grid_table(grid_thw, merge, window, need_divisible);
  z.tokens = t.tokens;
  z.entries = t.entries;
  z.offsets = t.windows + 1;
  return z;
}

// cu_window_seqlens counts patches (entries · spatial_merge_unit) in int32, as the vision tower's varlen
// attention reads it.
inline void check_window_unit(int64_t unit, int64_t entries) {
  SPTR_CHECK_VALUE(unit >= 1, "spatial_merge_unit must be >= 1 (spatial_merge_size^2 in Qwen2.5-VL), got ", unit);
  SPTR_CHECK_VALUE(entries <= int64_t(INT32_MAX) / unit, "cu_window_seqlens is int32, but ", entries,
                    " merged tokens times spatial_merge_unit ", unit, " patches exceed 2^31 - 1");
}

inline void check_inv_freq(const at::Tensor& inv_freq) {
  SPTR_CHECK_VALUE(inv_freq.dim() == 1, "inv_freq must be 1-D, got shape ", inv_freq.sizes());
  SPTR_CHECK_FLOATING(inv_freq);
}

// Grids, seconds and config of rope_index, on the inputs' device.
struct RopeIndexInputs {
  at::Tensor ids, mask, image_grid, video_grid, sec;
  RopeIndexConfig cfg;
  bool vision = false;
};

inline at::Tensor grid_or_empty(const std::optional<at::Tensor>& g, const at::Tensor& ids, const char* name) {
  if (!g.has_value() || !g->defined()) return at::Tensor();
  SPTR_CHECK_VALUE(g->dim() == 2 && g->size(1) == 3, name, " must be [n, 3], got ", g->sizes());
  SPTR_CHECK_TYPE(g->scalar_type() == at::kInt || g->scalar_type() == at::kLong, name,
                   " must be int32 or int64, got ", g->scalar_type());
  return g->to(ids.device(), at::kLong).contiguous();
}

inline RopeIndexInputs rope_index_inputs(const at::Tensor& input_ids, const std::optional<at::Tensor>& image_grid_thw,
                                         const std::optional<at::Tensor>& video_grid_thw,
                                         const std::optional<at::Tensor>& second_per_grid_ts,
                                         const std::optional<at::Tensor>& attention_mask, int64_t merge,
                                         int64_t image_token, int64_t video_token, int64_t vision_start,
                                         double tokens_per_second) {
  SPTR_CHECK_VALUE(input_ids.dim() == 2, "input_ids must be [B, S], got shape ", input_ids.sizes());
  SPTR_CHECK_TYPE(at::isIntegralType(input_ids.scalar_type(), false), "input_ids must be an integer tensor, got ",
                   input_ids.scalar_type());
  SPTR_CHECK_VALUE(merge > 0, "spatial_merge_size must be positive, got ", merge);
  RopeIndexInputs in;
  in.ids = input_ids.to(at::kLong).contiguous();
  if (attention_mask.has_value() && attention_mask->defined()) {
    SPTR_CHECK_VALUE(attention_mask->sizes() == input_ids.sizes(), "attention_mask must be 2-D with the shape of "
                      "input_ids ", input_ids.sizes(), ", got ", attention_mask->sizes());
    in.mask = attention_mask->to(input_ids.device(), at::kLong).contiguous();
  }
  in.image_grid = grid_or_empty(image_grid_thw, input_ids, "image_grid_thw");
  in.video_grid = grid_or_empty(video_grid_thw, input_ids, "video_grid_thw");
  in.vision = in.image_grid.defined() || in.video_grid.defined();
  auto& c = in.cfg;
  c = RopeIndexConfig{merge, image_token, video_token, vision_start, static_cast<float>(tokens_per_second),
                      static_cast<double>(static_cast<float>(tokens_per_second)), nullptr, 0, nullptr, 0, nullptr,
                      nullptr, kSecondsFloat};
  if (in.image_grid.defined()) {
    c.image_grid = in.image_grid.const_data_ptr<int64_t>();
    c.n_image = in.image_grid.size(0);
  }
  if (in.video_grid.defined()) {
    c.video_grid = in.video_grid.const_data_ptr<int64_t>();
    c.n_video = in.video_grid.size(0);
  }
  if (second_per_grid_ts.has_value() && second_per_grid_ts->defined()) {
    const auto& s = *second_per_grid_ts;
    SPTR_CHECK_VALUE(s.dim() == 1 && s.size(0) >= c.n_video, "second_per_grid_ts must be 1-D with one entry per "
                      "video grid (", c.n_video, "), got shape ", s.sizes());
    SPTR_CHECK_TYPE(s.is_floating_point(), "second_per_grid_ts must be a floating tensor, got ", s.scalar_type());
    if (s.scalar_type() == at::kDouble) {
      // HF multiplies by a float64 scalar tensor in float64, with the Python tokens_per_second.
      in.sec = s.to(input_ids.device()).contiguous();
      c.sec64 = in.sec.const_data_ptr<double>();
      c.tps64 = tokens_per_second;
    } else {  // float16/bfloat16 values are exact in float32; the arithmetic stays in their dtype
      in.sec = s.to(input_ids.device(), at::kFloat).contiguous();
      c.sec32 = in.sec.const_data_ptr<float>();
      c.sec_dtype = s.scalar_type() == at::kHalf ? kSecondsHalf
                    : s.scalar_type() == at::kBFloat16 ? kSecondsBFloat16 : kSecondsFloat;
    }
  }
  return in;
}

// HF's text-only path (no grids): cumulative mask positions, or arange; ATen ops on any device.
inline std::tuple<at::Tensor, at::Tensor> rope_index_text_only(const RopeIndexInputs& in) {
  const int64_t B = in.ids.size(0), S = in.ids.size(1);
  if (!in.mask.defined()) {
    auto pos = at::arange(S, in.ids.options()).view({1, 1, S}).expand({3, B, S}).contiguous();
    return {pos, at::zeros({B, 1}, in.ids.options())};
  }
  auto pos = in.mask.cumsum(-1) - 1;
  pos.masked_fill_(in.mask == 0, 1);
  auto delta = std::get<0>(pos.max(-1, true)) + 1 - S;
  return {pos.unsqueeze(0).expand({3, B, S}).contiguous(), delta};
}

}  // namespace sptr
