// Combine: the reverse of dispatch. Each rank first publishes its tokens' top-k weights to every
// peer (each weight a self-flagged word); each expert rank then sums, in fp32, the weighted
// outputs of its local experts for every (source, token) it received and stores one bf16 partial
// per 2 KiB chunk into the source's buffer (NVLink), raising one flag per chunk; the source adds
// the partials of the ranks its token went to (fp32) as their flags come up and writes
// [T, hidden] bf16.
#include "a2a_common.cuh"

using namespace a2a;

struct CombineCtx {
    uint32_t n, my_T, max_T;
    // Remote ranks (shared memory, filled by the prologue): where the rows of remote source s
    // for local expert el go in csend (seg[s] + base[s * L + el]), and where rows of my expert e
    // hosted by remote rank d come back in crecv (seg[d] + base[e]).
    const int *send_seg, *send_base, *recv_seg, *recv_base;
    uint32_t* wdone;  // the block's sending warps that finished
};

// Every thread of the block calls this. With the send half, every block then publishes its slice
// of my weights to every rank: (seq << 32) | fp32 bits per word, so a peer reads each weight as
// soon as it lands (no flag, no fence). Slices keep the blocks even (a few KiB each; one block
// per peer publishing everything started those blocks' partials late: 5 us at prefill). Seeing
// seq n in a weight also tells the peer that this rank finished its previous combine (it may
// overwrite my partials): launches of this rank are stream-ordered.
template <bool R>
__device__ __forceinline__ CombineCtx combine_prologue(const A2ACommon& c, const A2ACombineSendArgs* send, bool do_recv, uint32_t* s_T) {
    const uint32_t W = (uint32_t)c.world, K = (uint32_t)c.topk, me = (uint32_t)c.rank;
    const uint32_t L = (uint32_t)c.local_experts;
    __shared__ uint32_t s_n, s_my_T, s_wdone;
    __shared__ int s_send_seg[A2A_MAX_PEERS], s_recv_seg[A2A_MAX_PEERS];
    __shared__ int s_send_base[1024], s_recv_base[1024];  // W * L = num_experts <= MAX_EXPERTS
    if (threadIdx.x == 0) {
        uint32_t* ss = seq_slot(c, A2A_COMBINE_SEND);
        uint32_t* rs = seq_slot(c, A2A_COMBINE_RECV);
        uint32_t n;
        if (send) {
            const uint32_t sn = *ss, rn = *rs;  // written only by this block in earlier launches
            // The receive half of the previous combine must have run here before this send: the
            // next weights are what tell peers they may overwrite my partials.
            if (rn != sn && blockIdx.x == 0) set_error(c, A2A_ERR_CALL_ORDER);
            n = sn + 1;
            *ss = n;
            // The next call's work counter: the call before this one, which used it, is done.
            if (blockIdx.x == 0) reinterpret_cast<uint32_t*>(state_at(c, c.st_queue))[(n + 1) & 1] = 0;
            if (do_recv) *rs = n;
        } else {
            n = *rs + 1;
            *rs = n;
        }
        s_n = n;
        s_wdone = 0;
        s_my_T = *reinterpret_cast<const volatile uint32_t*>(state_at(c, c.st_my_tokens));
    }
    if (threadIdx.x < W) {
        s_T[threadIdx.x] = reinterpret_cast<const volatile uint32_t*>(state_at(c, c.st_recv_tokens))[threadIdx.x];
    }
    if (R) {
        // Per rank r (thread r): rows of remote source r per local expert (send side), rows of my
        // experts on remote rank r (receive side), each as a prefix over experts; then thread 0
        // the segments, a prefix over ranks (src/remote.rs: combine_segment_at_*).
        if (threadIdx.x < W) {
            const uint32_t r = threadIdx.x;
            int sent = 0, got = 0;
            if (!is_nvlink<R>(c, r)) {
                const int* rcnt = reinterpret_cast<const int*>(state_at(c, c.st_rcnt)) + r * L;
                const int* hist = reinterpret_cast<const int*>(state_at(c, c.st_hist)) + r * L;
                for (uint32_t el = 0; el < L; ++el) {
                    s_send_base[r * L + el] = sent;
                    sent += rcnt[el];
                    s_recv_base[r * L + el] = got;
                    got += hist[el];
                }
            }
            s_send_seg[r] = sent;
            s_recv_seg[r] = got;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int sent = 0, got = 0;
            for (uint32_t r = 0; r < W; ++r) {
                const int s1 = s_send_seg[r], g1 = s_recv_seg[r];
                s_send_seg[r] = sent;
                s_recv_seg[r] = got;
                sent += s1;
                got += g1;
            }
        }
    }
    __syncthreads();
    CombineCtx x;
    x.n = s_n;
    x.my_T = s_my_T;
    x.send_seg = s_send_seg;
    x.send_base = s_send_base;
    x.recv_seg = s_recv_seg;
    x.recv_base = s_recv_base;
    x.wdone = &s_wdone;
    x.max_T = 0;
    for (uint32_t s = 0; s < W; ++s) x.max_T = max(x.max_T, s_T[s]);

    if (send) {
        const A2ACombineSendArgs& a = *send;
        const float* w = reinterpret_cast<const float*>(a.weights);
        const uint32_t total = x.my_T * K, per = (total + gridDim.x - 1) / gridDim.x;
        const uint32_t lo = min(total, blockIdx.x * per), hi = min(total, lo + per);
        const uint64_t tag = (uint64_t)x.n << 32;
        const bool flat = a.weights_stride == K;
        float* keep = R ? reinterpret_cast<float*>(state_at(c, c.st_weights)) : nullptr;
        for (uint32_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            const float v = __ldg(flat ? w + i : w + (uint64_t)(i / K) * a.weights_stride + i % K);
            if (keep) keep[i] = v;  // a separate receive half weights the rows of remote ranks
            for (uint32_t d = 0; d < W; ++d) {
                if (!is_nvlink<R>(c, d)) continue;
                uint64_t* dst = reinterpret_cast<uint64_t*>(shared_of(c, d) + c.off_cw) + (uint64_t)me * c.max_tokens * K;
                st_relaxed_sys(dst + i, tag | __float_as_uint(v));
            }
        }
    }
    return x;
}

