// Dispatch: every token goes once to every rank hosting one of its top-k experts (NVLink stores
// into that rank's receive buffer, one flag per token), and the receiver lays the rows out
// expert-major as soon as each token's flag is raised (no grid-wide barrier on either side).
#include "a2a_common.cuh"

using namespace a2a;

// The parity-indexed dispatch arrays of rank r's shared region.
struct DispatchArrays {
    uint64_t* dcf;  // [W]
    int* dcnt;      // [W][L]
    uint64_t* dtf;  // [W][Tmax]
    int2* hdr;      // [W][Tmax][K]
    uint8_t* data;  // [W][Tmax][rec]
};

__device__ __forceinline__ DispatchArrays dispatch_arrays(const A2ACommon& c, uint32_t r, uint32_t par) {
    const uint64_t W = c.world, T = c.max_tokens;
    uint8_t* base = shared_of(c, r);
    DispatchArrays d;
    d.dcf = reinterpret_cast<uint64_t*>(base + c.off_dcf) + par * W;
    d.dcnt = reinterpret_cast<int*>(base + c.off_dcnt) + par * W * c.local_experts;
    d.dtf = reinterpret_cast<uint64_t*>(base + c.off_dtf) + par * W * T;
    d.hdr = reinterpret_cast<int2*>(base + c.off_hdr) + par * W * T * c.topk;
    d.data = base + c.off_data + par * W * T * c.rec_bytes;
    return d;
}

// Adds the experts of flat entries [0, lim) of idx (entry i: token i / K, slot i % K) to arr
// (shared counters): 16-byte loads, four per thread in flight, when rows are contiguous.
__device__ __forceinline__ void count_experts(const A2ADispatchSendArgs& a, uint32_t lim, int* arr) {
    const uint32_t K = (uint32_t)a.c.topk;
    const int64_t E = (int64_t)a.c.num_experts;
    bool bad = false;
    auto count = [&](int64_t e) {
        if (e >= 0 && e < E) {
            atomicAdd(&arr[e], 1);
        } else if (e != -1) {
            bad = true;
        }
    };
    uint32_t done = 0;
    if (a.idx_stride == K && (a.idx & 15) == 0) {
        const uint32_t per = a.idx_is_64 ? 2 : 4;  // entries per 16 bytes
        const uint32_t nv = lim / per;
        const int4* v4 = reinterpret_cast<const int4*>(a.idx);
        for (uint32_t v0 = threadIdx.x; v0 < nv; v0 += 4 * blockDim.x) {
            int4 q[4];  // entries past the end read as -1 (no expert)
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const uint32_t v = v0 + u * blockDim.x;
                q[u] = v < nv ? __ldg(v4 + v) : make_int4(-1, -1, -1, -1);
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                if (a.idx_is_64) {
                    count((int64_t)(((uint64_t)(uint32_t)q[u].y << 32) | (uint32_t)q[u].x));
                    count((int64_t)(((uint64_t)(uint32_t)q[u].w << 32) | (uint32_t)q[u].z));
                } else {
                    count(q[u].x);
                    count(q[u].y);
                    count(q[u].z);
                    count(q[u].w);
                }
            }
        }
        done = nv * per;
    }
    for (uint32_t i = done + threadIdx.x; i < lim; i += blockDim.x) {
        const int e = load_expert(a, i / K, i % K, bad);
        if (e >= 0) atomicAdd(&arr[e], 1);
    }
    if (bad) set_error(a.c, A2A_ERR_BAD_EXPERT);
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

struct SendCtx {
    uint32_t n, T, cs, ce;
    const int* pos;  // [ce - cs][K] shared: row of each (token, slot) among my rows of its expert
    uint32_t* next;  // shared: the block's next token to send (offset in its chunk)
    uint32_t* wdone; // shared: the block's sending warps that finished (remote ranks only)
};

