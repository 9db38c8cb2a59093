// Shared definitions of the MoE all-to-all kernels: the parameter block (mirrored by
// src/params.rs, field for field, all 64-bit), memory-model helpers, flag waits with a timeout.
//
// Memory of one rank (see src/layout.rs for the offsets, computed once on the host):
//   shared region (CUDA IPC, written by peers over NVLink):
//     dflag[W]  u64  dispatch data from src complete:     (seq << 32) | tokens of src
//     dack[W]   u64  dst consumed my dispatch data:        (seq << 32)
//     cwflag[W] u64  combine weights from src written:     (seq << 32)
//     cflag[W]  u64  combine partial sums from dst written: (seq << 32)
//     dcnt[W][L]           i32   rows src sends to each of my local experts
//     hdr[W][Tmax][K]      int2  per (src, token, slot): (local expert, position) or (-1, -1)
//     data[W][Tmax][rec]   bytes token record: data (hidden * elem) then fp32 scales
//     cw[W][Tmax][K]       f32   weights of src's tokens (combine)
//     cdata[W][Tmax][H]    bf16  partial sums of my tokens computed by each dst (combine)
//   state (local device memory):
//     seq[4] u64 (per kernel kind), done[4] u32, poison u32, my_tokens u32, recv_tokens[W] u32,
//     token_mask[Tmax] u32, map[W][Tmax][K] i32 (row of the expert-major output, or -1)
//   host block (pinned, mapped): err[8] u32, counts seq u64 at 64, counts[E] u32 at 128.
//
// Flags carry a sequence number per kernel kind, kept in device memory and advanced by the last
// block of each launch: nothing is reset by the host, so back-to-back calls and CUDA-graph replays
// work. A remote (RDMA) proxy could raise the same flags with the same values.
#pragma once
#include <stdint.h>

#define A2A_MAX_PEERS 16
#define A2A_CHUNK_VECS 128  // 16-byte vectors per work item (2 KiB of a row), 4 per lane
#define A2A_GROUP 4         // rows (combine) whose loads are issued together

// Error words in the host block (each set to 1 when it happens; cleared by the host).
#define A2A_ERR_TIMEOUT 0
#define A2A_ERR_BAD_EXPERT 1
#define A2A_ERR_BAD_NUM_TOKENS 2
#define A2A_ERR_EXPERT_OVERFLOW 3

// Kernel kinds (index into seq[] and done[]).
#define A2A_DISPATCH_SEND 0
#define A2A_DISPATCH_RECV 1
#define A2A_COMBINE_SEND 2
#define A2A_COMBINE_RECV 3

struct A2ACommon {
    uint64_t rank, world, num_experts, local_experts, topk, max_tokens, max_rows, hidden;
    uint64_t data_bytes, num_scales, rec_bytes, timeout_ns;
    uint64_t state, host;
    uint64_t off_dflag, off_dack, off_cwflag, off_cflag, off_dcnt, off_hdr, off_data, off_cw, off_cdata;
    uint64_t st_seq, st_done, st_poison, st_my_tokens, st_recv_tokens, st_token_mask, st_map;
    uint64_t peers[A2A_MAX_PEERS];  // base of every rank's shared region in this process (own too)
};
static_assert(sizeof(A2ACommon) == (30 + A2A_MAX_PEERS) * 8, "mirror of src/params.rs");

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

struct A2ADispatchArgs {
    A2ADispatchSendArgs send;
    A2ADispatchRecvArgs recv;
};
struct A2ACombineArgs {
    A2ACombineSendArgs send;
    A2ACombineRecvArgs recv;
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

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
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

// Waits until the sequence number in the high half of *flag reached `want` (wrap-safe). Returns
// the flag's value, or 0 when the wait timed out (or an earlier wait did: the object is then
// poisoned and every later wait returns at once) after recording the error.
__device__ __forceinline__ uint64_t wait_flag(const A2ACommon& c, const uint64_t* flag, uint32_t want) {
    volatile uint32_t* poison = reinterpret_cast<volatile uint32_t*>(state_at(c, c.st_poison));
    uint64_t start = 0;
    for (uint32_t spin = 0;; ++spin) {
        const uint64_t v = ld_relaxed_sys(flag);
        if ((int32_t)((uint32_t)(v >> 32) - want) >= 0) {
            fence_acq_rel_sys();  // acquire: what the flag's writer released is visible from here on
            return v;
        }
        if ((spin & 63) == 0) {
            if (*poison) return 0;
            const uint64_t now = global_timer_ns();
            if (start == 0) {
                start = now;
            } else if (now - start > c.timeout_ns) {
                *poison = 1;
                set_error(c, A2A_ERR_TIMEOUT);
                return 0;
            }
        }
    }
}

__device__ __forceinline__ uint32_t lane_id() { return threadIdx.x & 31; }

// The sequence number of this launch of kernel `kind` (read by every block at its start).
__device__ __forceinline__ uint32_t next_seq(const A2ACommon& c, int kind) {
    const volatile uint64_t* seq = reinterpret_cast<const volatile uint64_t*>(state_at(c, c.st_seq));
    return (uint32_t)seq[kind] + 1;
}

// Called by every thread of every block once its stores are issued. Returns true in exactly
// one thread (thread 0 of the last block to finish), after every block's stores are visible
// at system scope; that thread then raises the flags. It also advances seq[kind] and re-arms the
// counter for the next launch. One fence per block: the barrier orders the block's stores before
// thread 0's fence, which is cumulative (the cooperative-groups grid-sync pattern, at sys scope).
__device__ __forceinline__ bool last_block_done(const A2ACommon& c, int kind, uint32_t n) {
    __syncthreads();
    if (threadIdx.x != 0) return false;
    fence_acq_rel_sys();
    unsigned int* done = reinterpret_cast<unsigned int*>(state_at(c, c.st_done)) + kind;
    const unsigned int prev = atomicAdd(done, 1u);
    if (prev != gridDim.x - 1) return false;
    fence_acq_rel_sys();
    *done = 0;
    volatile uint64_t* seq = reinterpret_cast<volatile uint64_t*>(state_at(c, c.st_seq));
    seq[kind] = n;
    return true;
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