// Releases the flags of the partials this warp stored since the last flush (lane p holds the
// address of the p-th): the barrier orders every lane's stores before the (cumulative) release.
__device__ __forceinline__ void flush_flags(uint64_t* pend, uint32_t& npend, uint32_t n) {
    __syncwarp();
    if (lane_id() < npend) st_release_sys(pend, (uint64_t)n << 32);
    npend = 0;
}

// The remote part of a sending warp (`wi` of `nw` per block): items (record, chunk) of every
// remote source, its records in the order they arrived (numbered like dispatch's receive). Each
// slot of a record that came here returns its expert's row unweighted (zeros when it was
// dropped) into csend, packed per source by (local expert, position): the source weights and
// adds the k copies. The last sending warp of the launch raises cdone for the proxy.
template <bool R>
__device__ __forceinline__ void combine_send_remote(const A2ACombineSendArgs& a, const CombineCtx& x, const uint32_t* s_T,
                                                   uint32_t wi, uint32_t nw) {
    const A2ACommon& c = a.c;
    const uint32_t W = (uint32_t)c.world, K = (uint32_t)c.topk, L = (uint32_t)c.local_experts;
    const uint32_t lane = lane_id(), n = x.n, cp = n & 1;
    const uint32_t nvec = (uint32_t)(c.hidden * 2 / 16);
    const uint32_t nch = (nvec + A2A_CHUNK_VECS - 1) / A2A_CHUNK_VECS;
    uint32_t total = 0;
    for (uint32_t s = 0; s < W; ++s) total += is_nvlink<R>(c, s) ? 0 : s_T[s];
    const int* map = reinterpret_cast<const int*>(state_at(c, c.st_map));
    const int2* rhdr = reinterpret_cast<const int2*>(state_at(c, c.st_rhdr));
    const uint32_t gw = blockIdx.x * nw + wi, gws = gridDim.x * nw;
    for (uint32_t it = gw; it < total * nch; it += gws) {
        uint32_t rec_no = it / nch, s = 0;
        const uint32_t ch = it % nch;
        for (; s < W; ++s) {
            const uint32_t cnt = is_nvlink<R>(c, s) ? 0 : s_T[s];
            if (rec_no < cnt) break;
            rec_no -= cnt;
        }
        const uint64_t rslot = (uint64_t)s * c.max_tokens + rec_no;
        const int row = lane < K ? map[rslot * K + lane] : A2A_NOT_MINE;
        const int2 h = lane < K ? rhdr[rslot * K + lane] : make_int2(-1, -1);
        const int dest = row != A2A_NOT_MINE && h.x >= 0 ? x.send_seg[s] + x.send_base[s * L + h.x] + h.y : -1;
        const uint32_t v0 = ch * A2A_CHUNK_VECS, v1 = min(v0 + A2A_CHUNK_VECS, nvec);
        for (unsigned rem = __ballot_sync(0xffffffffu, dest >= 0); rem; rem &= rem - 1) {
            const int j = __ffs(rem) - 1;
            const int rj = __shfl_sync(0xffffffffu, row, j), dj = __shfl_sync(0xffffffffu, dest, j);
            int4* out = reinterpret_cast<int4*>(c.csend + ((uint64_t)cp * c.csend_rows + (uint64_t)dj) * c.hidden * 2);
            const int4* src = reinterpret_cast<const int4*>(a.expert_out + (uint64_t)max(rj, 0) * a.expert_out_stride);
#pragma unroll
            for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u) {
                const uint32_t k = v0 + lane + u * 32;
                if (k < v1) out[k] = rj >= 0 ? __ldg(src + k) : make_int4(0, 0, 0, 0);
            }
        }
    }
    __syncwarp();
    uint32_t* blocks = reinterpret_cast<uint32_t*>(state_at(c, c.st_cdone_blocks)) + cp;
    if (lane == 0 && last_sender(x.wdone, nw, blocks)) {
        *blocks = 0;  // for call n + 2
        const uint32_t dn = *reinterpret_cast<const volatile uint32_t*>(state_at(c, c.st_last_dseq));
        st_release_sys(blk_u64(c, c.blk_cdone), ((uint64_t)n << 32) | dn);
    }
}

