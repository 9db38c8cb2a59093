//! GPU tests: run with `FABRIC_LIB_GPU_TESTS=1 cargo test -p cuda-lib --test gpu -- --test-threads=1`
//! on a host with CUDA GPUs; without the variable every test passes as "skipped". Tests that need
//! two GPUs skip on one. The cross-process tests re-run this binary as a child
//! (`gpu_child_process`, driven by FABRIC_LIB_CHILD).
mod common;

use std::{
    os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd},
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use common::*;
use cuda_lib::{
    device_count, ipc_export, pointer_device, CudaError, Device, DeviceBuffer, Event, IpcMapping, IpcMemHandle,
    Kernels, PagedCopy, PinnedHostBuffer, Stream, VmmAllocation, WaitValue,
};

#[test]
fn gpu_device_info() {
    require_gpus!(1);
    let (major, minor) = cuda_lib::driver_version().unwrap();
    println!("driver CUDA {major}.{minor}, {} devices, kernels: {}", device_count().unwrap(), cuda_lib::kernel_archs());
    for dev in Device::all().unwrap() {
        println!(
            "device {}: {} cc {:?}, {} SMs, {} GiB, clock {:?} kHz, vmm {} posix-fd {} gdr-vmm {} dmabuf {}",
            dev.ordinal(),
            dev.name().unwrap(),
            dev.compute_capability().unwrap(),
            dev.multiprocessor_count().unwrap(),
            dev.total_memory().unwrap() >> 30,
            dev.clock_rate_khz(),
            dev.supports_vmm().unwrap(),
            dev.supports_posix_fd_handles().unwrap(),
            dev.supports_gpu_direct_rdma_vmm().unwrap(),
            dev.supports_dmabuf().unwrap(),
        );
    }
    assert!(Device::get(device_count().unwrap()).is_err());
}

#[test]
fn gpu_operations_leave_the_current_context_alone() {
    require_gpus!(1);
    std::thread::spawn(|| {
        let ctx0 = ctx(0);
        // A fresh thread has no current context, and using ours does not leave one behind.
        let stream = Stream::new(&ctx0).unwrap();
        let buf = DeviceBuffer::new(&ctx0, 4096).unwrap();
        // SAFETY: `buf` holds 4096 bytes; synchronized below.
        unsafe { stream.memset_d8_async(buf.ptr(), 1, 4096) }.unwrap();
        stream.synchronize().unwrap();
        assert!(!ctx0.is_current().unwrap());
        drop((buf, stream));
        if device_count().unwrap() > 1 {
            // A bound context (torch's current device) stays current across work on another.
            let ctx1 = ctx(1);
            ctx0.bind().unwrap();
            let s1 = Stream::new(&ctx1).unwrap();
            s1.synchronize().unwrap();
            drop(s1);
            assert!(ctx0.is_current().unwrap() && !ctx1.is_current().unwrap());
        }
    })
    .join()
    .unwrap();
}

#[test]
fn gpu_pointer_device_tells_device_from_host() {
    require_gpus!(1);
    let ctx0 = ctx(0);
    let buf = DeviceBuffer::new(&ctx0, 1 << 20).unwrap();
    let vmm = VmmAllocation::new(&ctx0, 1 << 20).unwrap();
    let host = PinnedHostBuffer::new(&ctx0, 4096).unwrap();
    let stack = 0u64;
    assert_eq!(pointer_device(buf.ptr()), Some(0));
    assert_eq!(pointer_device(buf.ptr() + 100), Some(0));
    assert_eq!(pointer_device(vmm.ptr()), Some(0));
    assert_eq!(pointer_device(host.device_ptr()), None);
    assert_eq!(pointer_device(host.host_ptr() as u64), None);
    assert_eq!(pointer_device(&stack as *const u64 as u64), None);
    assert_eq!(pointer_device(0), None);
    if device_count().unwrap() > 1 {
        let buf1 = DeviceBuffer::new(&ctx(1), 4096).unwrap();
        assert_eq!(pointer_device(buf1.ptr()), Some(1));
    }
}

