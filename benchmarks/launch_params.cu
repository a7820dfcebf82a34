// Host time of one kernel launch against the size of its parameters (issue 31: host time to issue a call
// <= 10 us). The one-launch call passes its whole plan by value, P2PAllReduceArgs, 1176 bytes
// (sizeof, nvcc 13.0); vLLM's custom all-reduce passes a pointer to device-resident rank data instead. If the
// launch's host time grows with its parameters, keeping the plan in device memory would save that much of
// every call; if not, the idea is dead before anyone changes the kernels' signature.
//
//   nvcc -O2 -arch=sm_90 -o /tmp/launch_params benchmarks/launch_params.cu && /tmp/launch_params
//
// Every row: the median over 30 batches of one batch's host seconds divided by its 50 launches (the stream
// drained between batches, so the launch queue never fills and the host never waits for the GPU), an empty
// kernel that reads its first parameter byte, on 1 block and on the one launch's grid (132 x 256 threads).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#define CHECK(x)                                                                        \
  do {                                                                                  \
    cudaError_t e = (x);                                                                \
    if (e != cudaSuccess) {                                                             \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      return 1;                                                                         \
    }                                                                                   \
  } while (0)

template <int N>
struct Params {
  unsigned char bytes[N];
};

template <int N>
__global__ void empty_kernel(const Params<N> p, int* never) {
  if (p.bytes[0] == 255 && threadIdx.x == 0) *never = 1;  // depends on the parameters; never true
}

template <int N>
int row(cudaStream_t s, int* never, int blocks) {
  Params<N> p{};
  constexpr int kBatch = 50, kBatches = 30;
  for (int i = 0; i < 200; ++i) empty_kernel<N><<<blocks, 256, 0, s>>>(p, never);
  CHECK(cudaStreamSynchronize(s));
  std::vector<double> us;
  for (int b = 0; b < kBatches; ++b) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kBatch; ++i) empty_kernel<N><<<blocks, 256, 0, s>>>(p, never);
    const auto t1 = std::chrono::steady_clock::now();
    CHECK(cudaGetLastError());
    CHECK(cudaStreamSynchronize(s));
    us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / kBatch);
  }
  std::sort(us.begin(), us.end());
  std::printf("| %5d B | %4d | %.2f us | %.2f us | %.2f us |\n", N, blocks, us[kBatches / 2], us.front(), us.back());
  return 0;
}

int main() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int* never;
  CHECK(cudaMalloc(&never, sizeof(int)));
  std::printf("launch host time by parameter size (%s; median of 30 batches of 50 launches)\n", prop.name);
  std::printf("| params | blocks | median | min | max |\n|---:|---:|---:|---:|---:|\n");
  for (int blocks : {1, 132}) {
    if (row<16>(s, never, blocks) || row<256>(s, never, blocks) || row<1176>(s, never, blocks) ||
        row<4096>(s, never, blocks)) {
      return 1;
    }
  }
  return 0;
}
