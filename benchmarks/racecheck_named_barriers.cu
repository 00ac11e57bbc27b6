// A correct program that asks whether compute-sanitizer racecheck follows CTA barriers after two groups of warps
// ran different numbers of named barriers (`bar.sync 1 + group, 128`), as the fp32 tile backward's two groups do
// when a tile has an odd number of key (query) blocks. Each group writes a buffer of its own between its named
// barriers, then, after __syncthreads(), every thread reads the other group's buffer; the next round's writes
// come after another __syncthreads(). There is no race: any hazard racecheck reports here is its own.
// Usage: racecheck_named_barriers MODE: 0 (group 1 runs one more named-barrier round), 1 (equal rounds), 2 (the
// rounds vary per tile, zero included, and the tiles come from a shared slot like next_tile's) or 3 (as 2, with
// the barrier chosen at run time as Team::sync does: __syncthreads() for id 0, else the named barrier; the
// compiler then emits both, predicated, at one place).
#include <cstdio>
#include <cstdlib>

__device__ void group_sync(int group) { asm volatile("bar.sync %0, 128;" ::"r"(1 + group) : "memory"); }
__device__ void team_sync(int barrier) {
  if (barrier == 0) __syncthreads();
  else asm volatile("bar.sync %0, 128;" ::"r"(barrier) : "memory");
}

__global__ void two_groups_kernel(float* out, int mode, int* counter, int first_barrier) {
  __shared__ float buffer[2][128];
  __shared__ int slot;
  const int group = threadIdx.x / 128, t = threadIdx.x % 128;
  float sum = 0.f;
  for (int tile = 0; tile < 6; ++tile) {
    __syncthreads();
    if (threadIdx.x == 0) slot = atomicAdd(counter, 1);
    __syncthreads();
    const int rounds = mode == 1 ? 2 : mode == 0 ? 2 + group : (slot + group) % 3;  // modes 2, 3: 0-2 rounds
    for (int i = 0; i < rounds; ++i) {
      if (mode == 3) team_sync(first_barrier + group);
      else group_sync(group);
      buffer[group][t] = float(i + tile);
      if (mode == 3) team_sync(first_barrier + group);
      else group_sync(group);
      sum += buffer[group][(t + 1) % 128];
    }
    __syncthreads();
    sum += buffer[1 - group][t];
  }
  out[threadIdx.x] = sum;
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? atoi(argv[1]) : 0;
  float* out = nullptr;
  int* counter = nullptr;
  cudaMalloc(&out, 256 * sizeof(float));
  cudaMalloc(&counter, sizeof(int));
  cudaMemset(counter, 0, sizeof(int));
  two_groups_kernel<<<1, 256>>>(out, mode, counter, 1);
  const cudaError_t err = cudaDeviceSynchronize();
  printf("mode %d: %s\n", mode, cudaGetErrorString(err));
  cudaFree(out);
  cudaFree(counter);
  return err == cudaSuccess ? 0 : 1;
}
