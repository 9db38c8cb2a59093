// Dispatch: every token goes once to every rank hosting one of its top-k experts (NVLink stores
// into that rank's receive buffer), then the receiver lays the rows out expert-major.
#include "a2a_common.cuh"

using namespace a2a;

// Dynamic shared memory: hist[E] i32 (all tokens), base[E] i32 (tokens before this block's
// chunk, then running), pos[chunk * K] i32 (row of each (token, slot) among the rows this rank
// sends to the slot's expert, in (token, slot) order).
__device__ __forceinline__ void dispatch_send_body(const A2ADispatchSendArgs& a) {
    const A2ACommon& c = a.c;
    const uint32_t W = (uint32_t)c.world, E = (uint32_t)c.num_experts, K = (uint32_t)c.topk;
    const uint32_t L = (uint32_t)c.local_experts, me = (uint32_t)c.rank;
    const uint32_t lane = lane_id(), warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    extern __shared__ int smem[];
    int* hist = smem;
    int* base = smem + E;
    int* pos = smem + 2 * E;
    __shared__ uint32_t s_n, s_T;
    __shared__ int s_bad;

    if (threadIdx.x == 0) {
        s_n = next_seq(c, A2A_DISPATCH_SEND);
        uint32_t T = (uint32_t)a.num_tokens;
        if (a.num_tokens_ptr) {
            const int live = *reinterpret_cast<const volatile int*>(a.num_tokens_ptr);
            if (live < 0 || (uint32_t)live > T) {
                if (blockIdx.x == 0) set_error(c, A2A_ERR_BAD_NUM_TOKENS);
            } else {
                T = (uint32_t)live;
            }
        }
        s_T = T;
        s_bad = 0;
        if (blockIdx.x == 0) {
            *reinterpret_cast<uint32_t*>(state_at(c, c.st_my_tokens)) = T;
        }
    }
    for (uint32_t i = threadIdx.x; i < E; i += blockDim.x) {
        hist[i] = 0;
        base[i] = 0;
    }
    __syncthreads();
    const uint32_t n = s_n, T = s_T;
    // The previous dispatch's data in each destination must have been consumed.
    if (threadIdx.x < W && n > 1) {
        const uint64_t* ack = reinterpret_cast<const uint64_t*>(shared_of(c, me) + c.off_dack) + threadIdx.x;
        wait_flag(c, ack, n - 1);
    }

    // Histogram of every (token, slot) per expert, and of those before this block's chunk.
    const uint32_t chunk = (T + gridDim.x - 1) / gridDim.x;
    const uint32_t cs = min(blockIdx.x * chunk, T), ce = min(cs + chunk, T);
    const uint32_t total = T * K, before = cs * K;
    bool bad = false;
    for (uint32_t w0 = warp * 32; w0 < total; w0 += blockDim.x) {
        const uint32_t i = w0 + lane;
        const int e = i < total ? load_expert(a, i / K, i % K, bad) : -1;
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        const bool leader = (__ffs(peers) - 1) == (int)lane;
        if (e >= 0 && leader) atomicAdd(&hist[e], __popc(peers));
        const int eb = i < before ? e : -1;
        const unsigned peers_b = __match_any_sync(0xffffffffu, eb);
        if (eb >= 0 && (__ffs(peers_b) - 1) == (int)lane) atomicAdd(&base[eb], __popc(peers_b));
    }
    if (bad) s_bad = 1;
    __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x == 0 && s_bad) set_error(c, A2A_ERR_BAD_EXPERT);

    // Block 0 publishes the counts: to every destination its experts' rows, to the host block all.
    if (blockIdx.x == 0) {
        for (uint32_t e = threadIdx.x; e < E; e += blockDim.x) {
            const uint32_t d = e / L, el = e % L;
            int* dcnt = reinterpret_cast<int*>(shared_of(c, d) + c.off_dcnt);
            dcnt[me * L + el] = hist[e];
            if (a.publish_host_counts) {
                reinterpret_cast<volatile uint32_t*>(c.host + 128)[e] = (uint32_t)hist[e];
            }
        }
        if (a.publish_host_counts && threadIdx.x == 0) {
            reinterpret_cast<volatile uint64_t*>(c.host + 64)[0] = n;
        }
    }

    // Positions of this chunk's (token, slot)s, in order: warp 0, 32 entries at a time.
    if (warp == 0) {
        const uint32_t end = ce * K;
        for (uint32_t w0 = before; w0 < end; w0 += 32) {
            const uint32_t i = w0 + lane;
            bool ignored = false;
            const int e = i < end ? load_expert(a, i / K, i % K, ignored) : -1;
            const unsigned peers = __match_any_sync(0xffffffffu, e);
            const int rank_in = __popc(peers & ((1u << lane) - 1u));
            const int p = e >= 0 ? base[e] + rank_in : -1;
            __syncwarp();
            if (e >= 0 && (__ffs(peers) - 1) == (int)lane) base[e] += __popc(peers);
            __syncwarp();
            if (i < end) pos[i - before] = p;
        }
    }
    __syncthreads();

    // Copy: one warp per (token, 2 KiB chunk of the row): load the chunk once, store it to every
    // destination rank of the token.
    const uint32_t nvec = (uint32_t)(c.data_bytes / 16);
    const uint32_t nchunks = (nvec + A2A_CHUNK_VECS - 1) / A2A_CHUNK_VECS;
    const uint32_t items = (ce - cs) * nchunks;
    uint32_t* token_mask = reinterpret_cast<uint32_t*>(state_at(c, c.st_token_mask));
    for (uint32_t it = warp; it < items; it += nwarps) {
        const uint32_t t = cs + it / nchunks;
        const uint32_t ch = it % nchunks;
        int e = -1, p = -1;
        if (lane < K) {
            bool ignored = false;
            e = load_expert(a, t, lane, ignored);
            p = pos[(t - cs) * K + lane];
        }
        const uint32_t dmask = __reduce_or_sync(0xffffffffu, e >= 0 ? (1u << ((uint32_t)e / L)) : 0u);
        const uint64_t slot = (uint64_t)me * c.max_tokens + t;
        if (ch == 0) {
            // A header for every destination (all -1 where the token does not go).
            for (uint32_t d = 0; d < W; ++d) {
                int2* hdr = reinterpret_cast<int2*>(shared_of(c, d) + c.off_hdr) + slot * K;
                const bool mine = e >= 0 && (uint32_t)e / L == d;
                if (lane < K) hdr[lane] = mine ? make_int2(e % (int)L, p) : make_int2(-1, -1);
            }
            if (lane == 0) token_mask[t] = dmask;
        }
        if (dmask == 0) continue;
        const int4* src = reinterpret_cast<const int4*>(a.x + (uint64_t)t * a.x_stride);
        const uint32_t v0 = ch * A2A_CHUNK_VECS, v1 = min(v0 + A2A_CHUNK_VECS, nvec);
        int4 v[A2A_CHUNK_VECS / 32];
#pragma unroll
        for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u) {
            const uint32_t k = v0 + lane + u * 32;
            if (k < v1) v[u] = __ldg(src + k);
        }
        for (uint32_t rem = dmask; rem; rem &= rem - 1) {
            const uint32_t d = __ffs(rem) - 1;
            int4* out = reinterpret_cast<int4*>(shared_of(c, d) + c.off_data + slot * c.rec_bytes);
#pragma unroll
            for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u) {
                const uint32_t k = v0 + lane + u * 32;
                if (k < v1) out[k] = v[u];
            }
        }
        if (ch == 0 && c.num_scales) {
            const float* sc = reinterpret_cast<const float*>(a.scales + (uint64_t)t * a.scales_stride);
            for (uint32_t q = lane; q < c.num_scales; q += 32) {
                const float val = __ldg(sc + q);
                for (uint32_t rem = dmask; rem; rem &= rem - 1) {
                    const uint32_t d = __ffs(rem) - 1;
                    float* so = reinterpret_cast<float*>(shared_of(c, d) + c.off_data + slot * c.rec_bytes + c.data_bytes);
                    so[q] = val;
                }
            }
        }
    }

    if (last_block_done(c, A2A_DISPATCH_SEND, n)) {
        for (uint32_t d = 0; d < W; ++d) {
            uint64_t* flag = reinterpret_cast<uint64_t*>(shared_of(c, d) + c.off_dflag) + me;
            st_release_sys(flag, ((uint64_t)n << 32) | T);
        }
    }
}

