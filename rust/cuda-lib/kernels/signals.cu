// GPU <-> CPU signalling kernels. All accesses are system scope so that they order with the CPU
// and with peers: the address may be device memory, peer memory or mapped pinned host memory.
#include <stdint.h>

// The "bump watcher": stores `value` at `addr` with release semantics at system scope, so every
// write this stream made before it is visible first. One thread; capturable in a CUDA graph
// (its arguments are fixed at capture).
extern "C" __global__ void fabric_write_u64(uint64_t* addr, uint64_t value) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(addr), "l"(value) : "memory");
}

// Spins until *flag == expected (acquire load, system scope) or until `timeout_cycles` clock64()
// cycles have passed; then stores 0 (seen) or 1 (timed out) to *status with release semantics.
extern "C" __global__ void fabric_flag_poll(const uint64_t* flag, uint64_t expected, uint64_t timeout_cycles,
                                            uint32_t* status) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const long long start = clock64();
    uint32_t result = 1;
    for (;;) {
        uint64_t v;
        asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(flag) : "memory");
        if (v == expected) {
            result = 0;
            break;
        }
        if ((uint64_t)(clock64() - start) >= timeout_cycles) break;
    }
    asm volatile("st.release.sys.u32 [%0], %1;" ::"l"(status), "r"(result) : "memory");
}
