#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vision_index_host.h"

namespace sptr {

at::Tensor vision_rot_pos_emb_cpu(const at::Tensor& inv_freq, const at::Tensor& grid_thw, int64_t merge,
                                  std::optional<int64_t> num_tokens) {
  check_inv_freq(inv_freq);
  vision_sizes(grid_thw, merge, 0, /*need_divisible=*/true, num_tokens);  // checks num_tokens against the grid
  const GridTable t = grid_table(grid_thw, merge, 0, /*need_divisible=*/true);
  const int64_t F = inv_freq.size(0);
  auto freq = inv_freq.contiguous();
  auto out = at::empty({t.tokens, 2 * F}, inv_freq.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, inv_freq.scalar_type(), "rot_pos_emb", [&] {
    const scalar_t* fr = freq.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, t.tokens, 1024, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t* g = t.row(find_grid(t.rows.const_data_ptr<int64_t>(), t.n, kTokenBase, p));
        const int64_t h = g[kHm] * merge, w = g[kWm] * merge;
        int64_t hp, wp;
        vision_patch_position((p - g[kTokenBase]) % (h * w), w, merge, hp, wp);
        for (int64_t j = 0; j < F; ++j) {
          o[p * 2 * F + j] = rotary_angle(hp, fr[j]);
          o[p * 2 * F + F + j] = rotary_angle(wp, fr[j]);
        }
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> vision_window_index_cpu(const at::Tensor& grid_thw, int64_t merge, int64_t window,
                                                           int64_t unit, std::optional<int64_t> num_tokens) {
  SPTR_CHECK_VALUE(window > 0, "window size (vit_merger_window_size) must be positive, got ", window);
  const VisionSizes z = vision_sizes(grid_thw, merge, window, /*need_divisible=*/false, num_tokens);
  check_window_unit(unit, z.entries);
  const GridTable t = grid_table(grid_thw, merge, window, /*need_divisible=*/false);
  auto index = at::empty({t.entries}, grid_thw.options().device(at::kCPU).dtype(at::kInt));
  auto cu = at::empty({z.offsets}, index.options());
  const int64_t* rows = t.rows.const_data_ptr<int64_t>();
  int32_t* idx = index.mutable_data_ptr<int32_t>();
  int32_t* cus = cu.mutable_data_ptr<int32_t>();
  cus[0] = 0;
  for (int64_t e = 0; e < t.entries; ++e) {
    const int64_t* g = t.row(find_grid(rows, t.n, kEntryBase, e));
    const int64_t local = e - g[kEntryBase], hw = g[kHm] * g[kWm];
    idx[window_slot(g, window, local / hw, (local % hw) / g[kWm], local % g[kWm])] = static_cast<int32_t>(e);
  }
  for (int64_t w = 0; w < t.windows; ++w) {
    const int64_t* g = t.row(find_grid(rows, t.n, kWindowBase, w));
    const int64_t local = w - g[kWindowBase], per_frame = g[kWinRows] * g[kWinCols];
    const int64_t end = window_end(g, window, local / per_frame, (local % per_frame) / g[kWinCols], local % g[kWinCols]);
    cus[w + 1] = static_cast<int32_t>(end * unit);
  }
  for (int64_t w = t.windows; w + 1 < z.offsets; ++w) cus[w + 1] = static_cast<int32_t>(t.entries * unit);
  return {index.to(grid_thw.device()), cu.to(grid_thw.device())};
}

std::tuple<at::Tensor, at::Tensor> rope_index_cpu(const at::Tensor& input_ids, const std::optional<at::Tensor>& image_grid_thw,
                                                  const std::optional<at::Tensor>& video_grid_thw,
                                                  const std::optional<at::Tensor>& second_per_grid_ts,
                                                  const std::optional<at::Tensor>& attention_mask, int64_t merge,
                                                  int64_t image_token, int64_t video_token, int64_t vision_start,
                                                  double tokens_per_second) {
  RopeIndexInputs in = rope_index_inputs(input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts,
                                         attention_mask, merge, image_token, video_token, vision_start,
                                         tokens_per_second);
  if (!in.vision) return rope_index_text_only(in);
  const int64_t B = in.ids.size(0), S = in.ids.size(1);
  auto pos = at::ones({3, B, S}, in.ids.options());
  auto delta = at::empty({B, 1}, in.ids.options());
  int64_t* P = pos.mutable_data_ptr<int64_t>();
  int64_t* dl = delta.mutable_data_ptr<int64_t>();
  const int64_t* ids = in.ids.const_data_ptr<int64_t>();
  const int64_t* mask = in.mask.defined() ? in.mask.const_data_ptr<int64_t>() : nullptr;
  std::vector<int64_t> valid, x;
  std::vector<VisionBlock> blocks;
  int64_t gi = 0, gv = 0;
  for (int64_t b = 0; b < B; ++b) {
    valid.clear();
    x.clear();
    for (int64_t i = 0; i < S; ++i)
      if (!mask || mask[b * S + i] == 1) {
        valid.push_back(i);
        x.push_back(ids[b * S + i]);
      }
    const int64_t L = static_cast<int64_t>(x.size());
    int64_t n_img = 0, n_vid = 0;
    for (int64_t i = 0; i < L; ++i) {
      n_img += starts_block(x.data(), L, i, in.cfg.vision_start_token, in.cfg.image_token);
      n_vid += starts_block(x.data(), L, i, in.cfg.vision_start_token, in.cfg.video_token);
    }
    blocks.resize(n_img + n_vid);
    int64_t tail_st, tail_nxt;
    const auto next_token = [&](int64_t from, bool video) {
      return find_from(x.data(), L, from, video ? in.cfg.video_token : in.cfg.image_token);
    };
    const int64_t nb = rope_index_walk(next_token, n_img, n_vid, gi, gv, in.cfg, blocks.data(), tail_st, tail_nxt);
    gi += n_img;  // HF advances the global counters by what it consumed; a clean walk consumes all
    gv += n_vid;
    int64_t mx = L ? INT64_MIN : 1;  // an empty row keeps the fill value 1 (delta = 2 - S)
    for (int64_t i = 0; i < L; ++i) {
      int64_t p3[3];
      rope_index_position(in.cfg, blocks.data(), nb, tail_st, tail_nxt, i, p3);
      for (int c = 0; c < 3; ++c) {
        P[(c * B + b) * S + valid[i]] = p3[c];
        mx = p3[c] > mx ? p3[c] : mx;
      }
    }
    dl[b] = mx + 1 - S;
  }
  return {pos, delta};
}

TORCH_LIBRARY_IMPL(sptr, CPU, m) {
  m.impl("rope_index", &rope_index_cpu);
  m.impl("vision_rot_pos_emb", &vision_rot_pos_emb_cpu);
  m.impl("vision_window_index", &vision_window_index_cpu);
}

}  // namespace sptr