#[test]
fn gpu_memcpy_variants_and_events() {
    require_gpus!(1);
    let ctx0 = ctx(0);
    let stream = Stream::new(&ctx0).unwrap();
    let len = (8 << 20) + 13;
    let data = Rng::new(1).bytes(len);
    let a = DeviceBuffer::new(&ctx0, len).unwrap();
    let b = DeviceBuffer::new(&ctx0, len).unwrap();
    let c = DeviceBuffer::new(&ctx0, len).unwrap();
    upload(&stream, a.ptr(), &data);
    let (start, end) = (Event::new(&ctx0, true).unwrap(), Event::new(&ctx0, true).unwrap());
    start.record(&stream).unwrap();
    // SAFETY: all three buffers hold `len` bytes and live until the synchronize below.
    unsafe {
        stream.memcpy_dtod_async(b.ptr(), a.ptr(), len).unwrap();
        stream.memcpy_async(c.ptr(), b.ptr(), len).unwrap();
    }
    end.record(&stream).unwrap();
    end.synchronize().unwrap();
    assert!(end.is_complete().unwrap());
    println!("2 x {len} B D2D: {:.3} ms", start.elapsed_ms(&end).unwrap());
    assert_bytes_eq(&download(&stream, c.ptr(), len), &data, "D2D round trip");
    // memset
    // SAFETY: `c` holds `len` bytes.
    unsafe { stream.memset_d8_async(c.ptr(), 0xab, len) }.unwrap();
    assert!(download(&stream, c.ptr(), len).iter().all(|b| *b == 0xab));
    if device_count().unwrap() > 1 {
        let ctx1 = ctx(1);
        let d = DeviceBuffer::new(&ctx1, len).unwrap();
        let e = DeviceBuffer::new(&ctx1, len).unwrap();
        // SAFETY: sizes as above; synchronized before reading.
        unsafe { stream.memcpy_peer_async(d.ptr(), &ctx1, a.ptr(), &ctx0, len) }.unwrap();
        ctx0.enable_peer_access(&ctx1).unwrap();
        ctx0.enable_peer_access(&ctx1).unwrap(); // already enabled: still Ok
                                                 // SAFETY: as above (UVA copy between devices).
        unsafe { stream.memcpy_async(e.ptr(), d.ptr(), len) }.unwrap();
        stream.synchronize().unwrap();
        let s1 = Stream::new(&ctx1).unwrap();
        assert_bytes_eq(&download(&s1, e.ptr(), len), &data, "peer copies");
    }
}

#[test]
fn gpu_vmm_export_import_same_process() {
    require_gpus!(1);
    let ctx0 = ctx(0);
    let other = if device_count().unwrap() > 1 && Device::get(1).unwrap().can_access_peer(ctx0.device()).unwrap() {
        1
    } else {
        0
    };
    let ctx_t = ctx(other);
    let a = VmmAllocation::new(&ctx0, (4 << 20) + 123).unwrap();
    assert_eq!(a.len() % cuda_lib::vmm_granularity(ctx0.device()).unwrap(), 0);
    println!("VMM {} bytes, gpuDirectRDMACapable={}, importing on device {other}", a.len(), a.gpu_direct_rdma());
    let s0 = Stream::new(&ctx0).unwrap();
    let st = Stream::new(&ctx_t).unwrap();
    let data = Rng::new(2).bytes(a.len());
    upload(&s0, a.ptr(), &data);
    let fd = a.export_fd().unwrap();
    let b = VmmAllocation::import_fd(&ctx_t, fd.as_fd(), a.len()).unwrap();
    assert!(b.is_imported());
    assert_ne!(b.ptr(), a.ptr(), "the importer maps at its own address");
    println!("pointer_device(import) = {:?}", pointer_device(b.ptr()));
    assert!(pointer_device(b.ptr()).is_some());
    assert_bytes_eq(&download(&st, b.ptr(), b.len()), &data, "read through the import");
    let data2 = Rng::new(3).bytes(a.len());
    upload(&st, b.ptr(), &data2);
    assert_bytes_eq(&download(&s0, a.ptr(), a.len()), &data2, "write through the import");
    // The physical memory outlives the exporter's mapping while the import holds it.
    drop(fd);
    drop(a);
    assert_bytes_eq(&download(&st, b.ptr(), b.len()), &data2, "import after the exporter dropped");
    // Wrong length is an error, not a crash.
    let a2 = VmmAllocation::new(&ctx0, 1 << 20).unwrap();
    let fd2 = a2.export_fd().unwrap();
    assert!(VmmAllocation::import_fd(&ctx_t, fd2.as_fd(), 12345).is_err());
}

