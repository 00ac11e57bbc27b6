// window_cells and window_quantised_coords on the CPU (the rules and their checks: window_cells.h).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sptr/dispatch.h>

#include "window_cells.h"

namespace sptr {
namespace {

at::Tensor window_cells_cpu(const at::Tensor& xyz, const at::Tensor& batch, const at::Tensor& size,
                            const std::optional<at::Tensor>& start, bool shift) {
  const CellFrame f = window_cell_frame(xyz, batch, size, start, shift);
  auto keys = at::empty({xyz.size(0)}, xyz.options().dtype(at::kLong));
  if (xyz.size(0) == 0) return keys;
  SPTR_DISPATCH_FLOATING(xyz.scalar_type(), "window_cells_cpu", [&] {
    const CellArgs<scalar_t> a = cell_args<scalar_t>(f, shift);
    int64_t* out = keys.mutable_data_ptr<int64_t>();
    at::parallel_for(0, xyz.size(0), 4096, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) out[i] = window_cell_key(a, i);
    });
  });
  return keys;
}

at::Tensor window_quantised_coords_cpu(const at::Tensor& xyz, const std::optional<at::Tensor>& order,
                                       const at::Tensor& window, const at::Tensor& quant, bool shift) {
  const QuantFrame f = quantised_cell_frame(xyz, order, window, quant);
  auto coords = at::empty({xyz.size(0), 3}, xyz.options().dtype(at::kInt));
  if (xyz.size(0) == 0) return coords;
  SPTR_DISPATCH_FLOATING(xyz.scalar_type(), "window_quantised_coords_cpu", [&] {
    const QuantArgs<scalar_t> a = quant_args<scalar_t>(f, shift);
    int32_t* out = coords.mutable_data_ptr<int32_t>();
    at::parallel_for(0, xyz.size(0), 4096, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) quantised_cells(a, j, out);
    });
  });
  return coords;
}

}  // namespace

TORCH_LIBRARY_IMPL(sptr, CPU, m) {
  m.impl("window_cells", &window_cells_cpu);
  m.impl("window_quantised_coords", &window_quantised_coords_cpu);
}

}  // namespace sptr
