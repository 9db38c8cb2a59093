// How a kernel that polls mapped host memory slows the copies of its own CUDA context: a
// grid-filling kernel (2 blocks per SM) spins until the host raises a flag, polled one of three
// ways: every thread reads the host word; one thread per block reads it (sleeping between reads);
// one thread of the grid reads it and copies it into device memory, which one thread per block
// polls. Meanwhile the host times a 1 MiB cudaMemcpy on the legacy stream (GPU 1 -> GPU 0 over
// NVLink, within GPU 0, host -> GPU 0) to completion, 3 times per case (fastest .. slowest).
// This is what the all-to-all's receive kernels did to shm's device copies (docs/all_to_all_rdma.md,
// "The proxy's flags polled by one thread per grid").
//
//   nvcc -arch=sm_90 -O2 -o /tmp/host_poll_copies benchmarks/host_poll_copies.cu
//   /tmp/host_poll_copies          # needs two GPUs with peer access
#include <cstdio>
#include <chrono>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)
// mode 0: every thread polls the host word; 1: one thread per block does; 2: thread 0 of block
// 0 polls it and copies it into device memory, which thread 0 of every other block polls.
__global__ void spin(volatile int *hflag, volatile int *dflag, int mode, int sleep_ns) {
  if (mode == 0) { while (*hflag == 0) __nanosleep(sleep_ns); return; }
  if (mode == 1) { if (threadIdx.x == 0) while (*hflag == 0) __nanosleep(sleep_ns); __syncthreads(); return; }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    while (*hflag == 0) __nanosleep(sleep_ns);
    *dflag = 1; __threadfence();
  } else if (threadIdx.x == 0) {
    while (*dflag == 0) __nanosleep(sleep_ns);
  }
  __syncthreads();
}
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main() {
  int n; CK(cudaGetDeviceCount(&n)); if (n < 2) { printf("need 2 GPUs\n"); return 0; }
  CK(cudaSetDevice(1)); void *src1; CK(cudaMalloc(&src1, 8 << 20));
  CK(cudaSetDevice(0)); CK(cudaDeviceEnablePeerAccess(1, 0));
  void *dst, *src0, *hsrc; CK(cudaMalloc(&dst, 8 << 20)); CK(cudaMalloc(&src0, 8 << 20));
  CK(cudaHostAlloc(&hsrc, 8 << 20, cudaHostAllocDefault));
  int *flag; CK(cudaHostAlloc((void **)&flag, 4, cudaHostAllocMapped));
  int *dflag; CK(cudaMalloc((void **)&dflag, 4));
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const char *kinds[] = {"peer GPU1->GPU0", "local GPU0->GPU0", "host->GPU0"};
  const char *modes[] = {"all threads poll host", "1 thread/block polls host", "1 host poller, blocks poll device"};
  void *srcs[] = {src1, src0, hsrc};
  struct { int mode, sleep; } cfgs[] = {{-1, 0}, {0, 1000}, {1, 1000}, {1, 100}, {1, 10000}, {2, 1000}, {2, 100}};
  for (auto cf : cfgs) {
    for (int k = 0; k < 3; k++) {
      double best = 1e9, worst = 0;
      for (int rep = 0; rep < 3; rep++) {
        *flag = 0; CK(cudaMemset(dflag, 0, 4)); CK(cudaDeviceSynchronize());
        if (cf.mode >= 0) spin<<<2 * sms, 256, 0, s>>>(flag, dflag, cf.mode, cf.sleep);
        double t0 = now();
        while (now() - t0 < 0.002) {}
        double a = now();
        CK(cudaMemcpy(dst, srcs[k], 1 << 20, cudaMemcpyDefault));
        cudaEvent_t ev; CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
        CK(cudaEventRecord(ev, 0));
        while (cudaEventQuery(ev) == cudaErrorNotReady && now() - a < 2.0) {}
        double c = now();
        *flag = 1;
        CK(cudaDeviceSynchronize()); CK(cudaEventDestroy(ev));
        double us = (c - a) * 1e6; best = us < best ? us : best; worst = us > worst ? us : worst;
      }
      printf("%-34s sleep %5d ns  %-18s 1 MiB copy done in %8.1f .. %8.1f us\n", cf.mode < 0 ? "no kernel" : modes[cf.mode], cf.sleep, kinds[k], best, worst);
    }
  }
  return 0;
}