#[test]
fn gpu_vmm_peer_mapping_written_by_peer() {
    require_gpus!(2);
    let (ctx0, ctx1) = (ctx(0), ctx(1));
    if !ctx1.device().can_access_peer(ctx0.device()).unwrap() {
        eprintln!("skipped: no peer path 1 -> 0");
        return;
    }
    let kernels1 = Kernels::load(&ctx1).unwrap();
    let a = VmmAllocation::with_peers(&ctx0, 1 << 21, &[ctx1.device()]).unwrap();
    let s1 = Stream::new(&ctx1).unwrap();
    // SAFETY: `a` is mapped read/write for device 1; synchronized before reading.
    unsafe { kernels1.write_u64(&s1, a.ptr() + 64, 0x1122_3344_5566_7788) }.unwrap();
    s1.synchronize().unwrap();
    let s0 = Stream::new(&ctx0).unwrap();
    assert_eq!(&download(&s0, a.ptr() + 64, 8), &0x1122_3344_5566_7788u64.to_le_bytes());
}

#[test]
fn gpu_dmabuf_export() {
    require_gpus!(1);
    let ctx0 = ctx(0);
    if !ctx0.device().supports_dmabuf().unwrap() {
        eprintln!("skipped: device 0 cannot export DMA-BUF");
        return;
    }
    let a = VmmAllocation::new(&ctx0, 4 << 20).unwrap();
    let fd = a.export_dmabuf(0, a.len()).unwrap();
    let part = a.export_dmabuf(1 << 20, 1 << 20).unwrap();
    let buf = DeviceBuffer::new(&ctx0, 4 << 20).unwrap();
    let legacy = cuda_lib::export_dmabuf(&ctx0, buf.ptr(), 1 << 20).unwrap();
    for f in [&fd, &part, &legacy] {
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", f.as_raw_fd())).unwrap_or_default();
        println!(
            "dmabuf fd {}: {}",
            f.as_raw_fd(),
            info.lines().filter(|l| l.starts_with("exp_name") || l.starts_with("size")).collect::<Vec<_>>().join(", ")
        );
    }
    assert!(matches!(a.export_dmabuf(100, 4096), Err(CudaError::InvalidArgument(_))));
    assert!(matches!(a.export_dmabuf(0, a.len() + 4096), Err(CudaError::InvalidArgument(_))));
}

#[test]
fn gpu_pinned_host_written_by_kernel() {
    require_gpus!(1);
    let ctx0 = ctx(0);
    let kernels = Kernels::load(&ctx0).unwrap();
    let stream = Stream::new(&ctx0).unwrap();
    let host = PinnedHostBuffer::new(&ctx0, 4096).unwrap();
    assert_eq!(host.atomic_u64(1).load(Ordering::Acquire), 0);
    // SAFETY: word 1 of the mapped buffer, alive until the end of the test.
    unsafe { kernels.write_u64(&stream, host.device_ptr() + 8, 0xdead_beef_0000_0001) }.unwrap();
    // The CPU sees the store without synchronizing (the watcher path).
    let t0 = Instant::now();
    while host.atomic_u64(1).load(Ordering::Acquire) != 0xdead_beef_0000_0001 {
        assert!(t0.elapsed() < Duration::from_secs(5), "store never became visible");
        std::hint::spin_loop();
    }
    println!("kernel store seen by the CPU after {:?} (launch included)", t0.elapsed());
    stream.synchronize().unwrap();
    assert_eq!(host.atomic_u64(0).load(Ordering::Acquire), 0);
    // Misaligned or null addresses are refused before launching.
    // SAFETY: refused before launch.
    let misaligned = unsafe { kernels.write_u64(&stream, host.device_ptr() + 3, 1) };
    assert!(matches!(misaligned, Err(CudaError::InvalidArgument(_))));
}

