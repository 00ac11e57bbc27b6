"""The radial bin's floor(log2) (fused_window_attention_math.h, floor_log2_of) against the logarithm it replaces,
for every finite float >= 2: more than 2^9 ulps from a power of two it reads the float's exponent instead of
evaluating logf, which must give the same floor there. On the CPU with the C++ compiler's logf (the CPU kernel's),
on CUDA with torch's float32 log (CUDA's logf, the CUDA kernels')."""
import math
import pathlib
import shutil
import subprocess

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
BAND = 1 << 9  # ulps from a power of two where floor_log2_of takes the logarithm
INV_LN2 = 1.0 / math.log(2.0)  # RelPosParams.inv_ln2 (fused_window_attention_host.h), as a float32 below

CHECK = r"""
#include <cstdio>
#include <cstring>
#include "sptr/_C/fused_window_attention/fused_window_attention_math.h"
int main() {
  const float inv_ln2 = 1.0f / static_cast<float>(std::log(2.0)), two = 2.f;
  uint32_t lo;
  std::memcpy(&lo, &two, 4);
  long bad = 0;
  for (uint32_t b = lo; b < 0x7F800000u; ++b) {
    float x;
    std::memcpy(&x, &b, 4);
    bad += sptr::floor_log2_of(x, inv_ln2) != floorf(logf(x) * inv_ln2);
  }
  std::printf("%ld differ\n", bad);
  return bad != 0;
}
"""


def test_floor_log2_of_matches_the_logarithm_cpu(tmp_path):
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("needs a C++ compiler")
    source, binary = tmp_path / "check.cpp", tmp_path / "check"
    source.write_text(CHECK)
    built = subprocess.run([compiler, "-O2", "-std=c++17", f"-I{ROOT}", str(source), "-o", str(binary)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    result = subprocess.run([str(binary)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_floor_log2_of_matches_the_logarithm_cuda():
    inv_ln2 = torch.tensor(INV_LN2, dtype=torch.float32, device="cuda")
    lo, hi, step = 0x40000000, 0x7F800000, 1 << 26  # 2.0 up to infinity
    for start in range(lo, hi, step):
        bits = torch.arange(start, min(start + step, hi), dtype=torch.int32, device="cuda")
        x = bits.view(torch.float32)
        mantissa = bits & 0x7FFFFF
        far = (mantissa >= BAND) & (mantissa <= 0x7FFFFF - BAND)  # more than BAND ulps from a power of two
        exponent = ((bits >> 23) - 127).to(torch.float32)
        floor_log = torch.floor(torch.log(x) * inv_ln2)
        assert torch.equal(floor_log[far], exponent[far]), f"floats from bits {start:#x}"