// Dynamic shared memory: base[E] i32 (rows of each expert before this block's tokens), hist[E]
// i32 (block 0: all rows, published as counts), pos[chunk * K] i32.
//
// Every thread of the block calls this; it ends with a block barrier. Block 0 publishes the
// per-expert counts (and the token count) to every rank before any token is sent.
template <bool R>
__device__ __forceinline__ SendCtx dispatch_send_prologue(const A2ADispatchSendArgs& a, bool fused) {
    const A2ACommon& c = a.c;
    const uint32_t W = (uint32_t)c.world, E = (uint32_t)c.num_experts, K = (uint32_t)c.topk;
    const uint32_t L = (uint32_t)c.local_experts, me = (uint32_t)c.rank;
    const uint32_t lane = lane_id(), warp = threadIdx.x / 32;
    extern __shared__ __align__(128) int smem[];
    int* base = smem;
    int* hist = smem + E;
    int* pos = smem + 2 * E;
    __shared__ uint32_t s_n, s_T, s_next, s_wdone;
    __shared__ uint32_t s_tokd[A2A_MAX_PEERS];  // block 0, remote ranks: tokens to each rank
    constexpr bool remote = R;

    // Pull this block's first token (by the rows of x) into L2 while the prologue runs.
    {
        const uint32_t rows = (uint32_t)a.num_tokens, ch_h = (rows + gridDim.x - 1) / gridDim.x;
        const uint32_t t0 = blockIdx.x * ch_h;
        if (t0 < rows) {
            const uint8_t* xr = reinterpret_cast<const uint8_t*>(a.x + (uint64_t)t0 * a.x_stride);
            for (uint32_t off = threadIdx.x * 128; off < c.data_bytes; off += blockDim.x * 128) prefetch_l2(xr + off);
            const uint32_t soff = (threadIdx.x - (blockDim.x - 2)) * 128;  // last two threads: scales
            if (a.scales && threadIdx.x >= blockDim.x - 2 && soff < c.num_scales * 4) {
                prefetch_l2(reinterpret_cast<const uint8_t*>(a.scales + (uint64_t)t0 * a.scales_stride) + soff);
            }
        }
    }

    if (threadIdx.x == 0) {
        uint32_t* ss = seq_slot(c, A2A_DISPATCH_SEND);
        uint32_t* rs = seq_slot(c, A2A_DISPATCH_RECV);
        const uint32_t sn = *ss, rn = *rs;  // written only by this block in earlier launches
        // The receive half of the previous dispatch must have run on this rank before this send:
        // the parity buffers rely on it (see the header of a2a_common.cuh).
        if (rn != sn && blockIdx.x == 0) set_error(c, A2A_ERR_CALL_ORDER);
        const uint32_t n = sn + 1;
        *ss = n;
        s_next = 0;
        if (remote) s_wdone = 0;
        if (fused) *rs = n;
        s_n = n;
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
        if (blockIdx.x == 0) *reinterpret_cast<uint32_t*>(state_at(c, c.st_my_tokens)) = T;
    }
    for (uint32_t i = threadIdx.x; i < 2 * E; i += blockDim.x) smem[i] = 0;
    if (remote && threadIdx.x < A2A_MAX_PEERS) s_tokd[threadIdx.x] = 0;
    __syncthreads();
    const uint32_t n = s_n, T = s_T, par = n & 1;
    const uint32_t chunk = (T + gridDim.x - 1) / gridDim.x;
    const uint32_t cs = min(blockIdx.x * chunk, T), ce = min(cs + chunk, T);

    // Histogram: block 0 of every (token, slot) (the counts it publishes), the other blocks of
    // those before their chunk (the base of their positions).
    count_experts(a, blockIdx.x == 0 ? T * K : (cs < ce ? cs * K : 0), blockIdx.x == 0 ? hist : base);
    if (remote && blockIdx.x == 0) {
        // Tokens (records) to each rank: what the proxy writes per remote rank.
        for (uint32_t t = threadIdx.x; t < T; t += blockDim.x) {
            uint64_t m = 0;
            for (uint32_t j = 0; j < K; ++j) {
                bool ignored = false;
                const int e = load_expert(a, t, j, ignored);
                if (e >= 0) m |= 1ull << (e / (int)L);
            }
            for (; m; m &= m - 1) atomicAdd(&s_tokd[first_rank(m)], 1u);
        }
    }
    __syncthreads();

    if (blockIdx.x == 0) {
        // Counts to every destination (its experts' rows from me), then its count flag.
        for (uint32_t e = threadIdx.x; e < E; e += blockDim.x) {
            const uint32_t d = e / L, el = e % L;
            if (is_nvlink<R>(c, d)) dispatch_arrays(c, d, par).dcnt[me * L + el] = hist[e];
            if (a.publish_host_counts) {
                reinterpret_cast<volatile uint32_t*>(c.host + 128)[e] = (uint32_t)hist[e];
            }
            if (remote) {
                reinterpret_cast<volatile uint32_t*>(c.blk + c.blk_pub_hist)[par * E + e] = (uint32_t)hist[e];
                reinterpret_cast<int*>(state_at(c, c.st_hist))[e] = hist[e];
            }
        }
        if (remote && threadIdx.x < W) {
            reinterpret_cast<volatile uint32_t*>(c.blk + c.blk_pub_tok)[par * W + threadIdx.x] = s_tokd[threadIdx.x];
        }
        if (a.publish_host_counts && threadIdx.x == 0) {
            reinterpret_cast<volatile uint64_t*>(c.host + 64)[0] = n;
        }
        __syncthreads();
        // Release (cumulative through the barrier): the counts above are visible before the flag.
        if (threadIdx.x < W && is_nvlink<R>(c, threadIdx.x)) {
            st_release_sys(dispatch_arrays(c, threadIdx.x, par).dcf + me, ((uint64_t)n << 32) | T);
        }
        // The proxy sends the counts to every rank while the tokens are still being copied.
        if (remote && threadIdx.x == 0) st_release_sys(blk_u64(c, c.blk_dseq), n);
    }

    // Positions of this chunk's (token, slot)s in (token, slot) order: one warp, 32 at a time.
    if (warp == 0) {
        const uint32_t before = cs * K, end = ce * K;
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
            if (i < end) {
                pos[i - before] = p;
                // Where this slot's row comes back from a remote rank (combine receive).
                if (remote) reinterpret_cast<int2*>(state_at(c, c.st_sslot))[i] = make_int2(e, p);
            }
        }
    }
    __syncthreads();
    SendCtx x;
    x.n = n;
    x.T = T;
    x.cs = cs;
    x.ce = ce;
    x.pos = pos;
    x.next = &s_next;
    x.wdone = &s_wdone;
    return x;
}

