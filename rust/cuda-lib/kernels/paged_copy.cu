// Paged copy: page i moves page_len bytes from
//   src + src_idx[i] * src_stride + src_off   to   dst + dst_idx[i] * dst_stride + dst_off.
// A null index array means the identity (page i). The grid is small on purpose (a few blocks
// leave the SMs to the application); each block is split into groups of `group_threads` threads,
// one group per page at a time, so small pages still keep every thread busy. Each thread issues
// UNROLL independent loads before its stores to keep enough bytes in flight. The host picks the
// widest access (16/8/4/1 bytes) that every address, stride, offset and page_len allows.
#include <stdint.h>

namespace {

template <typename V, int UNROLL>
__device__ __forceinline__ void paged_copy(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src,
                                           const uint32_t* __restrict__ dst_idx,
                                           const uint32_t* __restrict__ src_idx, uint64_t dst_stride,
                                           uint64_t dst_off, uint64_t src_stride, uint64_t src_off,
                                           uint64_t page_len, uint32_t num_pages, uint32_t group_threads) {
    const uint32_t groups_per_block = blockDim.x / group_threads;
    const uint32_t group = threadIdx.x / group_threads;
    if (group >= groups_per_block) return;  // blockDim not a multiple of group_threads
    const uint32_t lane = threadIdx.x % group_threads;
    const uint32_t page_step = gridDim.x * groups_per_block;
    const uint64_t n = page_len / sizeof(V);
    const uint64_t step = (uint64_t)group_threads * UNROLL;
    for (uint32_t p = blockIdx.x * groups_per_block + group; p < num_pages; p += page_step) {
        const uint64_t si = src_idx ? src_idx[p] : p;
        const uint64_t di = dst_idx ? dst_idx[p] : p;
        const V* __restrict__ s = reinterpret_cast<const V*>(src + si * src_stride + src_off);
        V* __restrict__ d = reinterpret_cast<V*>(dst + di * dst_stride + dst_off);
        uint64_t i = lane;
        for (; i + (UNROLL - 1) * (uint64_t)group_threads < n; i += step) {
            V r[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) r[u] = s[i + u * group_threads];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) d[i + u * group_threads] = r[u];
        }
        for (; i < n; i += group_threads) d[i] = s[i];
    }
}

}  // namespace

#define FABRIC_PAGED_COPY(NAME, V, UNROLL)                                                              \
    extern "C" __global__ void NAME(uint8_t* dst, const uint8_t* src, const uint32_t* dst_idx,           \
                                    const uint32_t* src_idx, uint64_t dst_stride, uint64_t dst_off,      \
                                    uint64_t src_stride, uint64_t src_off, uint64_t page_len,            \
                                    uint32_t num_pages, uint32_t group_threads) {                        \
        paged_copy<V, UNROLL>(dst, src, dst_idx, src_idx, dst_stride, dst_off, src_stride, src_off,      \
                              page_len, num_pages, group_threads);                                       \
    }

FABRIC_PAGED_COPY(fabric_paged_copy_16, uint4, 4)
FABRIC_PAGED_COPY(fabric_paged_copy_8, uint2, 8)
FABRIC_PAGED_COPY(fabric_paged_copy_4, uint32_t, 8)
FABRIC_PAGED_COPY(fabric_paged_copy_1, uint8_t, 8)
