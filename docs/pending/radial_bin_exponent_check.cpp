// The check behind docs/pending/radial_bin_exponent.patch: floor(logf(x) * (1 / ln 2)) against x's binary
// exponent for every finite float x >= 2, the exponent taken only more than 2^9 ulps from a power of two.
// g++ -O2 -o check radial_bin_exponent_check.cpp && ./check
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

static int exponent_or_log(float x, float inv_ln2) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint32_t m = bits & 0x7FFFFFu;
  if (m >= (1u << 9) && m <= 0x7FFFFFu - (1u << 9)) return int(bits >> 23) - 127;
  return int(floorf(logf(x) * inv_ln2));
}

int main() {
  const float inv_ln2 = 1.f / logf(2.f), two = 2.f;
  uint32_t lo, maxd = 0;
  std::memcpy(&lo, &two, 4);
  long n = 0, bad = 0;
  for (uint32_t b = lo; b < 0x7F800000u; ++b) {
    float x;
    std::memcpy(&x, &b, 4);
    const int slow = int(floorf(logf(x) * inv_ln2));
    bad += slow != exponent_or_log(x, inv_ln2);
    ++n;
    const uint32_t m = b & 0x7FFFFFu, d = m < 0x400000u ? m : 0x800000u - m;
    if (slow != int(b >> 23) - 127 && d > maxd) maxd = d;
  }
  printf("%ld floats checked, %ld differ; the logarithm leaves the exponent at most %u ulps from a power of two\n",
         n, bad, maxd);
  return bad != 0;
}
