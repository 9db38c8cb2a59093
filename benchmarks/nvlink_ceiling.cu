// NVLink all-to-all ceilings of one host: how many bytes per second every GPU can push to all
// the others at once, with SM stores (several mappings of blocks and warps to destinations, 2 KiB
// chunks like the MoE combine's or contiguous ranges) and with the copy engines (one memcpy
// stream per peer). One process drives every GPU; each (source, destination) pair moves the same
// bytes; the time is the median of 10 rounds (all GPUs start together, the host waits for all).
//
//   nvcc -arch=sm_90a -O3 -o /tmp/nvlink_ceiling benchmarks/nvlink_ceiling.cu
//   /tmp/nvlink_ceiling [bytes per pair (default 53 MiB)] [json output path]
//
// Findings on 4x H200 (docs/all_to_all.md): SM stores reach about 335-342 GB/s per GPU whatever
// the mapping; copy engines about 190 GB/s in all-to-all (361 GB/s for one pair).
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

struct Dst {
    int4* p[8];
};

enum Mode {
    BLOCK_DEST = 0,      // block b writes destination b % nd, contiguous grid-stride ranges
    WARP_DEST = 1,       // warp w writes destination w % nd, 2 KiB chunks
    ROTATING = 2,        // items (chunk, destination), destination innermost, rotated per warp
    BLOCK_SCATTERED = 3, // block -> destination, 2 KiB chunks in a scattered order
    ROTATING_SCATTERED = 4,
};

__global__ void push(const int4* src, Dst dst, size_t nvec, int nd, int mode) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wpb = blockDim.x >> 5;
    const size_t nch = nvec / 128;  // 2 KiB chunks per destination
    auto chunk = [&](int d, size_t c) {
        for (int u = 0; u < 4; ++u) {
            const size_t k = c * 128 + lane + u * 32;
            dst.p[d][k] = src[d * nvec + k];
        }
    };
    if (mode == BLOCK_DEST || mode == BLOCK_SCATTERED) {
        const int d = blockIdx.x % nd;
        const size_t nb = gridDim.x / nd, bi = blockIdx.x / nd;
        if (bi >= nb) return;
        if (mode == BLOCK_DEST) {
            for (size_t k = bi * blockDim.x + threadIdx.x; k < nvec; k += nb * blockDim.x) dst.p[d][k] = src[d * nvec + k];
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
    std::vector<char*> src(n), dst(n);
    std::vector<cudaStream_t> sm(n);
    std::vector<std::vector<cudaStream_t>> ce(n, std::vector<cudaStream_t>(n));
    std::vector<Dst> dp(n);
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
        for (int j = 0; j < n; ++j) CK(cudaStreamCreateWithFlags(&ce[i][j], cudaStreamNonBlocking));
    }
    // dp[i].p[k]: GPU i's k-th peer's receive slot for GPU i.
    for (int i = 0; i < n; ++i) {
        int k = 0;
        for (int j = 0; j < n; ++j)
            if (j != i) dp[i].p[k++] = reinterpret_cast<int4*>(dst[j] + (size_t)i * B);
    }
    auto sync_all = [&]() {
        for (int i = 0; i < n; ++i) {
            CK(cudaSetDevice(i));
            CK(cudaDeviceSynchronize());
        }
    };
    std::string rows;
    // mode < 0: copy engines; otherwise SM stores.
    auto run = [&](const char* name, int mode, int blocks, int threads, bool one_pair) {
        std::vector<double> ts;
        for (int rep = 0; rep < 14; ++rep) {
            sync_all();
            const auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; i < (one_pair ? 1 : n); ++i) {
                CK(cudaSetDevice(i));
                if (mode >= 0) {
                    push<<<blocks, threads, 0, sm[i]>>>(reinterpret_cast<const int4*>(src[i]), dp[i], B / 16,
                                                        one_pair ? 1 : n - 1, mode);
                    CK(cudaGetLastError());
                    continue;
                }
                for (int k = 0; k < (one_pair ? 1 : n - 1); ++k)
                    CK(cudaMemcpyAsync(dp[i].p[k], src[i] + (size_t)k * B, B, cudaMemcpyDeviceToDevice, ce[i][k]));
            }
            sync_all();
            const auto t1 = std::chrono::steady_clock::now();
            if (rep >= 4) ts.push_back(std::chrono::duration<double>(t1 - t0).count());
        }
        std::sort(ts.begin(), ts.end());
        const double t = ts[ts.size() / 2], gbs = B * (one_pair ? 1 : n - 1) / t / 1e9;
        printf("%-34s blocks=%4d threads=%4d  %8.1f us  %6.1f GB/s per GPU\n", name, blocks, threads, t * 1e6, gbs);
        fflush(stdout);
        char row[256];
        snprintf(row, sizeof row, "%s{\"case\":\"%s\",\"blocks\":%d,\"threads\":%d,\"us\":%.1f,\"gbps_per_gpu\":%.1f}",
                 rows.empty() ? "" : ",", name, blocks, threads, t * 1e6, gbs);
        rows += row;
    };
    printf("%d GPUs, %zu bytes per (source, destination) pair\n", n, B);
    run("copy engine, GPU0 -> GPU1", -1, 0, 0, true);
    run("SM stores, GPU0 -> GPU1", BLOCK_DEST, 132, 512, true);
    run("copy engines, all-to-all", -1, 0, 0, false);
    for (int b : {66, 132, 264}) run("SM block->destination", BLOCK_DEST, b, 512, false);
    for (int th : {256, 512}) run("SM warp->destination 2K", WARP_DEST, 132, th, false);
    for (int th : {256, 320, 512}) run("SM rotating 2K", ROTATING, 132, th, false);
    run("SM block->destination scattered 2K", BLOCK_SCATTERED, 132, 512, false);
    run("SM rotating scattered 2K", ROTATING_SCATTERED, 132, 512, false);
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