// Waits for every source, computes each local expert's row offsets per source, then copies every
// received record into its rows of the expert-major output (one warp per (source, token, chunk)).
// Records the (source, token, slot) -> row map for combine, then acknowledges each source.
// Static shared memory: offsets for up to 1024 (local expert, source) pairs.
#define A2A_MAX_OFFSETS 4096
__device__ __forceinline__ void dispatch_recv_body(const A2ADispatchRecvArgs& a) {
    const A2ACommon& c = a.c;
    const uint32_t W = (uint32_t)c.world, K = (uint32_t)c.topk, L = (uint32_t)c.local_experts;
    const uint32_t me = (uint32_t)c.rank, max_rows = (uint32_t)c.max_rows;
    const uint32_t lane = lane_id();
    __shared__ int s_off[A2A_MAX_OFFSETS];  // [L][W]
    __shared__ uint32_t s_T[A2A_MAX_PEERS], s_ok[A2A_MAX_PEERS];
    __shared__ uint32_t s_n;
    uint8_t* mine = shared_of(c, me);

    if (threadIdx.x == 0) s_n = next_seq(c, A2A_DISPATCH_RECV);
    __syncthreads();
    const uint32_t n = s_n;
    if (threadIdx.x < W) {
        const uint64_t* flag = reinterpret_cast<const uint64_t*>(mine + c.off_dflag) + threadIdx.x;
        const uint64_t v = wait_flag(c, flag, n);
        s_ok[threadIdx.x] = v != 0;
        s_T[threadIdx.x] = v != 0 ? min((uint32_t)(v & 0xffffffffu), (uint32_t)c.max_tokens) : 0;
        if (blockIdx.x == 0) {
            reinterpret_cast<uint32_t*>(state_at(c, c.st_recv_tokens))[threadIdx.x] = s_T[threadIdx.x];
        }
    }
    __syncthreads();
    const int* dcnt = reinterpret_cast<const int*>(mine + c.off_dcnt);
    for (uint32_t el = threadIdx.x; el < L; el += blockDim.x) {
        int running = 0;
        for (uint32_t s = 0; s < W; ++s) {
            s_off[el * W + s] = running;
            running += s_ok[s] ? __ldcg(dcnt + s * L + el) : 0;
        }
        if (blockIdx.x == 0) {
            if (running > (int)max_rows) {
                set_error(c, A2A_ERR_EXPERT_OVERFLOW);
                running = (int)max_rows;
            }
            reinterpret_cast<int*>(a.out_counts)[el] = running;
        }
    }
    __syncthreads();

    const uint32_t nvec = (uint32_t)(c.data_bytes / 16);
    const uint32_t nchunks = (nvec + A2A_CHUNK_VECS - 1) / A2A_CHUNK_VECS;
    uint32_t items = 0;
    for (uint32_t s = 0; s < W; ++s) items += s_T[s] * nchunks;
    const uint32_t gwarp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const uint32_t gwarps = gridDim.x * (blockDim.x / 32);
    int* map = reinterpret_cast<int*>(state_at(c, c.st_map));
    const uint64_t row_bytes = c.data_bytes;
    for (uint32_t it = gwarp; it < items; it += gwarps) {
        uint32_t s = 0, rest = it;
        while (rest >= s_T[s] * nchunks) {
            rest -= s_T[s] * nchunks;
            ++s;
        }
        const uint32_t t = rest / nchunks, ch = rest % nchunks;
        const uint64_t slot = (uint64_t)s * c.max_tokens + t;
        int row = -1;
        if (lane < K) {
            const int2 h = __ldcg(reinterpret_cast<const int2*>(mine + c.off_hdr) + slot * K + lane);
            if (h.x >= 0 && (uint32_t)h.x < L && h.y >= 0) {
                const int r = s_off[h.x * W + s] + h.y;
                if (r < (int)max_rows) {
                    row = h.x * (int)max_rows + r;
                } else if (ch == 0) {
                    set_error(c, A2A_ERR_EXPERT_OVERFLOW);
                }
            }
            if (ch == 0) map[slot * K + lane] = row;
        }
        const unsigned m = __ballot_sync(0xffffffffu, row >= 0);
        if (m == 0) continue;
        const uint8_t* rec = mine + c.off_data + slot * c.rec_bytes;
        const int4* src = reinterpret_cast<const int4*>(rec);
        const uint32_t v0 = ch * A2A_CHUNK_VECS, v1 = min(v0 + A2A_CHUNK_VECS, nvec);
        int4 v[A2A_CHUNK_VECS / 32];
#pragma unroll
        for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u) {
            const uint32_t k = v0 + lane + u * 32;
            if (k < v1) v[u] = __ldcg(src + k);
        }
        for (unsigned rem = m; rem; rem &= rem - 1) {
            const int j = __ffs(rem) - 1;
            const int r = __shfl_sync(0xffffffffu, row, j);
            int4* out = reinterpret_cast<int4*>(a.out_x + (uint64_t)r * row_bytes);
#pragma unroll
            for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u) {
                const uint32_t k = v0 + lane + u * 32;
                if (k < v1) out[k] = v[u];
            }
            if (ch == 0 && c.num_scales) {
                const float* si = reinterpret_cast<const float*>(rec + c.data_bytes);
                float* so = reinterpret_cast<float*>(a.out_scales) + (uint64_t)r * c.num_scales;
                for (uint32_t q = lane; q < c.num_scales; q += 32) so[q] = __ldcg(si + q);
            }
        }
    }

    if (last_block_done(c, A2A_DISPATCH_RECV, n)) {
        for (uint32_t s = 0; s < W; ++s) {
            uint64_t* ack = reinterpret_cast<uint64_t*>(shared_of(c, s) + c.off_dack) + me;
            st_release_sys(ack, (uint64_t)n << 32);
        }
    }
}

extern "C" __global__ void __launch_bounds__(512, 2) a2a_dispatch_send(const A2ADispatchSendArgs a) {
    dispatch_send_body(a);
}

extern "C" __global__ void __launch_bounds__(512, 2) a2a_dispatch_recv(const A2ADispatchRecvArgs a) {
    dispatch_recv_body(a);
}

// Both halves in one launch (no launch gap; the receive prologue overlaps the peers' sends).
// Every block finishes its send part before waiting, and the flags a block waits for are raised
// by the last block of a send part, so blocks that are not resident yet only delay, never block.
extern "C" __global__ void __launch_bounds__(512, 2) a2a_dispatch(const A2ADispatchArgs a) {
    dispatch_send_body(a.send);
    dispatch_recv_body(a.recv);
}