// A sending warp: items (token, chunk, source), source innermost (every peer's NVLink busy at
// once), token outermost (the order the sources consume them in). Warps take the next item from
// a counter shared by the whole launch: items differ in cost (rows per token, local or remote,
// how long a release waits behind the NVLink queue), and with a fixed share per warp the last
// warps ended ~60 us after the mean (prefill combine 498 -> 478 us with the counter).
template <bool R>
__device__ __forceinline__ void combine_send_items(const A2ACombineSendArgs& a, const CombineCtx& x, const uint32_t* s_T,
                                                   uint32_t wi, uint32_t nw) {
    const A2ACommon& c = a.c;
    const uint32_t W = (uint32_t)c.world, K = (uint32_t)c.topk, me = (uint32_t)c.rank;
    const uint32_t lane = lane_id(), n = x.n;
    const uint32_t nvec = (uint32_t)(c.hidden * 2 / 16);
    const uint32_t nch = (nvec + A2A_CHUNK_VECS - 1) / A2A_CHUNK_VECS;
    const uint32_t items = x.max_T * nch * W;  // < 2^31 (Config::validate)
    const int* map = reinterpret_cast<const int*>(state_at(c, c.st_map));
    const uint8_t* mine = shared_of(c, me);
    const uint64_t* cw = reinterpret_cast<const uint64_t*>(mine + c.off_cw);
    uint64_t* pend = nullptr;
    uint32_t npend = 0;
    uint32_t* queue = reinterpret_cast<uint32_t*>(state_at(c, c.st_queue)) + (n & 1);
    auto next = [&]() {
        uint32_t it = 0;
        if (lane == 0) it = atomicAdd(queue, 1u);
        return __shfl_sync(0xffffffffu, it, 0);
    };
    for (uint32_t it = next(); it < items; it = next()) {
        const uint32_t s = it % W, rest = it / W;
        const uint32_t ch = rest % nch, t = rest / nch;
        if (t >= s_T[s] || !is_nvlink<R>(c, s)) continue;  // remote sources: below
        const uint64_t slot = (uint64_t)s * c.max_tokens + t;
        const int row = lane < K ? map[slot * K + lane] : A2A_NOT_MINE;
        // A token that came here gets a partial (zeros if all its rows were dropped): its source
        // waits for one from every rank it sent the token to.
        if (!__any_sync(0xffffffffu, row != A2A_NOT_MINE)) continue;
        const unsigned m = __ballot_sync(0xffffffffu, row >= 0);
        const uint32_t v0 = ch * A2A_CHUNK_VECS, v1 = min(v0 + A2A_CHUNK_VECS, nvec);
        // Rows in groups of A2A_GROUP: every load of a group is in flight before the first FMA.
        // The first group's loads are issued before waiting for the source's weights.
        unsigned rem = m;
        int rr[A2A_GROUP], jj[A2A_GROUP];
        int4 v[A2A_GROUP][A2A_CHUNK_VECS / 32];
        auto load_group = [&]() {
#pragma unroll
            for (int g = 0; g < A2A_GROUP; ++g) {
                rr[g] = -1;
                jj[g] = 0;
                if (rem) {  // warp-uniform
                    jj[g] = __ffs(rem) - 1;
                    rem &= rem - 1;
                    rr[g] = __shfl_sync(0xffffffffu, row, jj[g]);
                }
            }
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
        };
        load_group();
        // The weights of the slots that came here (also what orders my stores into the source's
        // partials after its previous combine: every routed slot's word is waited for).
        uint64_t word;
        if (!wait_words(c, cw + slot * K + lane, n, row != A2A_NOT_MINE, word)) continue;  // timed out
        const float w = row >= 0 ? __uint_as_float((uint32_t)word) : 0.f;
        float acc[A2A_CHUNK_VECS / 32][8];
#pragma unroll
        for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u)
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[u][q] = 0.f;
        for (;;) {
#pragma unroll
            for (int g = 0; g < A2A_GROUP; ++g) {
                const float wg = __shfl_sync(0xffffffffu, w, jj[g]);
                if (rr[g] < 0) continue;
#pragma unroll
                for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u) {
                    const uint32_t k = v0 + lane + u * 32;
                    if (k < v1) fma_bf16x8(acc[u], v[g][u], wg);
                }
            }
            if (!rem) break;
            load_group();
        }
        const uint64_t my_slot = (uint64_t)me * c.max_tokens + t;
        uint8_t* peer = shared_of(c, s);
        int4* dst = reinterpret_cast<int4*>(peer + c.off_cdata + my_slot * c.hidden * 2);
