// Shared definitions of the MoE all-to-all kernels: the parameter block (mirrored by
// src/params.rs, field for field, all 64-bit), memory-model helpers, flag waits with a timeout.
//
// Memory of one rank (see src/layout.rs for the offsets, computed once on the host). Dispatch
// arrays are doubled and indexed by the call's parity (n & 1): a source writes call n+1 while
// this rank may still read call n, and it can only reach call n+2 after this rank's receive of
// call n finished (see docs/all_to_all.md, "Flags and buffer reuse"), so no acknowledgement is
// needed. Combine arrays are single: the weights of the next combine order them.
//   shared region (CUDA IPC, written by peers over NVLink):
//     dcf[2][W]            u64   counts of src published:  (seq << 32) | tokens of src
//     dcnt[2][W][L]        i32   rows src sends to each of my local experts
//     dtf[2][W][Tmax]      u64   token t of src written:   (seq << 32) | slots of t that are mine
//     hdr[2][W][Tmax][K]   int2  (local expert, position among src's rows of it) per mine slot
//     data[2][W][Tmax][rec] bytes token record: values (hidden * elem), fp32 scales, padding
//     cw[W][Tmax][K]       u64   weights of src's tokens:  (seq << 32) | fp32 bits (each word is
//                                its own flag: no separate flag, no fence on the writer's side)
//     ctf[W][Tmax][NC]     u64   partial (dst, token, 2 KiB chunk) written: (seq << 32)
//     cdata[W][Tmax][H]    bf16  partial sums of my tokens computed by each dst
//   state (local device memory):
//     seq[4][A2A_MAX_GRID] u32 (per kernel kind and block), poison u32, my_tokens u32,
//     recv_tokens[W] u32, token_mask[Tmax] u64 (the ranks token t went to), map[W][Tmax][K] i32
//     (row of the expert-major output; A2A_NOT_MINE when the slot did not come here,
//     A2A_DROPPED when it overflowed),
//     queue[2] u32 (combine senders' next item, by call parity)
//   host block (pinned, mapped): err[8] u32, counts seq u64 at 64, counts[E] u32 at 128.
//
// Sequence numbers are kept per block (every launch of a kind has the same grid), so no block
// waits for another one of its own launch: a block reads and advances its own counter.
//
// Remote ranks (other NVLink domains; src/remote.rs, src/proxy_block.rs, src/proxy.rs): peers[]
// holds only the ranks of nvmask. For the others, dispatch send publishes its counts to the
// proxy block (pub_tok, pub_hist, then dseq = n) before sending anything, packs each token once
// per remote destination into dsend[p][d][j] (j claimed from rpack[p][d]; record, then header:
// (token, slots), (local expert, position) per slot), and the last sending warp of the launch
// raises ddone = n. The proxy moves the records into the destination's drecv (private quota,
// then overflow), raises rcf[p][s] once every count message is in and rflag[p][s] once source
// s's records are. Combine returns every (token, slot) row of a remote source unweighted, packed
// per source (csend), and raises cdone; the source adds the k copies with its weights in fp32.
//   state (more): rpack[2][W] u32, rdone[2] u32, cdone_blocks[2] u32, sslot[Tmax][K] int2 (expert,
//     position) of my slots, hist[E] i32 (my rows per expert), rcnt[W][L] i32 (rows remote
//     source s sent each local expert), rhdr[W][Tmax][K] int2 (local expert, position) of remote
//     records' slots, weights[Tmax][K] f32 (my weights, for a separate combine receive),
//     last_dseq u32 (the dispatch combine follows), host_wait[A2A_HOST_KEYS] HostWait (device
//     copies of the proxy's flags, see wait_host_flag).
#pragma once
#include <stdint.h>

#define A2A_MAX_PEERS 64  // rank sets are u64 masks; lane l of a warp stands for ranks l and l + 32
#define A2A_MAX_GRID 1024   // most blocks per launch (per-block sequence counters)
#define A2A_CHUNK_VECS 128  // 16-byte vectors per receive / combine item (2 KiB), 4 per lane
#define A2A_SEND_VPL 8      // 16-byte vectors per lane per step when sending a token (4 KiB)
#define A2A_GROUP 4         // rows (combine) whose loads are issued together
#define A2A_FLUSH 8         // combine items between two releases of their flags
#define A2A_WARPS 16        // warps per block (THREADS = 512 in src/config.rs)