// Bulk-copy state of one sending warp: a record buffer in shared memory and its mbarrier.
struct TmaSlot {
    uint8_t* buf;   // nullptr: move tokens through registers
    uint64_t* bar;
    uint32_t phase;
};

// One warp sends token t: its values and scales to every rank hosting one of its experts, the
// header of each slot to the slot's rank, then (release) the token's flag to every rank, carrying
// the slots that are that rank's (0: not for it). With a TmaSlot buffer, lane 0 loads the record
// into shared memory with the bulk copy engine and stores it from there to every destination.
template <bool R, bool WIDE>
__device__ __forceinline__ void send_token(const A2ADispatchSendArgs& a, uint32_t n, uint32_t t, const int* pos_t, TmaSlot& tma) {
    const A2ACommon& c = a.c;
    const uint32_t W = (uint32_t)c.world, K = (uint32_t)c.topk, L = (uint32_t)c.local_experts;
    const uint32_t me = (uint32_t)c.rank, lane = lane_id(), par = n & 1;
    int e = -1, p = -1;
    if (lane < K) {
        bool ignored = false;
        e = load_expert(a, t, lane, ignored);
        p = pos_t[lane];
    }
    const int dst = e >= 0 ? e / (int)L : -1;
    const uint32_t dests_lo = __reduce_or_sync(0xffffffffu, dst >= 0 && dst < 32 ? 1u << dst : 0u);
    const uint32_t dests_hi = WIDE ? __reduce_or_sync(0xffffffffu, dst >= 32 ? 1u << (dst - 32) : 0u) : 0u;
    const uint64_t all_dests = ((uint64_t)dests_hi << 32) | dests_lo;
    // The token's destinations are numbered in rank order (at most K of them, one per lane):
    // lane i keeps the i-th one's slots of t (and its rank, until its remote record is claimed).
    uint32_t my_dest = 0, my_slots = 0;
    {
        uint32_t i = 0;
        for (uint64_t rem = all_dests; rem; rem &= rem - 1, ++i) {
            const uint32_t d = first_rank(rem);
            const uint32_t m = __ballot_sync(0xffffffffu, dst == (int)d);
            if (lane == i) {
                my_dest = d;
                my_slots = m;
            }
        }
    }
    // The slots of t that go to rank d (0 when none does); every lane must call it.
    auto slots_of = [&](uint32_t d) {
        const uint32_t m = __shfl_sync(0xffffffffu, my_slots, (uint32_t)__popcll(all_dests & ((1ull << d) - 1)) & 31);
        return (all_dests >> d) & 1ull ? m : 0u;
    };
    if (lane == 0) reinterpret_cast<uint64_t*>(state_at(c, c.st_token_mask))[t] = all_dests;

    const uint64_t slot = (uint64_t)me * c.max_tokens + t;
    const uint64_t par_data = (uint64_t)par * c.world * c.max_tokens * c.rec_bytes;
    const uint64_t rec_off = c.off_data + par_data + slot * c.rec_bytes;
    // NVLink destinations get stores and flags; remote ones a record in dsend[par][d][j], j
    // claimed by the lane that keeps destination d (the proxy writes them on). Without the wide
    // build every rank set fits the low word (fewer registers).
    const uint64_t nvm = WIDE ? nvmask_of<R>(c) : (uint32_t)nvmask_of<R>(c);
    const uint64_t dmask = all_dests & nvm, rmask = all_dests & ~nvm;
    // Lane i claims the record of the i-th destination (the wide build), else lane d of rank d.
    uint32_t my_j = 0;
    const uint32_t claim = WIDE ? my_dest : lane;
    if (R && rmask && ((rmask >> claim) & 1ull) && (WIDE ? lane < (uint32_t)__popcll(all_dests) : lane < W)) {
        my_j = atomicAdd(reinterpret_cast<uint32_t*>(state_at(c, c.st_rpack)) + par * W + claim, 1u);
    }
    // Where the record of destination d, the i-th, goes: the NVLink peer's buffer, or the remote
    // record claimed for it. Every lane must call these (they shuffle).
    auto remote_rec = [&](uint32_t i, uint32_t d) {
        const uint32_t j = __shfl_sync(0xffffffffu, my_j, WIDE ? i : d);
        return reinterpret_cast<uint8_t*>(c.dsend) + (((uint64_t)par * W + d) * c.max_tokens + j) * c.rrec_bytes;
    };
    auto rec_at = [&](uint32_t i, uint32_t d) {
        return !R || ((nvm >> d) & 1ull) ? shared_of(c, d) + rec_off : remote_rec(i, d);
    };

    const bool use_tma = dmask && tma.buf && !rmask;  // the host enables TMA only without remote ranks
    if (use_tma) {
        // The host enables this path only when the scales (if any) are 16-byte rows.
        const uint32_t dbytes = (uint32_t)c.data_bytes, sbytes = (uint32_t)c.num_scales * 4;
        if (lane == 0) {
            mbar_arrive_expect_tx(tma.bar, dbytes + sbytes);
            tma_load(tma.buf, reinterpret_cast<const void*>(a.x + (uint64_t)t * a.x_stride), dbytes, tma.bar);
            if (sbytes) {
                tma_load(tma.buf + dbytes, reinterpret_cast<const void*>(a.scales + (uint64_t)t * a.scales_stride), sbytes,
                         tma.bar);
            }
        }
        mbar_wait(tma.bar, tma.phase);
        tma.phase ^= 1;
        if (lane == 0) {
            for (uint64_t rem = dmask; rem; rem &= rem - 1) {
                const uint32_t d = first_rank(rem);
                tma_store(shared_of(c, d) + rec_off, tma.buf, dbytes + sbytes);
            }
            tma_commit();
        }
        if (dst >= 0 && ((nvm >> dst) & 1ull)) {
            dispatch_arrays(c, dst, par).hdr[slot * K + lane] = make_int2(e % (int)L, p);
        }
        if (lane == 0) tma_wait_writes();  // also frees the buffer for the next token
    } else if (all_dests) {
        const int4* src = reinterpret_cast<const int4*>(a.x + (uint64_t)t * a.x_stride);
        const uint32_t nvec = (uint32_t)(c.data_bytes / 16);
        for (uint32_t v0 = 0; v0 < nvec; v0 += 32 * A2A_SEND_VPL) {
            int4 v[A2A_SEND_VPL];
#pragma unroll
            for (int u = 0; u < A2A_SEND_VPL; ++u) {
                const uint32_t k = v0 + u * 32 + lane;
                if (k < nvec) v[u] = __ldg(src + k);
            }
            uint32_t i = 0;
            for (uint64_t rem = all_dests; rem; rem &= rem - 1, ++i) {
                int4* out = reinterpret_cast<int4*>(rec_at(i, first_rank(rem)));
#pragma unroll
                for (int u = 0; u < A2A_SEND_VPL; ++u) {
                    const uint32_t k = v0 + u * 32 + lane;
                    if (k < nvec) out[k] = v[u];
                }
            }
        }
        const uint32_t S = (uint32_t)c.num_scales;
        if (S) {
            const uint8_t* sc = reinterpret_cast<const uint8_t*>(a.scales + (uint64_t)t * a.scales_stride);
            const bool vec = ((a.scales | a.scales_stride) & 15) == 0 && (S & 3) == 0;
            // Destinations outer: rec_at shuffles across the warp, so every lane must call it.
            uint32_t i = 0;
            for (uint64_t rem = all_dests; rem; rem &= rem - 1, ++i) {
                uint8_t* so = rec_at(i, first_rank(rem)) + c.data_bytes;
                if (vec) {
                    for (uint32_t q = lane; q < S / 4; q += 32) {
                        reinterpret_cast<int4*>(so)[q] = __ldg(reinterpret_cast<const int4*>(sc) + q);
                    }
                } else {
                    for (uint32_t q = lane; q < S; q += 32) {
                        reinterpret_cast<float*>(so)[q] = __ldg(reinterpret_cast<const float*>(sc) + q);
                    }
                }
            }
        }
        if (dst >= 0 && ((nvm >> dst) & 1ull)) {
            dispatch_arrays(c, dst, par).hdr[slot * K + lane] = make_int2(e % (int)L, p);
        }
        // Remote records carry their header after the record: (token, slots), then per slot
        // (local expert, position) or (-1, -1).
        uint32_t i = 0;
        for (uint64_t rem = R ? all_dests : 0; rem; rem &= rem - 1, ++i) {
            const uint32_t d = first_rank(rem);
            if ((nvm >> d) & 1ull) continue;  // warp-uniform
            int2* h = reinterpret_cast<int2*>(remote_rec(i, d) + c.rec_bytes);
            const uint32_t sl = __shfl_sync(0xffffffffu, my_slots, i);
            if (lane == 0) h[0] = make_int2((int)t, (int)sl);
            if (lane < K) h[1 + lane] = dst == (int)d ? make_int2(e % (int)L, p) : make_int2(-1, -1);
        }
    }
    // Every lane's stores above are ordered before the release by the barrier; the release is
    // cumulative, so each rank sees the token's values, scales and headers before its flag.
    __syncwarp();
    if (use_tma) {
        // Lane 0 saw its bulk stores complete: it releases every rank's flag itself.
        if (lane == 0) fence_acq_rel_sys();
        for (uint32_t d = 0; d < W; ++d) {
            const uint32_t sl = slots_of(d);
            if (lane == 0 && ((nvm >> d) & 1ull)) st_relaxed_sys(dispatch_arrays(c, d, par).dtf + slot, ((uint64_t)n << 32) | sl);
        }
    } else {
        // Lane l raises rank l's flag, and rank l + 32's in groups of more than 32.
        const uint32_t sl = slots_of(lane);
        if (lane < W && ((nvm >> lane) & 1ull)) st_release_sys(dispatch_arrays(c, lane, par).dtf + slot, ((uint64_t)n << 32) | sl);
        if (WIDE) {
            const uint32_t sh = slots_of(lane + 32);
            if (lane + 32 < W && ((nvm >> (lane + 32)) & 1ull)) {
                st_release_sys(dispatch_arrays(c, lane + 32, par).dtf + slot, ((uint64_t)n << 32) | sh);
            }
        }
    }
}

