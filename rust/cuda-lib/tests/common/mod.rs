//! Helpers shared by the GPU test binaries (`gpu.rs`, `gpu_bench.rs`).
#![allow(dead_code)]
use std::sync::Arc;

use cuda_lib::{Context, DeviceBuffer, Stream};

/// GPU tests run only with FABRIC_LIB_GPU_TESTS=1 (they need a CUDA GPU and driver).
pub fn gpu_tests_enabled() -> bool {
    std::env::var("FABRIC_LIB_GPU_TESTS").as_deref() == Ok("1")
}

/// Returns early (test passes as skipped) unless GPU tests are enabled.
#[macro_export]
macro_rules! require_gpus {
    ($n:expr) => {
        if !common::gpu_tests_enabled() {
            eprintln!("skipped: set FABRIC_LIB_GPU_TESTS=1 on a GPU host");
            return;
        }
        let count = cuda_lib::device_count().expect("FABRIC_LIB_GPU_TESTS=1 but no CUDA driver");
        if count < $n {
            eprintln!("skipped: needs {} GPUs, {} visible", $n, count);
            return;
        }
    };
}

pub fn ctx(ordinal: usize) -> Arc<Context> {
    Context::new(ordinal).expect("primary context")
}

/// xorshift64*: deterministic test data without a rand dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len + 8);
        while out.len() < len {
            out.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        out.truncate(len);
        out
    }
    /// `k` distinct values below `n`, in random order.
    pub fn distinct(&mut self, n: u32, k: usize) -> Vec<u32> {
        let mut all: Vec<u32> = (0..n).collect();
        for i in (1..all.len()).rev() {
            all.swap(i, self.below(i as u64 + 1) as usize);
        }
        all.truncate(k);
        all
    }
}

pub fn upload(stream: &Stream, dst: u64, data: &[u8]) {
    // SAFETY: tests pass device ranges of at least data.len() bytes; synchronized right after.
    unsafe { stream.memcpy_htod_async(dst, data.as_ptr(), data.len()) }.unwrap();
    stream.synchronize().unwrap();
}

pub fn download(stream: &Stream, src: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: tests pass device ranges of at least len bytes; synchronized right after.
    unsafe { stream.memcpy_dtoh_async(out.as_mut_ptr(), src, len) }.unwrap();
    stream.synchronize().unwrap();
    out
}

pub fn upload_u32(ctx: &Arc<Context>, stream: &Stream, values: &[u32]) -> DeviceBuffer {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let buf = DeviceBuffer::new(ctx, bytes.len().max(4)).unwrap();
    upload(stream, buf.ptr(), &bytes);
    buf
}

pub fn assert_bytes_eq(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        let bad = got.iter().zip(want).filter(|(a, b)| a != b).count();
        panic!("{what}: {bad} bytes differ, first at {i}: got {:#04x}, want {:#04x}", got[i], want[i]);
    }
}

/// CPU reference of the paged copy over whole pools.
#[allow(clippy::too_many_arguments)]
pub fn reference_paged_copy(
    dst: &mut [u8],
    src: &[u8],
    dst_idx: &[u32],
    src_idx: &[u32],
    dst_stride: usize,
    dst_off: usize,
    src_stride: usize,
    src_off: usize,
    page_len: usize,
) {
    for (d, s) in dst_idx.iter().zip(src_idx) {
        let (d, s) = (*d as usize * dst_stride + dst_off, *s as usize * src_stride + src_off);
        dst[d..d + page_len].copy_from_slice(&src[s..s + page_len]);
    }
}