#[test]
fn gpu_write_u64_inside_a_cuda_graph() {
    require_gpus!(1);
    let ctx0 = ctx(0);
    let kernels = Kernels::load(&ctx0).unwrap();
    let stream = Stream::new(&ctx0).unwrap();
    let host = PinnedHostBuffer::new(&ctx0, 4096).unwrap();
    stream.begin_capture().unwrap();
    // SAFETY: word 0 of the mapped buffer, alive while the graph is launched.
    unsafe { kernels.write_u64(&stream, host.device_ptr(), 7) }.unwrap();
    let graph = stream.end_capture().unwrap();
    assert_eq!(host.atomic_u64(0).load(Ordering::Acquire), 0, "capture does not execute");
    let exec = graph.instantiate().unwrap();
    for _ in 0..3 {
        host.atomic_u64(0).store(0, Ordering::Release);
        // SAFETY: the captured address is still allocated.
        unsafe { exec.launch(&stream) }.unwrap();
        stream.synchronize().unwrap();
        assert_eq!(host.atomic_u64(0).load(Ordering::Acquire), 7);
    }
}

#[test]
fn gpu_stream_write_and_wait_value() {
    require_gpus!(1);
    let ctx0 = ctx(0);
    let stream = Stream::new(&ctx0).unwrap();
    let other = Stream::new(&ctx0).unwrap();
    let host = PinnedHostBuffer::new(&ctx0, 4096).unwrap();
    let (flag, done) = (host.device_ptr(), host.device_ptr() + 8);
    // SAFETY: words of the mapped buffer that outlive the streams' work.
    unsafe {
        stream.wait_value64(flag, 5, WaitValue::Geq).unwrap();
        stream.write_value64(done, 42).unwrap();
    }
    std::thread::sleep(Duration::from_millis(50));
    assert!(!stream.is_idle().unwrap(), "the stream must block on the flag");
    assert_eq!(host.atomic_u64(1).load(Ordering::Acquire), 0);
    host.atomic_u64(0).store(5, Ordering::Release);
    stream.synchronize().unwrap();
    assert_eq!(host.atomic_u64(1).load(Ordering::Acquire), 42);
    // Device memory, between two streams.
    let dev = DeviceBuffer::new(&ctx0, 64).unwrap();
    // SAFETY: `dev` holds 64 bytes and outlives the streams' work.
    unsafe {
        stream.memset_d8_async(dev.ptr(), 0, 64).unwrap();
        stream.synchronize().unwrap();
        other.wait_value64(dev.ptr(), 1, WaitValue::Eq).unwrap();
        other.write_value64(done, 43).unwrap();
        stream.write_value64(dev.ptr(), 1).unwrap();
    }
    other.synchronize().unwrap();
    assert_eq!(host.atomic_u64(1).load(Ordering::Acquire), 43);
}

