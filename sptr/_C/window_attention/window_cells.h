// window_cells: each point's window cell key, torch_cluster's mixed-radix id x + n_x·(y + n_y·(z + n_z·(b − b0)))
// of the cells floor((pos − origin) / size), in one pass over the points after the per-column minimum and maximum
// (one reduction). The arithmetic is torch's, step by step, in the coordinates' dtype (each step computed in the
// op-math type and rounded to it, as an elementwise torch op does), so the keys equal those of the published
// Python rule to the bit; the batch index is exact in int64. Shared by the CPU and CUDA kernels.
#pragma once
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/util/generic_math.h>
#include <sptr/checks.h>
#include <sptr/views.h>

#include "check_xyz.h"

#include <cmath>
#include <optional>

namespace sptr {

// The per-point inputs and the frame, as device-readable pointers (the frame's values stay on the device).
template <typename T>
struct CellArgs {
  const T* xyz;
  int64_t row_stride, col_stride;
  const int64_t* batch;  // int64, contiguous
  const T* size;         // [3], contiguous
  const T* origin;       // [3]: `start`, or the column minima of xyz
  const T* top;          // [3]: the column maxima of xyz
  const int64_t* b0;     // the smallest batch index, or null (batch counted from 0)
  bool shift;            // positions moved by half a cell (shifted windows), the frame not
};

template <typename T>
SPTR_HD int64_t window_cell_key(const CellArgs<T>& a, int64_t i) {
  using A = at::opmath_type<T>;
  int64_t key = a.batch[i] - (a.b0 ? *a.b0 : 0);
#pragma unroll
  for (int c = 2; c >= 0; --c) {
    const A size = A(a.size[c]), origin = A(a.origin[c]);
    const T half = a.shift ? T(A(a.size[c]) * A(0.5)) : T(A(0));  // torch's `0.5 * size`
    const T pos = a.shift ? T(A(a.xyz[i * a.row_stride + c * a.col_stride]) + A(half))
                          : a.xyz[i * a.row_stride + c * a.col_stride];
    const T top = a.shift ? T(A(a.top[c]) + A(half)) : a.top[c];  // max(x + h) = max(x) + h: rounding is monotone
    const T cell = T(std::floor(A(T(A(T(A(pos) - origin)) / size))));
    const T extent = T(A(T(std::trunc(A(T(A(T(A(top) - origin)) / size))))) + A(1));
    key = static_cast<int64_t>(A(cell)) + static_cast<int64_t>(A(extent)) * key;
  }
  return key;
}

// The checks, the int64 batch and the reductions of window_cells (device-generic ATen calls).
struct CellFrame {
  at::Tensor xyz, batch, size, origin, top, b0;
};

inline CellFrame window_cell_frame(const at::Tensor& xyz, const at::Tensor& batch, const at::Tensor& size,
                                   const std::optional<at::Tensor>& start, bool shift) {
  check_xyz(xyz);
  SPTR_CHECK_VALUE(batch.dim() == 1 && batch.size(0) == xyz.size(0), "batch must have shape (", xyz.size(0),
                   ",), got ", batch.sizes());
  SPTR_CHECK_TYPE(!batch.is_complex() && batch.scalar_type() != at::kBool,
                  "batch must be an integer or floating tensor, got ", batch.scalar_type());
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"batch", &batch}, {"size", &size},
                                {"start", start.has_value() ? &*start : nullptr}}) {
    if (t == nullptr) continue;
    SPTR_CHECK_VALUE(t->device() == xyz.device(), name, " must be on xyz's device ", xyz.device(), ", got ",
                     t->device());
    if (t == &batch) continue;
    SPTR_CHECK_VALUE(t->dim() == 1 && t->size(0) == 3, name, " must have shape (3,), got ", t->sizes());
    SPTR_CHECK_TYPE(t->scalar_type() == xyz.scalar_type(), name, " must have xyz's dtype ", xyz.scalar_type(),
                    ", got ", t->scalar_type());
  }
  CellFrame f;
  f.xyz = xyz;
  f.batch = batch.to(at::kLong).contiguous();  // the published `batch.long()`
  f.size = size.contiguous();
  if (xyz.size(0) == 0) return f;
  auto [lo, hi] = at::aminmax(xyz, 0);
  f.origin = start.has_value() ? start->contiguous() : lo;
  f.top = hi;
  // Shifted windows (and an explicit start) count scans from 0, as the published rule does.
  if (!start.has_value() && !shift) f.b0 = f.batch.min();
  return f;
}