// Sending warp `wi` of `nw` of this block: takes the block's tokens in order, the next one from a
// shared counter, which is the order the receivers take them in. (Tokens cs + wi, cs + wi + nw,
// ... per warp ended the prefill dispatch 6 us later: releases wait behind the NVLink queue for
// longer on some warps than on others.)
// tma_smem: see A2ADispatchArgs (0: registers).
template <bool R, bool WIDE>
__device__ __forceinline__ void dispatch_send_tokens(const A2ADispatchSendArgs& a, const SendCtx& x, uint32_t wi, uint32_t nw,
                                                     uint64_t tma_smem) {
    const uint32_t K = (uint32_t)a.c.topk;
    TmaSlot tma = {nullptr, nullptr, 0};
    if (tma_smem && x.cs < x.ce) {
        extern __shared__ __align__(128) int smem[];
        uint8_t* region = reinterpret_cast<uint8_t*>(smem) + tma_smem;
        tma.buf = region + (uint64_t)wi * a.c.rec_bytes;
        tma.bar = reinterpret_cast<uint64_t*>(region + (uint64_t)nw * a.c.rec_bytes) + wi;
        if (lane_id() == 0) mbar_init(tma.bar);
        __syncwarp();
    }
    for (;;) {
        uint32_t k = 0;
        if (lane_id() == 0) k = atomicAdd(x.next, 1u);
        const uint32_t t = x.cs + __shfl_sync(0xffffffffu, k, 0);
        if (t >= x.ce) break;
        send_token<R, WIDE>(a, x.n, t, x.pos + (t - x.cs) * K, tma);
    }
    if (R) {
        // The last sending warp of the launch tells the proxy that every remote record is packed.
        __syncwarp();
        const uint32_t par = x.n & 1;
        uint32_t* rdone = reinterpret_cast<uint32_t*>(state_at(a.c, a.c.st_rdone)) + par;
        if (lane_id() == 0 && last_sender(x.wdone, nw, rdone)) {
            uint32_t* rpack = reinterpret_cast<uint32_t*>(state_at(a.c, a.c.st_rpack)) + par * a.c.world;
            for (uint32_t d = 0; d < a.c.world; ++d) rpack[d] = 0;  // for call n + 2
            *rdone = 0;
            st_release_sys(blk_u64(a.c, a.c.blk_ddone), x.n);
        }
    }
}

