// NVLink all-to-all ceilings of one host: how many bytes per second every GPU can move to all
// the others at once, with SM stores (several mappings of blocks and warps to destinations, 2 KiB
// chunks like the MoE combine's or contiguous ranges), SM loads from the peers (pull), bulk
// copies from shared memory to the peers (TMA) and the copy engines (one memcpy stream per
// peer). One process drives every GPU; each (source, destination) pair moves the same bytes.
// Every GPU's work waits behind a gate kernel until the host has queued all of it, then the
// host opens the gate; a round's time is the slowest GPU's (CUDA events around its work, so
// launch latency is not counted), the result the median of 10 rounds.
//
//   nvcc -arch=sm_90a -O3 -o /tmp/nvlink_ceiling benchmarks/nvlink_ceiling.cu
//   /tmp/nvlink_ceiling [bytes per pair (default 53 MiB)] [json output path]
//
// Findings on 4x H200 (docs/all_to_all.md, "Third round"): SM stores reach 345-350 GB/s per GPU
// in an all-to-all whatever the mapping (351 for one pair), bulk copies (TMA) the same, SM loads
// from the peers only ~322, copy engines ~213 in all-to-all (356 for one pair).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CK(x)                                                                                   \
    do {                                                                                        \
        cudaError_t e_ = (x);                                                                   \
        if (e_ != cudaSuccess) {                                                                \
            fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));          \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)

// The k-th (source, destination) pair of one GPU: local source and peer destination (push) or
// peer source and local destination (pull).
struct Ptrs {
    int4* p[8];
};

enum Mode {
    BLOCK_DEST = 0,      // block b writes destination b % nd, contiguous grid-stride ranges
    WARP_DEST = 1,       // warp w writes destination w % nd, 2 KiB chunks
    ROTATING = 2,        // items (chunk, destination), destination innermost, rotated per warp
    BLOCK_SCATTERED = 3, // block -> destination, 2 KiB chunks in a scattered order
    ROTATING_SCATTERED = 4,
    TMA_ROTATING = 5,    // ROTATING, each chunk staged in shared memory and sent by a bulk copy
};

// Holds every GPU's work until the host has queued all of it (gives up after 5 s).
__global__ void gate(const volatile int* open) {
    uint64_t t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (!*open && t - t0 < 5000000000ull);
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// ROTATING through shared memory: each warp cycles through `stages` 2 KiB buffers; lane 0 sends
// a filled buffer with one bulk copy and waits for a buffer's previous copy to have read it.
template <int STAGES>
__global__ void tma_push(Ptrs src, Ptrs dst, size_t nvec, int nd) {
    extern __shared__ __align__(128) int4 smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wpb = blockDim.x >> 5;
    int4* mine = smem + (size_t)warp * STAGES * 128;
    const size_t nch = nvec / 128;
    const size_t gw = (size_t)blockIdx.x * wpb + warp, gws = (size_t)gridDim.x * wpb;
    int st = 0;
    for (size_t it = gw, j = 0; it < nch * nd; it += gws, ++j) {
        const size_t c = it / nd;
        const int d = (int)((it % nd + j) % nd);
        int4 v[4];
        for (int u = 0; u < 4; ++u) v[u] = src.p[d][c * 128 + lane + u * 32];
        if (lane == 0) asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(STAGES - 1) : "memory");
        __syncwarp();
        int4* buf = mine + st * 128;
        for (int u = 0; u < 4; ++u) buf[lane + u * 32] = v[u];
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncwarp();
        if (lane == 0) {
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], 2048;" ::"l"(dst.p[d] + c * 128),
                         "r"(smem_u32(buf))
                         : "memory");
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        }
        st = st + 1 == STAGES ? 0 : st + 1;
    }
    if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__global__ void copy(Ptrs src, Ptrs dst, size_t nvec, int nd, int mode) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wpb = blockDim.x >> 5;
    const size_t nch = nvec / 128;  // 2 KiB chunks per destination
    auto chunk = [&](int d, size_t c) {
        int4 v[4];
        for (int u = 0; u < 4; ++u) v[u] = src.p[d][c * 128 + lane + u * 32];
        for (int u = 0; u < 4; ++u) dst.p[d][c * 128 + lane + u * 32] = v[u];
    };
    if (mode == BLOCK_DEST || mode == BLOCK_SCATTERED) {
        const int d = blockIdx.x % nd;
        const size_t nb = gridDim.x / nd, bi = blockIdx.x / nd;
        if (bi >= nb) return;
        if (mode == BLOCK_DEST) {
            for (size_t k = bi * blockDim.x + threadIdx.x; k < nvec; k += nb * blockDim.x) dst.p[d][k] = src.p[d][k];
        } else {
            for (size_t c = bi * wpb + warp; c < nch; c += nb * wpb) chunk(d, (c * 97) % nch);  // 97: coprime to nch
        }
        return;
    }
    const size_t gw = (size_t)blockIdx.x * wpb + warp, gws = (size_t)gridDim.x * wpb;
    if (mode == WARP_DEST) {
        for (size_t c = gw / nd; c < nch; c += gws / nd) chunk(gw % nd, c);
        return;
    }
    for (size_t it = gw, j = 0; it < nch * nd; it += gws, ++j) {
        const size_t c = it / nd;
        chunk((int)((it % nd + j) % nd), mode == ROTATING_SCATTERED ? (c * 97) % nch : c);
    }
}