#define A2A_NOT_MINE (-1)  // map: the slot did not come to this rank
#define A2A_DROPPED (-2)   // map: the slot came here but its expert was full (row dropped)

// Error words in the host block (each set to 1 when it happens; cleared by the host).
#define A2A_ERR_TIMEOUT 0
#define A2A_ERR_BAD_EXPERT 1
#define A2A_ERR_BAD_NUM_TOKENS 2
#define A2A_ERR_EXPERT_OVERFLOW 3
#define A2A_ERR_CALL_ORDER 4

// Kernel kinds (index into seq[]).
#define A2A_DISPATCH_SEND 0
#define A2A_DISPATCH_RECV 1
#define A2A_COMBINE_SEND 2
#define A2A_COMBINE_RECV 3

struct A2ACommon {
    uint64_t rank, world, num_experts, local_experts, topk, max_tokens, max_rows, hidden;
    uint64_t data_bytes, num_scales, rec_bytes, timeout_ns;
    uint64_t state, host, send_grid;
    uint64_t off_dcf, off_dcnt, off_dtf, off_hdr, off_data, off_cw, off_ctf, off_cdata;
    uint64_t st_seq, st_poison, st_my_tokens, st_recv_tokens, st_token_mask, st_map, st_queue;
    // The RDMA half (see "Remote ranks" above); blk == 0: every rank is in nvmask (NVLink only).
    uint64_t nvmask;  // ranks of this rank's NVLink domain (reached through peers[])
    uint64_t blk;     // device address of the proxy block (mapped host memory)
    uint64_t blk_dseq, blk_ddone, blk_cdone, blk_rcf, blk_rflag, blk_rovf, blk_crflag, blk_pub_tok, blk_pub_hist;
    uint64_t blk_msg_in, msg_bytes;
    uint64_t dsend, drecv, csend, crecv;  // device addresses of the remote-traffic buffers
    uint64_t private_tokens, rrec_bytes, drecv_records, csend_rows, crecv_rows;
    uint64_t st_rpack, st_rdone, st_cdone_blocks, st_sslot, st_hist, st_rcnt, st_rhdr, st_weights, st_last_dseq;
    uint64_t st_host_wait;  // HostWait[A2A_HOST_KEYS]: device-memory mirrors of the proxy's flags
    uint64_t peers[A2A_MAX_PEERS];  // base of every NVLink peer's shared region in this process (own too)
};
static_assert(sizeof(A2ACommon) == (62 + A2A_MAX_PEERS) * 8, "mirror of src/params.rs");

struct A2ADispatchSendArgs {
    A2ACommon c;
    uint64_t x, x_stride;             // [T, hidden] elem, row stride in bytes
    uint64_t scales, scales_stride;   // [T, num_scales] f32, row stride in bytes (0 when no scales)
    uint64_t idx, idx_stride, idx_is_64;  // [T, K] int32/int64 expert ids, row stride in elements
    uint64_t num_tokens;              // rows of x
    uint64_t num_tokens_ptr;          // optional device int32: live token count (<= num_tokens)
    uint64_t publish_host_counts;     // write per-expert counts to the host block (proxy hook)
};
struct A2ADispatchRecvArgs {
    A2ACommon c;
    uint64_t out_x, out_scales, out_counts;  // [L, max_rows, hidden], [L, max_rows, S] f32, [L] i32
};
struct A2ACombineSendArgs {
    A2ACommon c;
    uint64_t expert_out, expert_out_stride;  // [L * max_rows, hidden] bf16, row stride in bytes
    uint64_t weights, weights_stride;        // [T, K] f32 of my tokens, row stride in elements
};
struct A2ACombineRecvArgs {
    A2ACommon c;
    uint64_t out, out_stride;  // [T, hidden] bf16, row stride in bytes
    uint64_t num_rows;         // rows of out (rows past the live count are zeroed)
};

