// Environment switches: the benchmarks' A/B runs of kernel variants on one build.
#pragma once
#include <cstdlib>
#include <string_view>

namespace sptr {

// Whether environment variable `name` is set to `value`.
inline bool env_is(const char* name, std::string_view value) {
  const char* v = std::getenv(name);
  return v != nullptr && value == v;
}

}  // namespace sptr