// The receiving warps [first_warp, A2A_WARPS) of this block: wait for every source's counts,
// compute each local expert's row offsets per source, then take items (source, token, 2 KiB
// chunk) in the order the senders produce them, each as soon as its token's flag is up: copy the
// chunk into its rows of the expert-major output, and record the (source, token, slot) -> row map
// for combine. No barrier involves warps outside [first_warp, A2A_WARPS).
template <bool R>
__device__ __forceinline__ void dispatch_recv_body(const A2ADispatchRecvArgs& a, uint32_t n, uint32_t first_warp) {
    const A2ACommon& c = a.c;
    const uint32_t W = (uint32_t)c.world, K = (uint32_t)c.topk, L = (uint32_t)c.local_experts;
    const uint32_t me = (uint32_t)c.rank, max_rows = (uint32_t)c.max_rows;
    const uint32_t G = (uint32_t)c.send_grid;
    const uint32_t lane = lane_id(), warp = threadIdx.x / 32;
    const uint32_t nrw = A2A_WARPS - first_warp, nrt = nrw * 32, rt = threadIdx.x - first_warp * 32;
    __shared__ int s_off[1024];  // [L][W]: L * W = num_experts <= MAX_EXPERTS (src/config.rs)
    __shared__ uint32_t s_T[A2A_MAX_PEERS], s_ok[A2A_MAX_PEERS], s_chunk[A2A_MAX_PEERS];
    __shared__ uint32_t s_cmax, s_rpre[A2A_MAX_PEERS + 1];
    const uint32_t par = n & 1;
    const DispatchArrays mine = dispatch_arrays(c, me, par);

    for (uint32_t s = rt; s < W; s += nrt) {
        // NVLink sources: (seq, tokens) from the source itself; remote ones: (seq, records) from
        // the proxy once every count message is in.
        const uint64_t v = is_nvlink<R>(c, s)
                               ? wait_flag(c, mine.dcf + s, n)
                               : wait_host_flag(c, blk_u64(c, c.blk_rcf) + par * W + s, A2A_HOST_KEY_COUNTS + s, n);
        s_ok[s] = v != 0;
        s_T[s] = v != 0 ? min((uint32_t)(v & 0xffffffffu), (uint32_t)c.max_tokens) : 0;
        if (blockIdx.x == 0) reinterpret_cast<uint32_t*>(state_at(c, c.st_recv_tokens))[s] = s_T[s];
    }
    bar_sync(1, nrt);
    // Every (local expert, source) count at once, then each expert's prefix over sources.
    for (uint32_t i = rt; i < L * W; i += nrt) {
        const uint32_t el = i / W, s = i % W;
        int cnt = 0;
        if (s_ok[s] && is_nvlink<R>(c, s)) {
            cnt = __ldcg(mine.dcnt + s * L + el);
        } else if (s_ok[s]) {
            cnt = (int)ld_volatile_u32(msg_hist(c, par, s) + el);
            // Combine returns rows to remote sources packed by these counts.
            if (blockIdx.x == 0) reinterpret_cast<int*>(state_at(c, c.st_rcnt))[s * L + el] = cnt;
        }
        s_off[i] = cnt;
    }
    bar_sync(1, nrt);
    for (uint32_t el = rt; el < L; el += nrt) {
        int running = 0;
        for (uint32_t s = 0; s < W; ++s) {
            const int cnt = s_off[el * W + s];
            s_off[el * W + s] = running;
            running += cnt;
        }
        if (blockIdx.x == 0) {
            if (running > (int)max_rows) {
                set_error(c, A2A_ERR_EXPERT_OVERFLOW);
                running = (int)max_rows;
            }
            reinterpret_cast<int*>(a.out_counts)[el] = running;
        }
    }
    if (rt == 0) {
        uint32_t cmax = 0, rpre = 0;
        for (uint32_t s = 0; s < W; ++s) {
            // The source's tokens per sending block (NVLink); remote records are items of their own.
            const uint32_t ch = is_nvlink<R>(c, s) ? (s_T[s] + G - 1) / G : 0;
            s_chunk[s] = ch;
            cmax = max(cmax, ch);
            if (R) s_rpre[s] = rpre;
            rpre += is_nvlink<R>(c, s) ? 0 : s_T[s];
        }
        s_cmax = cmax;
        if (R) {
            s_rpre[W] = rpre;
            if (blockIdx.x == 0) *reinterpret_cast<uint32_t*>(state_at(c, c.st_last_dseq)) = n;
        }
    }
    bar_sync(1, nrt);

    const uint32_t nvec = (uint32_t)(c.data_bytes / 16);
    const uint32_t nch = (nvec + A2A_CHUNK_VECS - 1) / A2A_CHUNK_VECS;
    const uint32_t S = (uint32_t)c.num_scales;
    const bool scale_vec = (S & 3) == 0 && (a.out_scales & 15) == 0;
    // Items (i, b, s, ch), ch innermost: the i-th token of sending block b of source s. Senders
    // go through their chunks in order, so items become ready roughly in this order.
    const uint32_t items = s_cmax * G * W * nch;  // < 2^31 (Config::validate)
    const uint32_t gw = blockIdx.x * nrw + (warp - first_warp), gws = gridDim.x * nrw;
    int* map = reinterpret_cast<int*>(state_at(c, c.st_map));
    for (uint32_t it = gw; it < items; it += gws) {
        uint32_t r = it;
        const uint32_t ch = r % nch;
        r /= nch;
        const uint32_t s = r % W;
        r /= W;
        const uint32_t b = r % G, i = r / G;
        const uint32_t chunk = s_chunk[s];
        if (i >= chunk) continue;
        const uint32_t t = b * chunk + i;
        if (t >= s_T[s]) continue;
        const uint64_t slot = (uint64_t)s * c.max_tokens + t;
        const uint64_t v = wait_flag(c, mine.dtf + slot, n);
        if (v == 0) continue;  // timed out (reported)
        const uint32_t slots = (uint32_t)v;
        int row = A2A_NOT_MINE;
        if (lane < K && ((slots >> lane) & 1u)) {
            const int2 h = __ldcg(mine.hdr + slot * K + lane);
            row = A2A_DROPPED;
            if (h.x >= 0 && (uint32_t)h.x < L && h.y >= 0) {
                const int rr = s_off[h.x * W + s] + h.y;
                if (rr < (int)max_rows) {
                    row = h.x * (int)max_rows + rr;
                } else if (ch == 0) {
                    set_error(c, A2A_ERR_EXPERT_OVERFLOW);
                }
            }
        }
        if (ch == 0 && lane < K) map[slot * K + lane] = row;
        const unsigned m = __ballot_sync(0xffffffffu, row >= 0);
        if (m == 0) continue;
        const uint8_t* rec = mine.data + slot * c.rec_bytes;
        const int4* src = reinterpret_cast<const int4*>(rec);
        const uint32_t v0 = ch * A2A_CHUNK_VECS, v1 = min(v0 + A2A_CHUNK_VECS, nvec);
        int4 val[A2A_CHUNK_VECS / 32];
#pragma unroll
        for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u) {
            const uint32_t k = v0 + lane + u * 32;
            if (k < v1) val[u] = __ldcg(src + k);
        }
        for (unsigned rem = m; rem; rem &= rem - 1) {
            const int j = __ffs(rem) - 1;
            const int rj = __shfl_sync(0xffffffffu, row, j);
            int4* out = reinterpret_cast<int4*>(a.out_x + (uint64_t)rj * c.data_bytes);
#pragma unroll
            for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u) {
                const uint32_t k = v0 + lane + u * 32;
                if (k < v1) out[k] = val[u];
            }
        }
        if (ch == 0 && S) {
            const uint8_t* si = rec + c.data_bytes;
            for (unsigned rem = m; rem; rem &= rem - 1) {
                const int rj = __shfl_sync(0xffffffffu, row, __ffs(rem) - 1);
                uint8_t* so = reinterpret_cast<uint8_t*>(a.out_scales) + (uint64_t)rj * S * 4;
                if (scale_vec) {
                    for (uint32_t q = lane; q < S / 4; q += 32) {
                        reinterpret_cast<int4*>(so)[q] = __ldcg(reinterpret_cast<const int4*>(si) + q);
                    }
                } else {
                    for (uint32_t q = lane; q < S; q += 32) {
                        reinterpret_cast<float*>(so)[q] = __ldcg(reinterpret_cast<const float*>(si) + q);
                    }
                }
            }
        }
    }

    // Remote sources: items (record, 2 KiB chunk), records of source s numbered from s_rpre[s].
    // All of a source's records are there once its rflag is up (each warp acquires it once).
    if (!R || s_rpre[W] == 0) return;
    const uint32_t ritems = s_rpre[W] * nch;
    const uint64_t Q = c.private_tokens;
    uint64_t ready = 0;  // remote sources whose records this warp saw complete
    for (uint32_t it = gw; it < ritems; it += gws) {
        const uint32_t rec_no = it / nch, ch = it % nch;
        uint32_t s = 0;
        while (s + 1 < W && rec_no >= s_rpre[s + 1]) ++s;
        const uint32_t j = rec_no - s_rpre[s];
        if (!((ready >> s) & 1ull)) {
            // One lane waits; the warp barrier orders its acquire before every lane's reads.
            uint64_t v = 0;
            if (lane == 0) {
                const uint64_t* rflag = blk_u64(c, c.blk_rflag) + par * W + s;
                v = wait_host_flag(c, rflag, A2A_HOST_KEY_RECORDS + s, n);
            }
            v = __shfl_sync(0xffffffffu, v, 0);
            __syncwarp();
            if (v == 0) continue;  // timed out (reported)
            ready |= 1ull << s;
        }
        uint64_t at = (uint64_t)par * c.drecv_records;
        if (j < Q) {
            at += (uint64_t)s * Q + j;
        } else {
            at += (uint64_t)W * Q + ld_volatile_u64(blk_u64(c, c.blk_rovf) + par * W + s) + (j - Q);
        }
        const uint8_t* rec = reinterpret_cast<const uint8_t*>(c.drecv) + at * c.rrec_bytes;
        const int2* hdr = reinterpret_cast<const int2*>(rec + c.rec_bytes);
        const uint32_t slots = (uint32_t)ld_volatile_int2(hdr).y;
        const uint64_t rslot = (uint64_t)s * c.max_tokens + j;  // combine's index of this record
        int row = A2A_NOT_MINE;
        int2 h = make_int2(-1, -1);
        if (lane < K && ((slots >> lane) & 1u)) {
            h = ld_volatile_int2(hdr + 1 + lane);
            row = A2A_DROPPED;
            if (h.x >= 0 && (uint32_t)h.x < L && h.y >= 0) {
                const int rr = s_off[h.x * W + s] + h.y;
                if (rr < (int)max_rows) {
                    row = h.x * (int)max_rows + rr;
                } else if (ch == 0) {
                    set_error(c, A2A_ERR_EXPERT_OVERFLOW);
                }
            } else {
                h = make_int2(-1, -1);
            }
        }
        if (ch == 0 && lane < K) {
            map[rslot * K + lane] = row;
            reinterpret_cast<int2*>(state_at(c, c.st_rhdr))[rslot * K + lane] = h;
        }
        const unsigned m = __ballot_sync(0xffffffffu, row >= 0);
        if (m == 0) continue;
        const int4* src = reinterpret_cast<const int4*>(rec);
        const uint32_t v0 = ch * A2A_CHUNK_VECS, v1 = min(v0 + A2A_CHUNK_VECS, nvec);
        int4 val[A2A_CHUNK_VECS / 32];
#pragma unroll
        for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u) {
            const uint32_t k = v0 + lane + u * 32;
            if (k < v1) val[u] = ld_volatile_v4(src + k);
        }
        for (unsigned rem = m; rem; rem &= rem - 1) {
            const int rj = __shfl_sync(0xffffffffu, row, __ffs(rem) - 1);
            int4* out = reinterpret_cast<int4*>(a.out_x + (uint64_t)rj * c.data_bytes);
#pragma unroll
            for (int u = 0; u < A2A_CHUNK_VECS / 32; ++u) {
                const uint32_t k = v0 + lane + u * 32;
                if (k < v1) out[k] = val[u];
            }
        }
        if (ch == 0 && S) {
            const uint8_t* si = rec + c.data_bytes;
            for (unsigned rem = m; rem; rem &= rem - 1) {
                const int rj = __shfl_sync(0xffffffffu, row, __ffs(rem) - 1);
                float* so = reinterpret_cast<float*>(a.out_scales) + (uint64_t)rj * S;
                for (uint32_t q = lane; q < S; q += 32) {
                    so[q] = __uint_as_float(ld_volatile_u32(reinterpret_cast<const uint32_t*>(si) + q));
                }
            }
        }
    }
}