// Both halves in one launch. `send_warps` of the A2A_WARPS warps of each block send while the
// others receive from the start (streaming); A2A_WARPS: every warp sends, then receives.
// `tma_smem`: when nonzero, the byte offset in dynamic shared memory of one record buffer per
// sending warp (rec_bytes each), then one mbarrier per sending warp: tokens then move through
// the bulk copy engine (global -> shared -> every destination) instead of registers.
struct A2ADispatchArgs {
    A2ADispatchSendArgs send;
    A2ADispatchRecvArgs recv;
    uint64_t send_warps;
    uint64_t tma_smem;
};
struct A2ACombineArgs {
    A2ACombineSendArgs send;
    A2ACombineRecvArgs recv;
    uint64_t send_warps;
};

namespace a2a {

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Bulk copy engine (sm_90): global -> shared completing on an mbarrier, shared -> global in a
// bulk group. Sizes and addresses are multiples of 16.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t phase) {
    asm volatile(
        "{\n\t"
        ".reg .pred P;\n\t"
        "WAIT_%=:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n\t"
        "@!P bra WAIT_%=;\n\t"
        "}" ::"r"(smem_u32(bar)),
        "r"(phase)
        : "memory");
}

__device__ __forceinline__ void tma_load(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(smem)),
        "l"(gmem), "r"(bytes), "r"(smem_u32(bar))
        : "memory");
}