#[test]
fn gpu_flag_poll_sees_the_cpu_flag() {
    require_gpus!(1);
    let ctx0 = ctx(0);
    let kernels = Kernels::load(&ctx0).unwrap();
    let stream = Stream::new(&ctx0).unwrap();
    let host = PinnedHostBuffer::new(&ctx0, 4096).unwrap();
    host.atomic_u32(4).store(0xffff_ffff, Ordering::Release);
    let t0 = Instant::now();
    // SAFETY: words of the mapped buffer, alive until synchronize.
    unsafe { kernels.flag_poll(&stream, host.device_ptr(), 9, Duration::from_secs(10), host.device_ptr() + 16) }
        .unwrap();
    std::thread::sleep(Duration::from_millis(20));
    host.atomic_u64(0).store(8, Ordering::Release); // not yet
    std::thread::sleep(Duration::from_millis(20));
    assert!(!stream.is_idle().unwrap());
    host.atomic_u64(0).store(9, Ordering::Release);
    stream.synchronize().unwrap();
    println!("flag poll returned {:?} after start", t0.elapsed());
    assert_eq!(host.atomic_u32(4).load(Ordering::Acquire), 0, "status: seen");
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[test]
fn gpu_flag_poll_times_out() {
    require_gpus!(1);
    let ctx0 = ctx(0);
    let kernels = Kernels::load(&ctx0).unwrap();
    let stream = Stream::new(&ctx0).unwrap();
    let host = PinnedHostBuffer::new(&ctx0, 4096).unwrap();
    host.atomic_u32(4).store(0xffff_ffff, Ordering::Release);
    let timeout = Duration::from_millis(100);
    let t0 = Instant::now();
    // SAFETY: as above.
    unsafe { kernels.flag_poll(&stream, host.device_ptr(), 1, timeout, host.device_ptr() + 16) }.unwrap();
    stream.synchronize().unwrap();
    let took = t0.elapsed();
    println!("flag poll timeout {timeout:?} ({} cycles) returned after {took:?}", kernels.timeout_cycles(timeout));
    assert_eq!(host.atomic_u32(4).load(Ordering::Acquire), 1, "status: timed out");
    assert!(took >= Duration::from_millis(40) && took < Duration::from_secs(5), "{took:?}");
}

struct PagedCase {
    name: &'static str,
    page_len: usize,
    pages: usize,
    pool: u32,
    dst_pad: usize,
    src_pad: usize,
    dst_off: usize,
    src_off: usize,
    identity: bool,
    host_indices: bool,
}

const fn case(name: &'static str, page_len: usize, pages: usize) -> PagedCase {
    PagedCase {
        name,
        page_len,
        pages,
        pool: pages as u32 + 256,
        dst_pad: 0,
        src_pad: 0,
        dst_off: 0,
        src_off: 0,
        identity: false,
        host_indices: false,
    }
}

fn paged_cases() -> Vec<PagedCase> {
    vec![
        case("64 KiB x 2048", 64 << 10, 2048),
        case("16 KiB x 2048", 16 << 10, 2048),
        PagedCase { dst_pad: 256, src_pad: 512, dst_off: 128, src_off: 64, ..case("4 KiB strided+offset", 4096, 1000) },
        PagedCase { dst_pad: 8, src_pad: 24, dst_off: 8, src_off: 16, ..case("8-byte aligned", 4104, 777) },
        PagedCase { dst_pad: 12, src_pad: 4, dst_off: 4, src_off: 8, ..case("4-byte aligned", 1028, 500) },
        PagedCase { dst_pad: 3, src_pad: 5, dst_off: 1, src_off: 3, ..case("unaligned bytes", 1001, 333) },
        PagedCase { identity: true, ..case("identity indices", 12 << 10, 300) },
        PagedCase { host_indices: true, ..case("indices in mapped host memory", 32 << 10, 64) },
        case("tiny pages", 48, 5000),
        PagedCase { pool: 4, ..case("one page", 1 << 20, 1) },
    ]
}

fn run_paged_case(
    kernels: &Kernels,
    dst_ctx: &std::sync::Arc<cuda_lib::Context>,
    c: &PagedCase,
    seed: u64,
    (blocks, threads): (u32, u32),
) {
    let ctx0 = kernels.context();
    let s0 = Stream::new(ctx0).unwrap();
    let sd = Stream::new(dst_ctx).unwrap();
    let mut rng = Rng::new(seed);
    let (ds, ss) = (c.page_len + c.dst_pad, c.page_len + c.src_pad);
    let dst_len = c.pool as usize * ds + c.dst_off;
    let src_len = c.pool as usize * ss + c.src_off;
    let (dst_idx, src_idx): (Vec<u32>, Vec<u32>) = if c.identity {
        ((0..c.pages as u32).collect(), (0..c.pages as u32).collect())
    } else {
        let dst = rng.distinct(c.pool, c.pages);
        let src = (0..c.pages).map(|_| rng.below(u64::from(c.pool)) as u32).collect();
        (dst, src)
    };
    let src_data = rng.bytes(src_len);
    let dst_init = rng.bytes(dst_len);
    let src = DeviceBuffer::new(ctx0, src_len).unwrap();
    let dst = DeviceBuffer::new(dst_ctx, dst_len).unwrap();
    upload(&s0, src.ptr(), &src_data);
    upload(&sd, dst.ptr(), &dst_init);
    let host_idx = PinnedHostBuffer::new(ctx0, c.pages * 8).unwrap();
    let (dbuf, sbuf, di, si);
    if c.identity {
        (di, si) = (0, 0);
    } else if c.host_indices {
        for (i, (d, s)) in dst_idx.iter().zip(&src_idx).enumerate() {
            host_idx.atomic_u32(i).store(*d, Ordering::Relaxed);
            host_idx.atomic_u32(c.pages + i).store(*s, Ordering::Relaxed);
        }
        (di, si) = (host_idx.device_ptr(), host_idx.device_ptr() + 4 * c.pages as u64);
    } else {
        dbuf = upload_u32(ctx0, &s0, &dst_idx);
        sbuf = upload_u32(ctx0, &s0, &src_idx);
        (di, si) = (dbuf.ptr(), sbuf.ptr());
    }
    let copy = PagedCopy {
        dst: dst.ptr(),
        src: src.ptr(),
        dst_idx: di,
        src_idx: si,
        dst_stride: ds as u64,
        dst_offset: c.dst_off as u64,
        src_stride: ss as u64,
        src_offset: c.src_off as u64,
        page_len: c.page_len as u64,
        num_pages: c.pages as u32,
        blocks,
        threads,
    };
    let plan = copy.plan().unwrap().unwrap();
    // SAFETY: pools cover every index; destination pages are distinct; all buffers outlive the
    // synchronize below; `dst` is on this device or a peer with access enabled.
    unsafe { kernels.paged_copy(&s0, &copy) }.unwrap();
    s0.synchronize().unwrap();
    let mut want = dst_init;
    reference_paged_copy(&mut want, &src_data, &dst_idx, &src_idx, ds, c.dst_off, ss, c.src_off, c.page_len);
    let got = download(&sd, dst.ptr(), dst_len);
    assert_bytes_eq(&got, &want, c.name);
    println!(
        "paged copy ok: {} ({} B vectors, {} threads/page, {} x {} threads)",
        c.name, plan.vector_bytes, plan.group_threads, plan.blocks, plan.threads
    );
}

#[test]
fn gpu_paged_copy_local_matches_cpu_reference() {
    require_gpus!(1);
    let ctx0 = ctx(0);
    let kernels = Kernels::load(&ctx0).unwrap();
    // The default grid, a narrow one, and an odd block size (idle threads past the groups).
    for config in [(16, 1024), (16, 256), (3, 96)] {
        for (i, c) in paged_cases().iter().enumerate() {
            run_paged_case(&kernels, &ctx0, c, 100 + i as u64, config);
        }
    }
}

#[test]
fn gpu_paged_copy_peer_matches_cpu_reference() {
    require_gpus!(2);
    let (ctx0, ctx1) = (ctx(0), ctx(1));
    ctx0.enable_peer_access(&ctx1).unwrap();
    let kernels = Kernels::load(&ctx0).unwrap();
    for (i, c) in paged_cases().iter().enumerate() {
        run_paged_case(&kernels, &ctx1, c, 200 + i as u64, (16, 1024));
    }
    // Into a VMM allocation on GPU 1 mapped for GPU 0.
    let s0 = Stream::new(&ctx0).unwrap();
    let s1 = Stream::new(&ctx1).unwrap();
    let page = 64 << 10;
    let dst = VmmAllocation::with_peers(&ctx1, 512 * page, &[ctx0.device()]).unwrap();
    let src = DeviceBuffer::new(&ctx0, 512 * page).unwrap();
    let data = Rng::new(7).bytes(512 * page);
    upload(&s0, src.ptr(), &data);
    let idx: Vec<u32> = (0..512).rev().collect();
    let idx_buf = upload_u32(&ctx0, &s0, &idx);
    let copy = PagedCopy {
        dst: dst.ptr(),
        src: src.ptr(),
        dst_idx: idx_buf.ptr(),
        src_idx: 0,
        dst_stride: page as u64,
        src_stride: page as u64,
        page_len: page as u64,
        num_pages: 512,
        ..Default::default()
    };
    // SAFETY: as above; the VMM range is mapped read/write for device 0.
    unsafe { kernels.paged_copy(&s0, &copy) }.unwrap();
    s0.synchronize().unwrap();
    let mut want = vec![0u8; 512 * page];
    let ident: Vec<u32> = (0..512).collect();
    reference_paged_copy(&mut want, &data, &idx, &ident, page, 0, page, 0, page);
    assert_bytes_eq(&download(&s1, dst.ptr(), 512 * page), &want, "into peer VMM");
}

// ---- cross-process: the parent spawns this binary running only `gpu_child_process` ----

fn spawn_child(role: &str) -> std::process::ExitStatus {
    let exe = std::env::current_exe().unwrap();
    std::process::Command::new(exe)
        .args(["gpu_child_process", "--exact", "--nocapture", "--test-threads=1"])
        .env("FABRIC_LIB_CHILD", role)
        .status()
        .unwrap()
}

#[test]
fn gpu_ipc_handle_across_processes() {
    require_gpus!(1);
    let ctx0 = ctx(0);
    let stream = Stream::new(&ctx0).unwrap();
    let len = 1 << 20;
    let buf = DeviceBuffer::new(&ctx0, len).unwrap();
    upload(&stream, buf.ptr(), &Rng::new(11).bytes(len));
    let export = ipc_export(&ctx0, buf.ptr() + 4096).unwrap();
    assert_eq!(export.offset, 4096);
    assert!(export.alloc_len >= len);
    // Opening one's own handle: the driver refuses (an error, not a crash).
    let own = IpcMapping::open(&ctx0, &export.handle).map(|m| m.ptr());
    println!("same-process IPC open: {own:?}");
    let hex: String = export.handle.0.iter().map(|b| format!("{b:02x}")).collect();
    let status = spawn_child(&format!("ipc:{hex}:{}:{}", export.offset, len));
    assert!(status.success(), "child failed: {status}");
    let mut want = Rng::new(11).bytes(len);
    want[4096..].copy_from_slice(&Rng::new(12).bytes(len - 4096));
    assert_bytes_eq(&download(&stream, buf.ptr(), len), &want, "data written by the child");
}

#[test]
fn gpu_vmm_fd_across_processes() {
    require_gpus!(1);
    let ctx0 = ctx(0);
    let stream = Stream::new(&ctx0).unwrap();
    let a = VmmAllocation::new(&ctx0, 2 << 20).unwrap();
    upload(&stream, a.ptr(), &Rng::new(21).bytes(a.len()));
    let fd = a.export_fd().unwrap();
    let status = spawn_child(&format!("vmm:{}:{}:{}", std::process::id(), fd.as_raw_fd(), a.len()));
    if status.code() == Some(77) {
        eprintln!("skipped: pidfd_getfd not permitted here");
        return;
    }
    assert!(status.success(), "child failed: {status}");
    assert_bytes_eq(&download(&stream, a.ptr(), a.len()), &Rng::new(22).bytes(a.len()), "data written by the child");
}

/// Not a test on its own: the child half of the cross-process tests.
#[test]
fn gpu_child_process() {
    let Ok(role) = std::env::var("FABRIC_LIB_CHILD") else {
        return;
    };
    let parts: Vec<&str> = role.split(':').collect();
    let last = device_count().unwrap() - 1;
    let ctx_c = ctx(last);
    let stream = Stream::new(&ctx_c).unwrap();
    match parts[0] {
        "ipc" => {
            let mut handle = [0u8; 64];
            for (i, b) in handle.iter_mut().enumerate() {
                *b = u8::from_str_radix(&parts[1][2 * i..2 * i + 2], 16).unwrap();
            }
            let (offset, len): (u64, usize) = (parts[2].parse().unwrap(), parts[3].parse().unwrap());
            let map = IpcMapping::open(&ctx_c, &IpcMemHandle(handle)).unwrap();
            let ptr = map.ptr() + offset;
            let got = download(&stream, ptr, len - offset as usize);
            assert_bytes_eq(&got, &Rng::new(11).bytes(len)[offset as usize..], "child read via IPC");
            upload(&stream, ptr, &Rng::new(12).bytes(len - offset as usize));
            println!("child (device {last}): IPC read+write ok");
        }
        "vmm" => {
            let (pid, remote_fd, len): (i32, i32, usize) =
                (parts[1].parse().unwrap(), parts[2].parse().unwrap(), parts[3].parse().unwrap());
            // SAFETY: plain syscalls with integer arguments; results are checked.
            let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
            let fd = if pidfd >= 0 {
                // SAFETY: as above.
                unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd as i32, remote_fd, 0) }
            } else {
                -1
            };
            if fd < 0 {
                eprintln!("pidfd_getfd failed: {}", std::io::Error::last_os_error());
                std::process::exit(77);
            }
            // SAFETY: pidfd_getfd returned a new fd owned by this process.
            let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
            let b = VmmAllocation::import_fd(&ctx_c, fd.as_fd(), len).unwrap();
            assert_bytes_eq(&download(&stream, b.ptr(), len), &Rng::new(21).bytes(len), "child read via VMM fd");
            upload(&stream, b.ptr(), &Rng::new(22).bytes(len));
            println!("child (device {last}): VMM fd import read+write ok");
        }
        other => panic!("unknown child role {other}"),
    }
}