template <typename T>
CellArgs<T> cell_args(const CellFrame& f, bool shift) {
  return {f.xyz.const_data_ptr<T>(), f.xyz.stride(0), f.xyz.stride(1), f.batch.const_data_ptr<int64_t>(),
          f.size.const_data_ptr<T>(), f.origin.const_data_ptr<T>(), f.top.const_data_ptr<T>(),
          f.b0.defined() ? f.b0.const_data_ptr<int64_t>() : nullptr, shift};
}

// window_quantised_coords: each point's quantisation cell inside its window, floor(remainder(x − min x [+ w/2], w)
// / q) in float32 with torch's remainder and floor division (c10's own functions), as int32 (N, 3), in the
// order `order` (window order: row j is point order[j]) or the points' own. The relative position of a pair
// is the difference of its points' cells (SparseTransformer's rel index without a split function).
template <typename T>
struct QuantArgs {
  const T* xyz;
  int64_t row_stride, col_stride;
  const int64_t* order;  // or null
  const T* lo;           // [3]: the column minima of xyz
  const float *window, *quant;
  bool shift;
};

template <typename T>
SPTR_HD void quantised_cells(const QuantArgs<T>& a, int64_t j, int32_t* out) {
  const int64_t i = a.order ? a.order[j] : j;
#pragma unroll
  for (int c = 0; c < 3; ++c) {
    float d = static_cast<float>(a.xyz[i * a.row_stride + c * a.col_stride]) - static_cast<float>(a.lo[c]);
    if (a.shift) d = d + a.window[c] * 0.5f;  // torch's `d + 0.5 * w` (the product is exact)
    out[3 * j + c] = static_cast<int32_t>(c10::div_floor_floating(c10::div_mod(d, a.window[c]), a.quant[c]));
  }
}

struct QuantFrame {
  at::Tensor xyz, order, lo, window, quant;
};

inline QuantFrame quantised_cell_frame(const at::Tensor& xyz, const std::optional<at::Tensor>& order,
                                       const at::Tensor& window, const at::Tensor& quant) {
  check_xyz(xyz);
  if (order.has_value()) {
    SPTR_CHECK_VALUE(order->dim() == 1 && order->size(0) == xyz.size(0), "order must have shape (", xyz.size(0),
                     ",), got ", order->sizes());
    SPTR_CHECK_TYPE(order->scalar_type() == at::kLong, "order must be int64, got ", order->scalar_type());
    SPTR_CHECK_VALUE(order->device() == xyz.device(), "order must be on xyz's device ", xyz.device(), ", got ",
                     order->device());
  }
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"window_size", &window},
                                {"quant_size", &quant}}) {
    SPTR_CHECK_VALUE(t->dim() == 1 && t->size(0) == 3, name, " must have shape (3,), got ", t->sizes());
    SPTR_CHECK_TYPE(t->scalar_type() == at::kFloat, name, " must be float32, got ", t->scalar_type());
    SPTR_CHECK_VALUE(t->device() == xyz.device(), name, " must be on xyz's device ", xyz.device(), ", got ",
                     t->device());
  }
  QuantFrame f{xyz, order.has_value() ? order->contiguous() : at::Tensor(), at::Tensor(), window.contiguous(),
               quant.contiguous()};
  if (xyz.size(0) > 0) f.lo = at::amin(xyz, 0);
  return f;
}

template <typename T>
QuantArgs<T> quant_args(const QuantFrame& f, bool shift) {
  return {f.xyz.const_data_ptr<T>(), f.xyz.stride(0), f.xyz.stride(1),
          f.order.defined() ? f.order.const_data_ptr<int64_t>() : nullptr, f.lo.const_data_ptr<T>(),
          f.window.const_data_ptr<float>(), f.quant.const_data_ptr<float>(), shift};
}

}  // namespace sptr