__device__ __forceinline__ void tma_store(void* gmem, const void* smem, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem), "r"(smem_u32(smem)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void tma_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Waits until every bulk store of this thread completed (written, not only read from shared
// memory), then orders them with the generic proxy before a following release.
__device__ __forceinline__ void tma_wait_writes() {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Named barrier over `threads` threads (a multiple of 32) of this block.
__device__ __forceinline__ void bar_sync(uint32_t id, uint32_t threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ uint8_t* shared_of(const A2ACommon& c, uint64_t r) {
    return reinterpret_cast<uint8_t*>(c.peers[r]);
}

__device__ __forceinline__ uint8_t* state_at(const A2ACommon& c, uint64_t off) {
    return reinterpret_cast<uint8_t*>(c.state) + off;
}

__device__ __forceinline__ void set_error(const A2ACommon& c, int which) {
    volatile uint32_t* err = reinterpret_cast<volatile uint32_t*>(c.host);
    err[which] = 1;
}

__device__ __forceinline__ bool seq_reached(uint64_t v, uint32_t want) {
    return (int32_t)((uint32_t)(v >> 32) - want) >= 0;
}

// A wait's check every 64 spins: true once the object is poisoned (an earlier wait timed out) or
// this wait, started at `start` (0 until the first check), ran past the timeout, which poisons the
// object and records the error.
__device__ __forceinline__ bool wait_expired(const A2ACommon& c, uint64_t& start) {
    volatile uint32_t* poison = reinterpret_cast<volatile uint32_t*>(state_at(c, c.st_poison));
    if (*poison) return true;
    const uint64_t now = global_timer_ns();
    if (start == 0) {
        start = now;
        return false;
    }
    if (now - start <= c.timeout_ns) return false;
    *poison = 1;
    set_error(c, A2A_ERR_TIMEOUT);
    return true;
}

// Waits until the sequence number in the high half of *flag reached `want` (wrap-safe), with
// acquire semantics at system scope for the calling thread (every lane of a warp that reads what
// the flag guards calls it: one load per warp). Returns the flag's value, or 0 when the wait
// timed out (or an earlier wait did: the object is then poisoned and every later wait returns at
// once) after recording the error.
__device__ __forceinline__ uint64_t wait_flag(const A2ACommon& c, const uint64_t* flag, uint32_t want,
                                              uint32_t sleep_ns = 128) {
    uint64_t v = ld_acquire_sys(flag);
    if (seq_reached(v, want)) return v;
    uint64_t start = 0;
    for (uint32_t spin = 0;; ++spin) {
        if ((spin & 63) == 0 && wait_expired(c, start)) return 0;
        if (spin >= 256) __nanosleep(sleep_ns);
        v = ld_relaxed_sys(flag);
        if (seq_reached(v, want)) return ld_acquire_sys(flag);
    }
}

__device__ __forceinline__ uint32_t lane_id() { return threadIdx.x & 31; }

// Every kernel comes in two builds: R = false (every rank over NVLink: the remote code is
// compiled out, so that path is what it was without the RDMA half) and R = true.
template <bool R>
__device__ __forceinline__ uint64_t nvmask_of(const A2ACommon& c) {
    return R ? c.nvmask : ~0ull;
}

template <bool R>
__device__ __forceinline__ bool is_nvlink(const A2ACommon& c, uint32_t r) {
    return (nvmask_of<R>(c) >> r) & 1ull;
}

// Lowest rank of a non-empty rank set.
__device__ __forceinline__ uint32_t first_rank(uint64_t m) { return (uint32_t)(__ffsll((long long)m) - 1); }

__device__ __forceinline__ uint64_t* blk_u64(const A2ACommon& c, uint64_t off) {
    return reinterpret_cast<uint64_t*>(c.blk + off);
}

// Loads of memory the NIC or the proxy writes (remote records, rows, count messages): volatile,
// so no stale cached copy is read after the flag that guards them was acquired.
__device__ __forceinline__ int4 ld_volatile_v4(const int4* p) {
    int4 v;
    asm volatile("ld.volatile.global.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

__device__ __forceinline__ int2 ld_volatile_int2(const int2* p) {
    int2 v;
    asm volatile("ld.volatile.global.v2.s32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint32_t ld_volatile_u32(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint64_t ld_volatile_u64(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// Rows remote source s sends my local experts, from its count message of call parity par.
__device__ __forceinline__ const uint32_t* msg_hist(const A2ACommon& c, uint32_t par, uint32_t s) {
    const uint8_t* msg = reinterpret_cast<const uint8_t*>(c.blk + c.blk_msg_in) + ((uint64_t)par * c.world + s) * c.msg_bytes;
    return reinterpret_cast<const uint32_t*>(msg + 8 + 4 * c.world) + c.rank * c.local_experts;
}

// Lane 0 of every sending warp of a launch calls this once, after its stores (and a __syncwarp):
// returns true in exactly one of them, the last, once every warp's stores are visible at system
// scope (each warp fences before it counts; `s_warps` counts the block's `nw` sending warps,
// `blocks` the launch's blocks). The caller then resets `*blocks` (for the launch that uses it
// next) and raises the proxy's flag.
__device__ __forceinline__ bool last_sender(uint32_t* s_warps, uint32_t nw, uint32_t* blocks) {
    __threadfence_system();
    if (atomicAdd(s_warps, 1u) + 1 != nw) return false;
    __threadfence_system();
    if (atomicAdd(blocks, 1u) + 1 != gridDim.x) return false;
    __threadfence_system();
    return true;
}

// Warp-collective wait: every lane with `active` waits until the sequence number in the high half
// of its own word *p reached `want`, with acquire semantics; `v` gets the word (the low half is
// the payload of self-flagged words). Returns false (every lane) when the wait timed out or the
// object is poisoned. Lanes that do not wait get v = 0.
__device__ __forceinline__ bool wait_words(const A2ACommon& c, const uint64_t* p, uint32_t want, bool active, uint64_t& v) {
    v = active ? ld_acquire_sys(p) : 0;
    bool ok = !active || seq_reached(v, want);
    if (__all_sync(0xffffffffu, ok)) {
        __syncwarp();  // orders every lane's acquire before any lane's later accesses
        return true;
    }
    volatile uint32_t* poison = reinterpret_cast<volatile uint32_t*>(state_at(c, c.st_poison));
    uint64_t start = 0;
    for (uint32_t spin = 0;; ++spin) {
        if ((spin & 63) == 0) {
            bool stop = *poison != 0;
            const uint64_t now = global_timer_ns();
            if (start == 0) {
                start = now;
            } else if (now - start > c.timeout_ns) {
                if (lane_id() == 0) {
                    *poison = 1;
                    set_error(c, A2A_ERR_TIMEOUT);
                }
                stop = true;
            }
            if (__any_sync(0xffffffffu, stop)) return false;
        }
        if (spin >= 256) __nanosleep(128);
        if (!ok) {
            v = ld_relaxed_sys(p);
            if (seq_reached(v, want)) {
                v = ld_acquire_sys(p);
                ok = true;
            }
        }
        if (__all_sync(0xffffffffu, ok)) {
            __syncwarp();
            return true;
        }
    }
}

// Keys of wait_host_flag (a remote rank's count flag and records flag in dispatch, its rows flag
// in combine: each key names one flag of the proxy block, so dispatch and combine calls never
// share one).
#define A2A_HOST_KEY_COUNTS 0
#define A2A_HOST_KEY_RECORDS A2A_MAX_PEERS
#define A2A_HOST_KEY_ROWS (2 * A2A_MAX_PEERS)
#define A2A_HOST_KEYS (3 * A2A_MAX_PEERS)  // HOST_WAIT_KEYS in src/layout.rs

// The device-memory copy of one proxy flag: the value its poller last saw, and the poller's tag
// (its call) so that one thread of the grid polls per call.
struct HostWait {
    uint64_t seen;
    uint32_t tag;
    uint32_t unused;
};

// wait_flag for the proxy's flags, which live in mapped host memory. Reads of host memory from
// many SMs at once stall the GPU's copies and command processing while they wait (a 1 MiB
// cudaMemcpy of the same context took 0.5-3.6 ms instead of 12-57 us with one polling thread per
// block of a full grid; with one poller in the grid it ran at full speed): with shm those copies
// are the transfer itself, and over tcp the send part's stores to host memory queue behind them.
// So per call and flag the first thread of the grid to wait polls the host flag (sleeping 1 us
// between reads) and copies what it saw into device memory (release); every other waiter polls
// that copy (its own acquire). The tag holds the call, so a copy from an earlier call is never
// taken for this one. Any thread may call it, in any subset of a warp; where a whole warp waits
// for one flag, one lane should (then __syncwarp: see wait_words). Returns 0 on a timeout.
__device__ __forceinline__ uint64_t wait_host_flag(const A2ACommon& c, const uint64_t* flag, uint32_t key,
                                                   uint32_t want) {
    HostWait* hw = reinterpret_cast<HostWait*>(state_at(c, c.st_host_wait)) + key;
    uint64_t v = ld_acquire_sys(&hw->seen);
    if (seq_reached(v, want)) return v;
    const uint32_t tag = want * 2u + 1u;  // never 0, the state's initial value
    const uint32_t prev = *reinterpret_cast<volatile uint32_t*>(&hw->tag);
    if (prev != tag && atomicCAS(&hw->tag, prev, tag) == prev) {
        v = wait_flag(c, flag, want, 1024);  // 0: timed out (the object is poisoned)
        if (v != 0) st_release_sys(&hw->seen, v);
        return v;
    }
    uint64_t start = 0;
    for (uint32_t spin = 1;; ++spin) {
        if ((spin & 63) == 0 && wait_expired(c, start)) return 0;
        if (seq_reached(ld_relaxed_sys(&hw->seen), want)) return ld_acquire_sys(&hw->seen);
        __nanosleep(256);
    }
}

__device__ __forceinline__ uint32_t* seq_slot(const A2ACommon& c, int kind) {
    return reinterpret_cast<uint32_t*>(state_at(c, c.st_seq)) + kind * A2A_MAX_GRID + blockIdx.x;
}

__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void fma_bf16x8(float* acc, const int4& v, float w) {
    const uint32_t u[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        acc[2 * q] = fmaf(w, bf16_lo(u[q]), acc[2 * q]);
        acc[2 * q + 1] = fmaf(w, bf16_hi(u[q]), acc[2 * q + 1]);
    }
}

__device__ __forceinline__ int4 pack_bf16x8(const float* acc) {
    int4 r;
    r.x = (int)pack_bf16(acc[0], acc[1]);
    r.y = (int)pack_bf16(acc[2], acc[3]);
    r.z = (int)pack_bf16(acc[4], acc[5]);
    r.w = (int)pack_bf16(acc[6], acc[7]);
    return r;
}

// Expert id of (token, slot); -1 for "no expert" (negative ids); `bad` set for ids >= E or < -1.
__device__ __forceinline__ int load_expert(const A2ADispatchSendArgs& a, uint64_t t, uint64_t j, bool& bad) {
    int64_t e;
    if (a.idx_is_64) {
        e = reinterpret_cast<const int64_t*>(a.idx)[t * a.idx_stride + j];
    } else {
        e = reinterpret_cast<const int32_t*>(a.idx)[t * a.idx_stride + j];
    }
    if (e < -1 || e >= (int64_t)a.c.num_experts) {
        bad = true;
        return -1;
    }
    return (int)e;
}

}  // namespace a2a
