// Argument checks shared by every op: errors name the argument, so a bad call reads as a Python error naming
// what was wrong (the Python wrappers check first; these guard direct op calls).
//
// Messages are built with std::string, not c10::str: c10::str formats through std::ostringstream inline in
// this library, and with some torch wheels (seen: torch 2.11 on Ubuntu 24.04, g++ 13) that inlined stream
// code crashes the process instead of raising.
#pragma once
#include <ATen/ATen.h>

#include <string>
#include <type_traits>

namespace sptr {
namespace detail {

inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void append(std::string& s, const c10::Device& v) { s += v.str(); }
inline void append(std::string& s, c10::IntArrayRef v) {
  s += "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  s += "]";
}
template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
void append(std::string& s, T v) {
  s += std::to_string(v);
}

}  // namespace detail

template <typename... Args>
std::string msg(const Args&... args) {
  std::string s;
  (detail::append(s, args), ...);
  return s;
}

}  // namespace sptr

#define SPTR_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::sptr::msg(__VA_ARGS__))
#define SPTR_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, ::sptr::msg(__VA_ARGS__))

#define SPTR_CHECK_DIM(x, n) \
  SPTR_CHECK_VALUE((x).dim() == (n), #x " must be a ", (n), "-D tensor, got shape ", (x).sizes())
#define SPTR_CHECK_SAME_DEVICE(x, y) \
  SPTR_CHECK_VALUE((x).device() == (y).device(), #x " is on ", (x).device(), " but " #y " is on ", (y).device())
#define SPTR_CHECK_SAME_DTYPE(x, y) \
  SPTR_CHECK_TYPE((x).scalar_type() == (y).scalar_type(), #x " has dtype ", (x).scalar_type(), \
                   " but " #y " has dtype ", (y).scalar_type())
#define SPTR_CHECK_INDEX_DTYPE(x)                                                              \
  SPTR_CHECK_TYPE((x).scalar_type() == at::kInt || (x).scalar_type() == at::kLong, #x        \
                   " must be int32 or int64, got ", (x).scalar_type())
#define SPTR_CHECK_FLOATING(x)                                                                     \
  SPTR_CHECK_TYPE(at::isFloatingType((x).scalar_type()) && (x).scalar_type() != at::kFloat8_e4m3fn, \
                   #x " must be float16, bfloat16, float32 or float64, got ", (x).scalar_type())
