// cart2sphere on the CPU: the published chain of ATen ops (spherical_coords.h), so the bits are torch's own.
#include <torch/library.h>

#include "spherical_coords.h"

namespace sptr {

TORCH_LIBRARY_IMPL(sptr, CPU, m) { m.impl("cart2sphere", &cart2sphere_ops); }

}  // namespace sptr