template <bool R, bool WIDE>
__device__ __forceinline__ void a2a_dispatch_send_body(const A2ADispatchSendArgs& a) {
    const SendCtx x = dispatch_send_prologue<R>(a, false);
    dispatch_send_tokens<R, WIDE>(a, x, threadIdx.x / 32, A2A_WARPS, 0);
}

template <bool R>
__device__ __forceinline__ void a2a_dispatch_recv_body(const A2ADispatchRecvArgs& a) {
    __shared__ uint32_t s_n;
    if (threadIdx.x == 0) {
        uint32_t* rs = seq_slot(a.c, A2A_DISPATCH_RECV);
        s_n = *rs + 1;
        *rs = s_n;
    }
    __syncthreads();
    dispatch_recv_body<R>(a, s_n, 0);
}

// Both halves in one launch. With send_warps < A2A_WARPS, warps [0, send_warps) of every block
// send while the others receive what has arrived (prefill: the expansion overlaps the NVLink
// transfer); otherwise every warp sends its tokens, then receives (decode: fewest round trips).
// No warp waits for another block of its own launch; receivers wait for peers' flags, which
// peers raise from their send parts (no waits there). The grid is two blocks per multiprocessor,
// resident together when the GPU runs nothing else.
template <bool R, bool WIDE>
__device__ __forceinline__ void a2a_dispatch_body(const A2ADispatchArgs& a) {
    const SendCtx x = dispatch_send_prologue<R>(a.send, true);
    const uint32_t warp = threadIdx.x / 32;
    const uint32_t S = (uint32_t)a.send_warps;
    if (S == 0 || S >= A2A_WARPS) {
        dispatch_send_tokens<R, WIDE>(a.send, x, warp, A2A_WARPS, 0);
        dispatch_recv_body<R>(a.recv, x.n, 0);
    } else if (warp < S) {
        dispatch_send_tokens<R, WIDE>(a.send, x, warp, S, a.tma_smem);
    } else {
        dispatch_recv_body<R>(a.recv, x.n, S);
    }
}