int main(int argc, char** argv) {
    int n;
    CK(cudaGetDeviceCount(&n));
    if (n < 2 || n > 9) {
        fprintf(stderr, "needs 2..9 GPUs, found %d\n", n);
        return 1;
    }
    size_t B = argc > 1 ? strtoull(argv[1], nullptr, 10) : (size_t)53 << 20;
    B = (B >> 11) << 11;  // whole 2 KiB chunks (and 97 coprime to their count: not a multiple of 97)
    if (B == 0 || (B >> 11) % 97 == 0) B += 2048;
    const char* json = argc > 2 ? argv[2] : nullptr;
    int* open = nullptr;  // the gate: pinned host memory every GPU reads
    CK(cudaHostAlloc(&open, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
    *open = 0;
    std::vector<char*> src(n), dst(n);
    std::vector<cudaStream_t> sm(n);
    std::vector<std::vector<cudaStream_t>> ce(n, std::vector<cudaStream_t>(n));
    std::vector<cudaEvent_t> t0(n), t1(n), opened(n);
    std::vector<std::vector<cudaEvent_t>> ce_done(n, std::vector<cudaEvent_t>(n));
    for (int i = 0; i < n; ++i) {
        CK(cudaSetDevice(i));
        for (int j = 0; j < n; ++j) {
            if (j == i) continue;
            const cudaError_t e = cudaDeviceEnablePeerAccess(j, 0);
            if (e == cudaErrorPeerAccessAlreadyEnabled) {
                cudaGetLastError();
            } else {
                CK(e);
            }
        }
        CK(cudaMalloc(&src[i], B * n));
        CK(cudaMalloc(&dst[i], B * n));
        CK(cudaMemset(src[i], i, B * n));
        CK(cudaStreamCreateWithFlags(&sm[i], cudaStreamNonBlocking));
        for (int j = 0; j < n; ++j) {
            CK(cudaStreamCreateWithFlags(&ce[i][j], cudaStreamNonBlocking));
            CK(cudaEventCreateWithFlags(&ce_done[i][j], cudaEventDisableTiming));
        }
        CK(cudaEventCreate(&t0[i]));
        CK(cudaEventCreate(&t1[i]));
        CK(cudaEventCreateWithFlags(&opened[i], cudaEventDisableTiming));
        CK(cudaFuncSetAttribute(tma_push<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, 16 * 2 * 2048));
        CK(cudaFuncSetAttribute(tma_push<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 16 * 4 * 2048));
    }
    // GPU i's k-th peer; slot s of a buffer holds the bytes for (or from) the s-th peer.
    auto peer = [&](int i, int k) { return k < i ? k : k + 1; };
    auto index_of = [&](int j, int i) { return i < j ? i : i - 1; };  // i among j's peers
    std::vector<Ptrs> push_src(n), push_dst(n), pull_src(n), pull_dst(n);
    for (int i = 0; i < n; ++i) {
        for (int k = 0; k < n - 1; ++k) {
            const int j = peer(i, k);
            push_src[i].p[k] = reinterpret_cast<int4*>(src[i] + (size_t)k * B);
            push_dst[i].p[k] = reinterpret_cast<int4*>(dst[j] + (size_t)index_of(j, i) * B);
            pull_src[i].p[k] = reinterpret_cast<int4*>(src[j] + (size_t)index_of(j, i) * B);
            pull_dst[i].p[k] = reinterpret_cast<int4*>(dst[i] + (size_t)k * B);
        }
    }
    auto sync_all = [&]() {
        for (int i = 0; i < n; ++i) {
            CK(cudaSetDevice(i));
            CK(cudaDeviceSynchronize());
        }
    };
    std::string rows;
    enum Kind { SM, PULL, TMA2, TMA4, CE };
    auto run = [&](const char* name, Kind kind, int mode, int blocks, int threads, bool one_pair) {
        std::vector<double> ts;
        const int gpus = one_pair ? 1 : n, nd = one_pair ? 1 : n - 1;
        for (int rep = 0; rep < 14; ++rep) {
            sync_all();
            *open = 0;
            for (int i = 0; i < gpus; ++i) {
                CK(cudaSetDevice(i));
                gate<<<1, 1, 0, sm[i]>>>(open);
                CK(cudaEventRecord(t0[i], sm[i]));
                const Ptrs& s = kind == PULL ? pull_src[i] : push_src[i];
                const Ptrs& d = kind == PULL ? pull_dst[i] : push_dst[i];
                if (kind == SM || kind == PULL) {
                    copy<<<blocks, threads, 0, sm[i]>>>(s, d, B / 16, nd, mode);
                } else if (kind == TMA2) {
                    tma_push<2><<<blocks, threads, threads / 32 * 2 * 2048, sm[i]>>>(s, d, B / 16, nd);
                } else if (kind == TMA4) {
                    tma_push<4><<<blocks, threads, threads / 32 * 4 * 2048, sm[i]>>>(s, d, B / 16, nd);
                } else {
                    CK(cudaEventRecord(opened[i], sm[i]));
                    for (int k = 0; k < nd; ++k) {
                        CK(cudaStreamWaitEvent(ce[i][k], opened[i], 0));
                        CK(cudaMemcpyAsync(push_dst[i].p[k], push_src[i].p[k], B, cudaMemcpyDeviceToDevice, ce[i][k]));
                        CK(cudaEventRecord(ce_done[i][k], ce[i][k]));
                        CK(cudaStreamWaitEvent(sm[i], ce_done[i][k], 0));
                    }
                }
                CK(cudaGetLastError());
                CK(cudaEventRecord(t1[i], sm[i]));
            }
            __atomic_store_n(open, 1, __ATOMIC_SEQ_CST);
            sync_all();
            float worst = 0.f;
            for (int i = 0; i < gpus; ++i) {
                float ms;
                CK(cudaEventElapsedTime(&ms, t0[i], t1[i]));
                worst = std::max(worst, ms);
            }
            if (rep >= 4) ts.push_back(worst * 1e-3);
        }
        std::sort(ts.begin(), ts.end());
        const double t = ts[ts.size() / 2], gbs = B * nd / t / 1e9;
        printf("%-36s blocks=%4d threads=%4d  %8.1f us  %6.1f GB/s per GPU\n", name, blocks, threads, t * 1e6, gbs);
        fflush(stdout);
        char row[256];
        snprintf(row, sizeof row, "%s{\"case\":\"%s\",\"blocks\":%d,\"threads\":%d,\"us\":%.1f,\"gbps_per_gpu\":%.1f}",
                 rows.empty() ? "" : ",", name, blocks, threads, t * 1e6, gbs);
        rows += row;
    };
    printf("%d GPUs, %zu bytes per (source, destination) pair\n", n, B);
    run("copy engine, GPU0 -> GPU1", CE, 0, 0, 0, true);
    run("SM stores, GPU0 -> GPU1", SM, BLOCK_DEST, 132, 512, true);
    run("SM loads, GPU0 <- GPU1", PULL, BLOCK_DEST, 132, 512, true);
    run("copy engines, all-to-all", CE, 0, 0, 0, false);
    for (int b : {66, 132, 264}) run("SM block->destination", SM, BLOCK_DEST, b, 512, false);
    for (int th : {256, 512}) run("SM warp->destination 2K", SM, WARP_DEST, 132, th, false);
    for (int th : {256, 320, 512}) run("SM rotating 2K", SM, ROTATING, 132, th, false);
    run("SM block->destination scattered 2K", SM, BLOCK_SCATTERED, 132, 512, false);
    run("SM rotating scattered 2K", SM, ROTATING_SCATTERED, 132, 512, false);
    for (int b : {132, 264}) run("SM loads (pull) block<-source", PULL, BLOCK_DEST, b, 512, false);
    for (int th : {256, 512, 1024}) run("SM loads (pull) rotating 2K", PULL, ROTATING, 132, th, false);
    run("SM loads (pull) rotating scattered 2K", PULL, ROTATING_SCATTERED, 132, 512, false);
    for (int th : {128, 256, 512}) run("TMA push rotating 2K, 2 stages", TMA2, 0, 132, th, false);
    for (int th : {128, 256}) run("TMA push rotating 2K, 4 stages", TMA4, 0, 132, th, false);
    if (json) {
        FILE* f = fopen(json, "w");
        if (!f) {
            perror(json);
            return 1;
        }
        fprintf(f, "{\"gpus\":%d,\"bytes_per_pair\":%zu,\"rows\":[%s]}\n", n, B, rows.c_str());
        fclose(f);
        printf("wrote %s\n", json);
    }
    return 0;
}
