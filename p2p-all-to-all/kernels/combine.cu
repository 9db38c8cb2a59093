// Combine: the reverse of dispatch. Each rank first publishes its tokens' top-k weights to every
// peer; each expert rank then sums, in fp32, the weighted outputs of its local experts for every
// (source, token) it received and stores one bf16 partial row into the source's buffer (NVLink);
// the source adds the partials of the ranks its token went to (fp32) and writes [T, hidden] bf16.
#include "a2a_common.cuh"

using namespace a2a;

__device__ __forceinline__ void combine_send_body(const A2ACombineSendArgs& a) {
    const A2ACommon& c = a.c;
    const uint32_t W = (uint32_t)c.world, K = (uint32_t)c.topk, me = (uint32_t)c.rank;
    const uint32_t lane = lane_id();
    __shared__ uint32_t s_n, s_T[A2A_MAX_PEERS], s_my_T;
    if (threadIdx.x == 0) {
        s_n = next_seq(c, A2A_COMBINE_SEND);
        s_my_T = *reinterpret_cast<const volatile uint32_t*>(state_at(c, c.st_my_tokens));
    }
    if (threadIdx.x < W) {
        s_T[threadIdx.x] = reinterpret_cast<const volatile uint32_t*>(state_at(c, c.st_recv_tokens))[threadIdx.x];
    }
    __syncthreads();
    const uint32_t n = s_n;

    // Blocks 0..W-1 publish my weights to peer blockIdx.x first (they never wait before that,
    // so the peers' waits below always make progress).
    if (blockIdx.x < W) {
        const uint32_t d = blockIdx.x;
        float* dst = reinterpret_cast<float*>(shared_of(c, d) + c.off_cw) + (uint64_t)me * c.max_tokens * K;
        const float* w = reinterpret_cast<const float*>(a.weights);
        const uint32_t total = s_my_T * K;
        for (uint32_t i = threadIdx.x; i < total; i += blockDim.x) {
            const uint32_t t = i / K, j = i % K;
            dst[i] = __ldg(w + (uint64_t)t * a.weights_stride + j);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            fence_acq_rel_sys();
            uint64_t* flag = reinterpret_cast<uint64_t*>(shared_of(c, d) + c.off_cwflag) + me;
            st_release_sys(flag, (uint64_t)n << 32);
        }
    }

    const uint32_t nvec = (uint32_t)(c.hidden * 2 / 16);
    const uint32_t nchunks = (nvec + A2A_CHUNK_VECS - 1) / A2A_CHUNK_VECS;
    // Items (token, chunk, source) with the source innermost: at any moment the warps write to
    // every peer at once (source-major order would drain the NVLink of one peer at a time).
    uint32_t max_T = 0;
    for (uint32_t s = 0; s < W; ++s) max_T = max(max_T, s_T[s]);
    const uint32_t items = max_T * nchunks * W;
    const uint32_t gwarp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const uint32_t gwarps = gridDim.x * (blockDim.x / 32);
    const int* map = reinterpret_cast<const int*>(state_at(c, c.st_map));
    const uint8_t* mine = shared_of(c, me);
    uint32_t seen = 0;  // sources whose weights this warp has waited for
    for (uint32_t it = gwarp; it < items; it += gwarps) {
        const uint32_t s = it % W, rest = it / W;
        const uint32_t t = rest / nchunks, ch = rest % nchunks;
        if (t >= s_T[s]) continue;
        const uint64_t slot = (uint64_t)s * c.max_tokens + t;
        const int row = lane < K ? map[slot * K + lane] : -1;
        const unsigned m = __ballot_sync(0xffffffffu, row >= 0);
        if (m == 0) continue;
        if (!(seen & (1u << s))) {
            // Every lane acquires (same word): the weights read below are ordered after it.
            wait_flag(c, reinterpret_cast<const uint64_t*>(mine + c.off_cwflag) + s, n);
            seen |= 1u << s;
        }
        float w = 0.f;
        if (row >= 0) w = __ldcg(reinterpret_cast<const float*>(mine + c.off_cw) + slot * K + lane);
        float acc[A2A_CHUNK_VECS / 32][8];
#pragma unroll
        for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u)
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[u][q] = 0.f;
        const uint32_t v0 = ch * A2A_CHUNK_VECS, v1 = min(v0 + A2A_CHUNK_VECS, nvec);
        // Rows in groups of A2A_GROUP: every load of a group is in flight before the first FMA.
        for (unsigned rem = m; rem;) {
            int rr[A2A_GROUP];
            float ww[A2A_GROUP];
#pragma unroll
            for (int g = 0; g < A2A_GROUP; ++g) {
                rr[g] = -1;
                ww[g] = 0.f;
                if (rem) {  // warp-uniform
                    const int j = __ffs(rem) - 1;
                    rem &= rem - 1;
                    rr[g] = __shfl_sync(0xffffffffu, row, j);
                    ww[g] = __shfl_sync(0xffffffffu, w, j);
                }
            }
            int4 v[A2A_GROUP][A2A_CHUNK_VECS / 32];
#pragma unroll
            for (int g = 0; g < A2A_GROUP; ++g) {
                if (rr[g] < 0) continue;
                const int4* src = reinterpret_cast<const int4*>(a.expert_out + (uint64_t)rr[g] * a.expert_out_stride);
#pragma unroll
                for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u) {
                    const uint32_t k = v0 + lane + u * 32;
                    if (k < v1) v[g][u] = __ldg(src + k);
                }
            }
#pragma unroll
            for (int g = 0; g < A2A_GROUP; ++g) {
                if (rr[g] < 0) continue;
#pragma unroll
                for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u) {
                    const uint32_t k = v0 + lane + u * 32;
                    if (k < v1) fma_bf16x8(acc[u], v[g][u], ww[g]);
                }
            }
        }
        int4* dst = reinterpret_cast<int4*>(shared_of(c, s) + c.off_cdata + ((uint64_t)me * c.max_tokens + t) * c.hidden * 2);
