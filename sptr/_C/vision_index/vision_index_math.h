// Qwen2.5-VL index math (transformers 4.49 semantics), shared by the CPU loops and the CUDA kernels.
#pragma once
#include <ATen/OpMathType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <sptr/views.h>

#include <cmath>

namespace sptr {

// ----------------------------------------------------------------------------------------- vision grids
// Per-grid table, one row of int64 per grid: t, merged h, merged w, window rows, window cols, first output
// entry (Σ t·Hm·Wm before it), first window, first patch token (Σ t·h·w before it). Built on the host.
enum GridColumn { kT = 0, kHm, kWm, kWinRows, kWinCols, kEntryBase, kWindowBase, kTokenBase, kGridColumns };

// The size columns (kT .. kWinCols) of the table row of a T×H×W grid, and its counts (entries, windows,
// patch tokens); the base columns are prefix sums of the counts over the grids before it.
SPTR_HD void grid_row_sizes(int64_t T, int64_t H, int64_t W, int64_t merge, int64_t window, int64_t* row,
                            int64_t count[3]) {
  row[kT] = T;
  row[kHm] = H / merge;
  row[kWm] = W / merge;
  row[kWinRows] = window > 0 ? (row[kHm] + window - 1) / window : 0;
  row[kWinCols] = window > 0 ? (row[kWm] + window - 1) / window : 0;
  count[0] = T * row[kHm] * row[kWm];
  count[1] = T * row[kWinRows] * row[kWinCols];
  count[2] = T * H * W;
}

// Index of the grid whose [base[g], base[g+1]) holds `item`, by binary search over column `col`.
SPTR_HD int64_t find_grid(const int64_t* grids, int64_t n, int col, int64_t item) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (grids[mid * kGridColumns + col] <= item) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// (hp, wp) of patch token `q` (frame-local) in a grid of width w with merge size m: merge-block-major order.
SPTR_HD void vision_patch_position(int64_t q, int64_t w, int64_t m, int64_t& hp, int64_t& wp) {
  const int64_t bi = q / (m * m), r = q % (m * m), bw = w / m;
  hp = (bi / bw) * m + r / m;
  wp = (bi % bw) * m + r % m;
}

// One rot_pos_emb angle as the tower computes it in inv_freq's dtype T: torch.arange(n, dtype=T) rounds the
// position to T, torch.outer rounds the product (computed in T's opmath type) to T.
template <typename T>
SPTR_HD T rotary_angle(int64_t pos, T inv_freq) {
  using A = at::opmath_type<T>;
  const A p = static_cast<A>(static_cast<T>(static_cast<A>(pos)));
  return static_cast<T>(p * static_cast<A>(inv_freq));
}

// Window layout of merged token (f, r, c): output slot of the token in window order.
SPTR_HD int64_t window_slot(const int64_t* g, int64_t ws, int64_t f, int64_t r, int64_t c) {
  const int64_t Hm = g[kHm], Wm = g[kWm];
  const int64_t wr = r / ws, wc = c / ws;
  const int64_t rows = (Hm - wr * ws) < ws ? (Hm - wr * ws) : ws;
  const int64_t cols = (Wm - wc * ws) < ws ? (Wm - wc * ws) : ws;
  const int64_t window_start = wr * ws * Wm + rows * wc * ws;
  return g[kEntryBase] + f * Hm * Wm + window_start + (r - wr * ws) * cols + (c - wc * ws);
}

// Number of output entries up to and including window (f, wr, wc) of grid g.
SPTR_HD int64_t window_end(const int64_t* g, int64_t ws, int64_t f, int64_t wr, int64_t wc) {
  const int64_t Hm = g[kHm], Wm = g[kWm];
  const int64_t rows = (Hm - wr * ws) < ws ? (Hm - wr * ws) : ws;
  const int64_t cols = (Wm - wc * ws) < ws ? (Wm - wc * ws) : ws;
  return g[kEntryBase] + f * Hm * Wm + wr * ws * Wm + rows * wc * ws + rows * cols;
}

// a / b and a % b for a >= 0, b > 0, as int64: on CUDA by a 32-bit unsigned division when both fit (a 64-bit
// division is a subroutine of ~70 instructions there), else as 64-bit operations; the same results.
SPTR_HD int64_t nonneg_div(int64_t a, int64_t b) {
#if defined(__CUDA_ARCH__)
  if (static_cast<uint64_t>(a) <= 0xffffffffull && b > 0 && b <= 0xffffffffll)
    return static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
#endif
  return a / b;
}
SPTR_HD int64_t nonneg_mod(int64_t a, int64_t b) {
#if defined(__CUDA_ARCH__)
  if (static_cast<uint64_t>(a) <= 0xffffffffull && b > 0 && b <= 0xffffffffll)
    return static_cast<uint32_t>(a) % static_cast<uint32_t>(b);
#endif
  return a % b;
}

// ---------------------------------------------------------------------------------------------- rope_index
struct RopeIndexConfig {
  int64_t merge, image_token, video_token, vision_start_token;
  float tps32;
  double tps64;
  const int64_t* image_grid;  // [n_image, 3] (t, h, w), or null
  int64_t n_image;
  const int64_t* video_grid;
  int64_t n_video;
  const float* sec32;         // seconds per video grid (float32, or float16/bfloat16 values widened) ...
  const double* sec64;        // ... or float64 (HF then computes the time index in float64); both null: 1.0
  int sec_dtype;              // SecondsDtype of sec32: the dtype HF computes the time index in
};

enum SecondsDtype { kSecondsFloat = 0, kSecondsHalf, kSecondsBFloat16 };

// HF's `arange(T) * second_per_grid_t * tokens_per_second` with a 0-d seconds tensor of dtype X: the integer
// is cast to X, each product is computed in float and rounded to X.
template <typename X>
SPTR_HD int64_t low_precision_time(int64_t a, float sec, float tps) {
  const float ax = static_cast<float>(static_cast<X>(static_cast<float>(a)));
  const float prod = static_cast<float>(static_cast<X>(ax * sec));
  return static_cast<int64_t>(::truncf(static_cast<float>(static_cast<X>(prod * tps))));
}

// One vision block of a row: text [st, e) at positions nxt.., then a T×Hm×Wm grid from compacted index e.
struct VisionBlock {
  int64_t st, e, nxt, T, Hm, Wm, video;  // video: index into the seconds table, -1 for an image
};

SPTR_HD int64_t temporal_index(const RopeIndexConfig& cfg, int64_t video, int64_t a) {
  if (video < 0) return 0;
  if (cfg.sec64) return static_cast<int64_t>(::trunc(static_cast<double>(a) * cfg.sec64[video] * cfg.tps64));
  const float sec = cfg.sec32 ? cfg.sec32[video] : 1.0f;
  if (cfg.sec32 && cfg.sec_dtype == kSecondsHalf) return low_precision_time<c10::Half>(a, sec, cfg.tps32);
  if (cfg.sec32 && cfg.sec_dtype == kSecondsBFloat16) return low_precision_time<c10::BFloat16>(a, sec, cfg.tps32);
  const float prod = static_cast<float>(a) * sec;  // rounded to float32 before the second product, as HF
  return static_cast<int64_t>(::truncf(prod * cfg.tps32));
}

// The first index >= from of a token in x[0, L), or INT64_MAX.
template <typename Ids>
SPTR_HD int64_t find_from(Ids x, int64_t L, int64_t from, int64_t token) {
  for (int64_t i = from; i < L; ++i)
    if (x[i] == token) return i;
  return INT64_MAX;
}

// HF 4.49's sequential block walk over one compacted row. next_token(from, video) is find_from for the image
// (video = false) or video token (the CUDA kernel looks it up in precomputed arrays). gi/gv: global image /
// video counters at the row's start. Writes up to n_img + n_vid blocks; returns their count and the trailing
// text start/position. Malformed rows stop early instead of reading past the grid tables.
template <class NextToken>
SPTR_HD int64_t rope_index_walk(NextToken next_token, int64_t n_img, int64_t n_vid, int64_t gi, int64_t gv,
                                const RopeIndexConfig& cfg, VisionBlock* blocks, int64_t& tail_st, int64_t& tail_nxt) {
  int64_t st = 0, nxt = 0, nb = 0, next_img = -1, next_vid = -1;
  int64_t remain_img = n_img, remain_vid = n_vid;
  for (int64_t it = 0; it < n_img + n_vid; ++it) {
    if (remain_img > 0 && next_img < st) next_img = next_token(st, false);
    if (remain_vid > 0 && next_vid < st) next_vid = next_token(st, true);
    const int64_t ei = remain_img > 0 ? next_img : INT64_MAX, ev = remain_vid > 0 ? next_vid : INT64_MAX;
    if (ei == INT64_MAX && ev == INT64_MAX) break;
    VisionBlock b;
    const int64_t* g;
    if (ei < ev) {
      if (gi >= cfg.n_image) break;
      g = cfg.image_grid + 3 * gi++;
      b.video = -1;
      b.e = ei;
      --remain_img;
    } else {
      if (gv >= cfg.n_video) break;
      g = cfg.video_grid + 3 * gv;
      b.video = gv++;
      b.e = ev;
      --remain_vid;
    }
    b.st = st;
    b.nxt = nxt;
    b.T = g[0];
    b.Hm = nonneg_div(g[1], cfg.merge);
    b.Wm = nonneg_div(g[2], cfg.merge);
    blocks[nb++] = b;
    const int64_t base = nxt + b.e - st;
    int64_t extent = b.Hm > b.Wm ? b.Hm : b.Wm;
    // The largest temporal index: an image's is 0; a video's is monotone in a (each product and its rounding
    // are), so it is at a = 0 or a = T - 1. Work independent of T: a grid's t cannot make the walk slow.
    if (b.T > 0) {
      const int64_t first = temporal_index(cfg, b.video, 0), last = temporal_index(cfg, b.video, b.T - 1);
      const int64_t t1 = (first > last ? first : last) + 1;
      extent = t1 > extent ? t1 : extent;
    }
    nxt = base + extent;
    st = b.e + b.T * b.Hm * b.Wm;
  }
  tail_st = st;
  tail_nxt = nxt;
  return nb;
}

// (t, h, w) position of compacted index i of a walked row.
SPTR_HD void rope_index_position(const RopeIndexConfig& cfg, const VisionBlock* blocks, int64_t nb, int64_t tail_st,
                                 int64_t tail_nxt, int64_t i, int64_t pos[3]) {
  if (nb == 0 || i >= tail_st) {
    pos[0] = pos[1] = pos[2] = tail_nxt + i - tail_st;
    return;
  }
  int64_t lo = 0, hi = nb - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (blocks[mid].st <= i) lo = mid; else hi = mid - 1;
  }
  const VisionBlock& b = blocks[lo];
  if (i < b.e) {
    pos[0] = pos[1] = pos[2] = b.nxt + i - b.st;
    return;
  }
  const int64_t local = i - b.e, base = b.nxt + b.e - b.st, hw = b.Hm * b.Wm;
  pos[0] = base + temporal_index(cfg, b.video, nonneg_div(local, hw));
  pos[1] = base + nonneg_mod(nonneg_div(local, b.Wm), b.Hm);
  pos[2] = base + nonneg_mod(local, b.Wm);
}

// Image / video blocks of a compacted row: vision-start tokens followed by an image or video token.
template <typename Ids>
SPTR_HD bool starts_block(Ids x, int64_t L, int64_t i, int64_t vs, int64_t token) {
  return i + 1 < L && x[i] == vs && x[i + 1] == token;
}

}  // namespace sptr