#pragma unroll
        for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u) {
            const uint32_t k = v0 + lane + u * 32;
            if (k < v1) dst[k] = pack_bf16x8(acc[u]);
        }
        if (lane == npend) pend = reinterpret_cast<uint64_t*>(peer + c.off_ctf) + my_slot * nch + ch;
        if (++npend == A2A_FLUSH) flush_flags(pend, npend, n);
    }
    flush_flags(pend, npend, n);
    if (R) combine_send_remote<R>(a, x, s_T, wi, nw);
}

// Receive warp `wi` of `nw` per block: items (token, chunk); each adds the partials of the ranks
// the token went to as their flags come up. Rows past the live token count are zeroed.
// With remote ranks, `w` / `w_stride` are my top-k weights (the rows remote ranks return are
// unweighted): the send half's own weights when fused, else the copy its prologue kept.
template <bool R>
__device__ __forceinline__ void combine_recv_items(const A2ACombineRecvArgs& a, const CombineCtx& x, uint32_t wi, uint32_t nw,
                                                   const float* w, uint64_t w_stride) {
    const A2ACommon& c = a.c;
    const uint32_t lane = lane_id(), n = x.n;
    const uint32_t T = min(x.my_T, (uint32_t)a.num_rows);
    const uint32_t nvec = (uint32_t)(c.hidden * 2 / 16);
    const uint32_t nch = (nvec + A2A_CHUNK_VECS - 1) / A2A_CHUNK_VECS;
    const uint32_t items = (uint32_t)a.num_rows * nch;  // < 2^31 (Config::validate)
    const uint32_t gw = blockIdx.x * nw + wi, gws = gridDim.x * nw;
    const uint8_t* mine = shared_of(c, c.rank);
    const uint64_t* ctf = reinterpret_cast<const uint64_t*>(mine + c.off_ctf);
    const uint64_t* token_mask = reinterpret_cast<const uint64_t*>(state_at(c, c.st_token_mask));
    uint64_t far_ready = 0;  // remote ranks whose rows this warp saw complete (this call)
    for (uint32_t it = gw; it < items; it += gws) {
        const uint32_t t = it / nch, ch = it % nch;
        const uint64_t mask = t < T ? token_mask[t] : 0ull;
        float acc[A2A_CHUNK_VECS / 32][8];
#pragma unroll
        for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u)
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[u][q] = 0.f;
        const uint32_t v0 = ch * A2A_CHUNK_VECS, v1 = min(v0 + A2A_CHUNK_VECS, nvec);
        // Lane l waits for the partials of ranks l and l + 32 (if the token went there): one round
        // trip for all. A remote rank's flag is the proxy's: every row it returns for this call arrived.
        auto flag_of = [&](uint32_t d) {
            return d < c.world && !is_nvlink<R>(c, d) ? blk_u64(c, c.blk_crflag) + d
                                                      : ctf + ((uint64_t)d * c.max_tokens + t) * nch + ch;
        };
        // Remote ranks' flags (host memory) once per warp and call, through wait_host_flag (one
        // poller per grid); then the NVLink peers' words.
        const auto remote = [&](uint32_t d) {
            return d < c.world && ((mask >> d) & 1ull) && !is_nvlink<R>(c, d) && !((far_ready >> d) & 1ull);
        };
        const auto nvlink = [&](uint32_t d) { return d < c.world && ((mask >> d) & 1ull) && is_nvlink<R>(c, d); };
        bool far = true, up_lo = false, up_hi = false;
        if (remote(lane)) {
            up_lo = wait_host_flag(c, flag_of(lane), A2A_HOST_KEY_ROWS + lane, n) != 0;
            far = up_lo;
        }
        if (c.world > 32 && remote(lane + 32)) {
            up_hi = wait_host_flag(c, flag_of(lane + 32), A2A_HOST_KEY_ROWS + lane + 32, n) != 0;
            far = up_hi && far;
        }
        far_ready |= (uint64_t)__ballot_sync(0xffffffffu, up_lo) | ((uint64_t)__ballot_sync(0xffffffffu, up_hi) << 32);
        uint64_t flag;
        bool ok = __all_sync(0xffffffffu, far);
        ok = wait_words(c, flag_of(lane), n, nvlink(lane), flag) && ok;
        if (c.world > 32) {
            const uint32_t d = lane + 32;
            ok = wait_words(c, flag_of(d), n, nvlink(d), flag) && ok;
        }
        const uint64_t got = ok ? mask : 0ull;  // timed out (reported)
        const uint64_t nvm = nvmask_of<R>(c);
        // Partials in groups of A2A_GROUP ranks, every load of a group in flight before the adds.
        for (uint64_t rem = got & nvm; rem;) {
            int dd[A2A_GROUP];
#pragma unroll
            for (int g = 0; g < A2A_GROUP; ++g) {
                dd[g] = -1;
                if (rem) {  // warp-uniform
                    dd[g] = (int)first_rank(rem);
                    rem &= rem - 1;
                }
            }
            int4 v[A2A_GROUP][A2A_CHUNK_VECS / 32];
#pragma unroll
            for (int g = 0; g < A2A_GROUP; ++g) {
                if (dd[g] < 0) continue;
                const uint64_t slot = (uint64_t)dd[g] * c.max_tokens + t;
                const int4* src = reinterpret_cast<const int4*>(mine + c.off_cdata + slot * c.hidden * 2);
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
        if (got & ~nvm) {
            // The k copies from remote ranks: slot j's row is at seg[d] + base[e] + position.
            const uint32_t K = (uint32_t)c.topk, L = (uint32_t)c.local_experts;
            int idx = -1;
            float wj = 0.f;
            if (lane < K) {
                const int2 es = reinterpret_cast<const int2*>(state_at(c, c.st_sslot))[(uint64_t)t * K + lane];
                if (es.x >= 0 && !is_nvlink<R>(c, (uint32_t)es.x / L)) {
                    idx = x.recv_seg[es.x / L] + x.recv_base[es.x] + es.y;
                    wj = w[(uint64_t)t * w_stride + lane];
                }
            }
            const uint8_t* crecv = reinterpret_cast<const uint8_t*>(c.crecv) + (uint64_t)(n & 1) * c.crecv_rows * c.hidden * 2;
            for (unsigned rem = __ballot_sync(0xffffffffu, idx >= 0); rem; rem &= rem - 1) {
                const int j = __ffs(rem) - 1;
                const int r = __shfl_sync(0xffffffffu, idx, j);
                const float wr = __shfl_sync(0xffffffffu, wj, j);
                const int4* src = reinterpret_cast<const int4*>(crecv + (uint64_t)r * c.hidden * 2);
#pragma unroll
                for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u) {
                    const uint32_t k = v0 + lane + u * 32;
                    if (k < v1) fma_bf16x8(acc[u], ld_volatile_v4(src + k), wr);
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
}

template <bool R>
__device__ __forceinline__ void a2a_combine_send_body(const A2ACombineSendArgs& a) {
    __shared__ uint32_t s_T[A2A_MAX_PEERS];
    const CombineCtx x = combine_prologue<R>(a.c, &a, false, s_T);
    combine_send_items<R>(a, x, s_T, threadIdx.x / 32, A2A_WARPS);
}

template <bool R>
__device__ __forceinline__ void a2a_combine_recv_body(const A2ACombineRecvArgs& a) {
    __shared__ uint32_t s_T[A2A_MAX_PEERS];
    const CombineCtx x = combine_prologue<R>(a.c, nullptr, true, s_T);
    combine_recv_items<R>(a, x, threadIdx.x / 32, A2A_WARPS, reinterpret_cast<const float*>(state_at(a.c, a.c.st_weights)),
                       a.c.topk);
}

// Both halves in one launch (see a2a_dispatch): with send_warps < A2A_WARPS the other warps
// add partials as they arrive while the sending warps still compute and store.
template <bool R>
__device__ __forceinline__ void a2a_combine_body(const A2ACombineArgs& a) {
    __shared__ uint32_t s_T[A2A_MAX_PEERS];
    const CombineCtx x = combine_prologue<R>(a.send.c, &a.send, true, s_T);
    const uint32_t warp = threadIdx.x / 32;
    const uint32_t S = (uint32_t)a.send_warps;
    if (S == 0 || S >= A2A_WARPS) {
        combine_send_items<R>(a.send, x, s_T, warp, A2A_WARPS);
        combine_recv_items<R>(a.recv, x, warp, A2A_WARPS, reinterpret_cast<const float*>(a.send.weights), a.send.weights_stride);
    } else if (warp < S) {
        combine_send_items<R>(a.send, x, s_T, warp, S);
    } else {
        combine_recv_items<R>(a.recv, x, warp - S, A2A_WARPS - S, reinterpret_cast<const float*>(a.send.weights),
                           a.send.weights_stride);
    }
}

// The two builds of every kernel (see nvmask_of in a2a_common.cuh); the host picks one per object.
extern "C" __global__ void __launch_bounds__(512) a2a_combine_send(const A2ACombineSendArgs a) { a2a_combine_send_body<false>(a); }
extern "C" __global__ void __launch_bounds__(512) a2a_combine_send_remote(const A2ACombineSendArgs a) { a2a_combine_send_body<true>(a); }
extern "C" __global__ void __launch_bounds__(512) a2a_combine_recv(const A2ACombineRecvArgs a) { a2a_combine_recv_body<false>(a); }
extern "C" __global__ void __launch_bounds__(512) a2a_combine_recv_remote(const A2ACombineRecvArgs a) { a2a_combine_recv_body<true>(a); }
extern "C" __global__ void __launch_bounds__(512) a2a_combine(const A2ACombineArgs a) { a2a_combine_body<false>(a); }
extern "C" __global__ void __launch_bounds__(512) a2a_combine_remote(const A2ACombineArgs a) { a2a_combine_body<true>(a); }