#pragma unroll
        for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u) {
            const uint32_t k = v0 + lane + u * 32;
            if (k < v1) dst[k] = pack_bf16x8(acc[u]);
        }
    }

    if (last_block_done(c, A2A_COMBINE_SEND, n)) {
        for (uint32_t s = 0; s < W; ++s) {
            uint64_t* flag = reinterpret_cast<uint64_t*>(shared_of(c, s) + c.off_cflag) + me;
            st_release_sys(flag, (uint64_t)n << 32);
        }
    }
}

__device__ __forceinline__ void combine_recv_body(const A2ACombineRecvArgs& a) {
    const A2ACommon& c = a.c;
    const uint32_t W = (uint32_t)c.world;
    const uint32_t lane = lane_id();
    __shared__ uint32_t s_n, s_T;
    __shared__ uint32_t s_ok[A2A_MAX_PEERS];
    const uint8_t* mine = shared_of(c, c.rank);
    if (threadIdx.x == 0) {
        s_n = next_seq(c, A2A_COMBINE_RECV);
        s_T = min(*reinterpret_cast<const volatile uint32_t*>(state_at(c, c.st_my_tokens)), (uint32_t)a.num_rows);
    }
    __syncthreads();
    const uint32_t n = s_n, T = s_T;
    if (threadIdx.x < W) {
        s_ok[threadIdx.x] = wait_flag(c, reinterpret_cast<const uint64_t*>(mine + c.off_cflag) + threadIdx.x, n) != 0;
    }
    __syncthreads();
    uint32_t ok = 0;
    for (uint32_t d = 0; d < W; ++d) ok |= s_ok[d] << d;

    const uint32_t nvec = (uint32_t)(c.hidden * 2 / 16);
    const uint32_t nchunks = (nvec + A2A_CHUNK_VECS - 1) / A2A_CHUNK_VECS;
    const uint32_t items = (uint32_t)a.num_rows * nchunks;
    const uint32_t gwarp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const uint32_t gwarps = gridDim.x * (blockDim.x / 32);
    const uint32_t* token_mask = reinterpret_cast<const uint32_t*>(state_at(c, c.st_token_mask));
    for (uint32_t it = gwarp; it < items; it += gwarps) {
        const uint32_t t = it / nchunks, ch = it % nchunks;
        const uint32_t mask = t < T ? (token_mask[t] & ok) : 0u;
        float acc[A2A_CHUNK_VECS / 32][8];
#pragma unroll
        for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u)
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[u][q] = 0.f;
        const uint32_t v0 = ch * A2A_CHUNK_VECS, v1 = min(v0 + A2A_CHUNK_VECS, nvec);
        // Partials in groups of A2A_GROUP ranks, every load of a group in flight before the adds.
        for (uint32_t rem = mask; rem;) {
            int dd[A2A_GROUP];
#pragma unroll
            for (int g = 0; g < A2A_GROUP; ++g) {
                dd[g] = -1;
                if (rem) {  // warp-uniform
                    dd[g] = __ffs(rem) - 1;
                    rem &= rem - 1;
                }
            }
            int4 v[A2A_GROUP][A2A_CHUNK_VECS / 32];
#pragma unroll
            for (int g = 0; g < A2A_GROUP; ++g) {
                if (dd[g] < 0) continue;
                const int4* src = reinterpret_cast<const int4*>(mine + c.off_cdata + ((uint64_t)dd[g] * c.max_tokens + t) * c.hidden * 2);
#pragma unroll
                for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u) {
                    const uint32_t k = v0 + lane + u * 32;
                    if (k < v1) v[g][u] = __ldcg(src + k);
                }
            }
#pragma unroll
            for (int g = 0; g < A2A_GROUP; ++g) {
                if (dd[g] < 0) continue;
#pragma unroll
                for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u) {
                    const uint32_t k = v0 + lane + u * 32;
                    if (k < v1) fma_bf16x8(acc[u], v[g][u], 1.f);
                }
            }
        }
        int4* out = reinterpret_cast<int4*>(a.out + (uint64_t)t * a.out_stride);
#pragma unroll
        for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u) {
            const uint32_t k = v0 + lane + u * 32;
            if (k < v1) out[k] = pack_bf16x8(acc[u]);
        }
    }

    last_block_done(c, A2A_COMBINE_RECV, n);
}

extern "C" __global__ void __launch_bounds__(512) a2a_combine_send(const A2ACombineSendArgs a) {
    combine_send_body(a);
}

extern "C" __global__ void __launch_bounds__(512) a2a_combine_recv(const A2ACombineRecvArgs a) {
    combine_recv_body(a);
}

// Both halves in one launch (see a2a_dispatch).
extern "C" __global__ void __launch_bounds__(512) a2a_combine(const A2ACombineArgs a) {
    combine_send_body(a.send);
    combine_recv_body(a.recv);
}