// The two builds of every kernel (see nvmask_of in a2a_common.cuh); the host picks one per object.
extern "C" __global__ void __launch_bounds__(512, 2) a2a_dispatch_send(const A2ADispatchSendArgs a) { a2a_dispatch_send_body<false, false>(a); }
extern "C" __global__ void __launch_bounds__(512, 2) a2a_dispatch_send_remote(const A2ADispatchSendArgs a) { a2a_dispatch_send_body<true, false>(a); }
extern "C" __global__ void __launch_bounds__(512, 2) a2a_dispatch_recv(const A2ADispatchRecvArgs a) { a2a_dispatch_recv_body<false>(a); }
extern "C" __global__ void __launch_bounds__(512, 2) a2a_dispatch_recv_remote(const A2ADispatchRecvArgs a) { a2a_dispatch_recv_body<true>(a); }
extern "C" __global__ void __launch_bounds__(512, 2) a2a_dispatch(const A2ADispatchArgs a) { a2a_dispatch_body<false, false>(a); }
extern "C" __global__ void __launch_bounds__(512, 2) a2a_dispatch_remote(const A2ADispatchArgs a) { a2a_dispatch_body<true, false>(a); }
// Groups of more than 32 ranks: the sending side's rank sets take two words per warp (the wide
// builds keep them out of the common case's registers).
extern "C" __global__ void __launch_bounds__(512, 2) a2a_dispatch_send_wide(const A2ADispatchSendArgs a) { a2a_dispatch_send_body<false, true>(a); }
extern "C" __global__ void __launch_bounds__(512, 2) a2a_dispatch_send_remote_wide(const A2ADispatchSendArgs a) { a2a_dispatch_send_body<true, true>(a); }
extern "C" __global__ void __launch_bounds__(512, 2) a2a_dispatch_wide(const A2ADispatchArgs a) { a2a_dispatch_body<false, true>(a); }
extern "C" __global__ void __launch_bounds__(512, 2) a2a_dispatch_remote_wide(const A2ADispatchArgs a) { a2a_dispatch_body<true, true>(a); }
