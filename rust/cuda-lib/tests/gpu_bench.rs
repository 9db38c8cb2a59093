//! Paged copy throughput vs copy engines. Run on a GPU host with
//! `FABRIC_LIB_GPU_BENCH=1 cargo test --release -p cuda-lib --test gpu_bench -- --nocapture`.
//! 2048 random pages (distinct destinations) out of pools of 4096, GPU0 -> GPU0 and, with two
//! GPUs, GPU0 -> GPU1 (kernel on GPU0 storing over NVLink); GB/s = 1e9 bytes per second.
mod common;

use std::sync::Arc;

use common::*;
use cuda_lib::{Context, DeviceBuffer, Event, Kernels, PagedCopy, Stream};

const PAGES: usize = 2048;
const POOL: u32 = 4096;

fn time_ms(ctx: &Arc<Context>, stream: &Stream, iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    let (start, end) = (Event::new(ctx, true).unwrap(), Event::new(ctx, true).unwrap());
    start.record(stream).unwrap();
    for _ in 0..iters {
        f();
    }
    end.record(stream).unwrap();
    end.synchronize().unwrap();
    f64::from(start.elapsed_ms(&end).unwrap()) / iters as f64
}

fn gbps(bytes: usize, ms: f64) -> f64 {
    bytes as f64 / (ms * 1e-3) / 1e9
}

#[test]
fn gpu_bench_paged_copy() {
    if std::env::var("FABRIC_LIB_GPU_BENCH").as_deref() != Ok("1") {
        eprintln!("skipped: set FABRIC_LIB_GPU_BENCH=1 on a GPU host");
        return;
    }
    let n = cuda_lib::device_count().unwrap();
    let ctx0 = ctx(0);
    let kernels = Kernels::load(&ctx0).unwrap();
    let stream = Stream::new(&ctx0).unwrap();
    let sms = ctx0.device().multiprocessor_count().unwrap();
    println!("device 0: {} ({} SMs); kernels {}", ctx0.device().name().unwrap(), sms, cuda_lib::kernel_archs());
    let mut targets = vec![("GPU0->GPU0", ctx0.clone())];
    if n > 1 {
        let ctx1 = ctx(1);
        ctx0.enable_peer_access(&ctx1).unwrap();
        ctx1.enable_peer_access(&ctx0).unwrap();
        targets.push(("GPU0->GPU1", ctx1));
    }
    println!("{:<11} {:>8} {:>7} {:>7} {:>9} {:>9}", "path", "page", "blocks", "threads", "GB/s", "us/iter");
    for page_len in [64usize << 10, 16 << 10] {
        let mut rng = Rng::new(page_len as u64);
        let dst_idx = rng.distinct(POOL, PAGES);
        let src_idx = rng.distinct(POOL, PAGES);
        let pool_bytes = POOL as usize * page_len;
        let total = PAGES * page_len;
        let src = DeviceBuffer::new(&ctx0, pool_bytes).unwrap();
        upload(&stream, src.ptr(), &rng.bytes(pool_bytes));
        let di = upload_u32(&ctx0, &stream, &dst_idx);
        let si = upload_u32(&ctx0, &stream, &src_idx);
        for (name, dctx) in &targets {
            let dst = DeviceBuffer::new(dctx, pool_bytes).unwrap();
            let mut configs = vec![(16, 256), (16, 512), (16, 1024), (32, 512), (sms, 512), (sms, 1024)];
            configs.dedup();
            for (blocks, threads) in configs {
                let copy = PagedCopy {
                    dst: dst.ptr(),
                    src: src.ptr(),
                    dst_idx: di.ptr(),
                    src_idx: si.ptr(),
                    dst_stride: page_len as u64,
                    src_stride: page_len as u64,
                    page_len: page_len as u64,
                    num_pages: PAGES as u32,
                    blocks,
                    threads,
                    ..Default::default()
                };
                let ms = time_ms(&ctx0, &stream, 20, || {
                    // SAFETY: pools hold POOL pages; indices are below POOL; destinations are
                    // distinct; buffers outlive the timing (which synchronizes).
                    unsafe { kernels.paged_copy(&stream, &copy) }.unwrap()
                });
                println!(
                    "{name:<11} {:>6}K {blocks:>7} {threads:>7} {:>9.1} {:>9.1}",
                    page_len >> 10,
                    gbps(total, ms),
                    ms * 1e3
                );
            }
            // Copy engine, contiguous: same total bytes in one copy.
            let ms = time_ms(&ctx0, &stream, 20, || {
                // SAFETY: both pools hold at least `total` bytes.
                unsafe { stream.memcpy_async(dst.ptr(), src.ptr(), total) }.unwrap()
            });
            println!(
                "{name:<11} {:>6}K {:>7} {:>7} {:>9.1} {:>9.1}  (cuMemcpyAsync, contiguous)",
                page_len >> 10,
                "CE",
                "-",
                gbps(total, ms),
                ms * 1e3
            );
            // Copy engine, one copy per page.
            let ms = time_ms(&ctx0, &stream, 5, || {
                for (d, s) in dst_idx.iter().zip(&src_idx) {
                    let (d, s) = (u64::from(*d) * page_len as u64, u64::from(*s) * page_len as u64);
                    // SAFETY: page ranges lie inside the pools.
                    unsafe { stream.memcpy_async(dst.ptr() + d, src.ptr() + s, page_len) }.unwrap();
                }
            });
            println!(
                "{name:<11} {:>6}K {:>7} {:>7} {:>9.1} {:>9.1}  (cuMemcpyAsync per page)",
                page_len >> 10,
                "CE",
                "-",
                gbps(total, ms),
                ms * 1e3
            );
        }
    }
    // A large contiguous copy for the link's ceiling.
    for (name, dctx) in &targets {
        let len = 256 << 20;
        let (a, b) = (DeviceBuffer::new(&ctx0, len).unwrap(), DeviceBuffer::new(dctx, len).unwrap());
        let ms = time_ms(&ctx0, &stream, 10, || {
            // SAFETY: both buffers hold `len` bytes.
            unsafe { stream.memcpy_async(b.ptr(), a.ptr(), len) }.unwrap()
        });
        println!("{name:<11} 256 MiB contiguous cuMemcpyAsync: {:.1} GB/s", gbps(len, ms));
    }
}
