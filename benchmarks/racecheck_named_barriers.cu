// A correct program that asks whether compute-sanitizer racecheck follows CTA barriers after two groups of warps
// ran different numbers of named barriers (`bar.sync 1 + group, 128`), as the fp32 tile backward's two groups do
// when a tile has an odd number of key (query) blocks. Each group writes a buffer of its own between its named
// barriers, then, after __syncthreads(), every thread reads the other group's buffer; the next round's writes
// come after another __syncthreads(). There is no race: any hazard racecheck reports here is its own.
// Usage: racecheck_named_barriers 0 (group 1 runs one more named-barrier round) or 1 (equal rounds).
#include <cstdio>
#include <cstdlib>

__device__ void group_sync(int group) { asm volatile("bar.sync %0, 128;" ::"r"(1 + group) : "memory"); }

__global__ void two_groups_kernel(float* out, bool equal_rounds) {
  __shared__ float buffer[2][128];
  const int group = threadIdx.x / 128, t = threadIdx.x % 128;
  float sum = 0.f;
  for (int tile = 0; tile < 3; ++tile) {
    __syncthreads();
    const int rounds = equal_rounds ? 2 : 2 + group;
    for (int i = 0; i < rounds; ++i) {
      group_sync(group);
      buffer[group][t] = float(i + tile);
      group_sync(group);
      sum += buffer[group][(t + 1) % 128];
    }
    __syncthreads();
    sum += buffer[1 - group][t];
  }
  out[threadIdx.x] = sum;
}

int main(int argc, char** argv) {
  const bool equal_rounds = argc > 1 && atoi(argv[1]) != 0;
  float* out = nullptr;
  cudaMalloc(&out, 256 * sizeof(float));
  two_groups_kernel<<<1, 256>>>(out, equal_rounds);
  const cudaError_t err = cudaDeviceSynchronize();
  printf("equal rounds %d: %s\n", int(equal_rounds), cudaGetErrorString(err));
  cudaFree(out);
  return err == cudaSuccess ? 0 : 1;
}
