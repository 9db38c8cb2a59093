//! The same-host channel: writes between processes (or engines) of one host where either side is
//! GPU memory, carried out by CUDA instead of the NIC.
//!
//! - GPU → GPU: the destination allocation is opened once through its legacy IPC handle (cached
//!   per (owner process, handle, local device); a region of this very process is used through its
//!   pointer, since CUDA refuses to open a handle in the process that exported it). Contiguous
//!   writes are one `cuMemcpyAsync` (copy engines, no SMs); paged writes are one launch of
//!   cuda-lib's paged-copy kernel (`paged_copy_blocks` blocks, default 16) with both page index
//!   arrays in mapped pinned host memory.
//! - host → GPU: contiguous: `cuMemcpyAsync` from the (pageable) source into the IPC-mapped peer
//!   memory; paged: the worker gathers the source pages into pinned staging memory, then the
//!   kernel scatters them from there.
//! - GPU → host: the peer's host memory cannot be opened through CUDA, so the data goes to
//!   local pinned staging memory first (copy engine, or the kernel for pages), and once that
//!   completed the worker writes it into the peer process with `process_vm_writev` (a plain
//!   copy when the peer is this process). Needs ptrace permission over the peer (same user and
//!   Yama `ptrace_scope` 0, or CAP_SYS_PTRACE).
//!
//! Every copy runs on a worker-owned stream per device and ends with an event; the worker polls
//! those events alongside its completion queues (never a blocking synchronize). Completions of
//! one device come in submission order.
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use cuda_lib::{Context, Event, IpcMapping, IpcMemHandle, Kernels, PagedCopy, PinnedHostBuffer, Stream};

use crate::descriptor::{CudaIpc, MemoryKind};
use crate::error::{FabricError, Result};

/// The local side of a same-host write.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LocalSrc {
    pub kind: MemoryKind,
    pub ptr: u64,
}

/// The destination region as its descriptor describes it.
#[derive(Clone, Debug)]
pub(crate) struct LocalDst {
    pub kind: MemoryKind,
    /// The region's address in its owner's process.
    pub base: u64,
    /// The region's length (as its descriptor says; checked against the opened allocation).
    pub len: u64,
    pub pid: u32,
    /// The owner's random process id (cache key).
    pub process: u64,
    pub same_process: bool,
    pub cuda: Option<CudaIpc>,
}

/// What to copy (already checked against both regions).
#[derive(Clone, Debug)]
pub(crate) enum LocalCopy {
    Contiguous {
        src_offset: u64,
        dst_offset: u64,
        len: u64,
    },
    Paged {
        page_len: u64,
        src_pages: Vec<u32>,
        src_stride: u64,
        src_offset: u64,
        dst_pages: Vec<u32>,
        dst_stride: u64,
        dst_offset: u64,
    },
}

/// A finished same-host copy: (request, source region, result).
pub(crate) type LocalDone = (u64, u64, Result<()>);

struct DeviceState {
    ctx: Arc<Context>,
    stream: Stream,
    kernels: Option<Kernels>,
    events: Vec<Event>,
    inflight: VecDeque<InFlight>,
}

/// Bytes to write into a host destination once the staging copy completed.
struct HostWrite {
    pid: u32,
    same_process: bool,
    /// (offset in the staging buffer, remote address, length)
    pieces: Vec<(usize, u64, usize)>,
}

struct InFlight {
    request: u64,
    region: u64,
    event: Event,
    buffers: Vec<PinnedHostBuffer>,
    host_write: Option<HostWrite>,
    error: Option<FabricError>,
}

/// Worker-owned CUDA state of the same-host channel (created on first use).
pub(crate) struct LocalChannel {
    devices: HashMap<usize, DeviceState>,
    mappings: HashMap<(u64, [u8; 64], usize), IpcMapping>,
    peer_access: HashSet<(usize, usize)>,
    pool: Vec<PinnedHostBuffer>,
    device_count: usize,
    blocks: u32,
}

const POOL_LIMIT: usize = 32;
const MIN_PINNED: usize = 64 * 1024;

impl LocalChannel {
    pub fn new(blocks: u32) -> Result<Self> {
        let device_count = cuda_lib::device_count()?;
        if device_count == 0 {
            return Err(FabricError::CudaUnavailable("no CUDA device is visible to this process".into()));
        }
        Ok(LocalChannel {
            devices: HashMap::new(),
            mappings: HashMap::new(),
            peer_access: HashSet::new(),
            pool: Vec::new(),
            device_count,
            blocks: blocks.max(1),
        })
    }

    /// Whether copies are in flight (the worker keeps spinning while they are).
    pub fn busy(&self) -> bool {
        self.devices.values().any(|d| !d.inflight.is_empty())
    }

    fn device(&mut self, ordinal: usize) -> Result<&mut DeviceState> {
        match self.devices.entry(ordinal) {
            std::collections::hash_map::Entry::Occupied(e) => Ok(e.into_mut()),
            std::collections::hash_map::Entry::Vacant(v) => {
                let ctx = Context::new(ordinal)?;
                let stream = Stream::new(&ctx)?;
                Ok(v.insert(DeviceState { ctx, stream, kernels: None, events: Vec::new(), inflight: VecDeque::new() }))
            }
        }
    }

    fn kernels(&mut self, ordinal: usize) -> Result<()> {
        let dev = self.device(ordinal)?;
        if dev.kernels.is_none() {
            dev.kernels = Some(Kernels::load(&dev.ctx)?);
        }
        Ok(())
    }

    fn pinned(&mut self, ordinal: usize, len: usize) -> Result<PinnedHostBuffer> {
        let best =
            self.pool.iter().enumerate().filter(|(_, b)| b.len() >= len).min_by_key(|(_, b)| b.len()).map(|(i, _)| i);
        if let Some(i) = best {
            return Ok(self.pool.swap_remove(i));
        }
        let ctx = self.device(ordinal)?.ctx.clone();
        Ok(PinnedHostBuffer::new(&ctx, len.max(MIN_PINNED).next_power_of_two())?)
    }

    fn recycle(&mut self, buffers: Vec<PinnedHostBuffer>) {
        for b in buffers {
            if self.pool.len() < POOL_LIMIT {
                self.pool.push(b);
            }
        }
    }

    /// The local device that runs a copy: the source's, or for host sources the destination's
    /// ordinal (assuming both processes see the same devices under the same ordinals).
    fn copy_device(&self, src: &LocalSrc, dst: &LocalDst) -> usize {
        match (src.kind, dst.kind) {
            (MemoryKind::Cuda(d), _) => d as usize,
            (MemoryKind::Host, MemoryKind::Cuda(d)) if (d as usize) < self.device_count => d as usize,
            _ => 0,
        }
    }

    /// The address of the destination region's byte 0 as seen from `device` in this process.
    fn dst_base(&mut self, device: usize, dst: &LocalDst) -> Result<u64> {
        let MemoryKind::Cuda(dst_dev) = dst.kind else { unreachable!("host destinations are written by the CPU") };
        if dst.same_process {
            let dst_dev = dst_dev as usize;
            if dst_dev != device && self.peer_access.insert((device, dst_dev)) {
                let ctx = self.device(device)?.ctx.clone();
                let peer = self.device(dst_dev)?.ctx.clone();
                if let Err(e) = ctx.enable_peer_access(&peer) {
                    self.peer_access.remove(&(device, dst_dev));
                    return Err(e.into());
                }
            }
            return Ok(dst.base);
        }
        let ipc = dst
            .cuda
            .as_ref()
            .ok_or_else(|| FabricError::InvalidDescriptor("GPU descriptor without IPC data".into()))?;
        let handle: [u8; 64] = ipc
            .handle
            .as_slice()
            .try_into()
            .map_err(|_| FabricError::InvalidDescriptor("CUDA IPC handle is not 64 bytes".into()))?;
        let key = (dst.process, handle, device);
        if !self.mappings.contains_key(&key) {
            let ctx = self.device(device)?.ctx.clone();
            let mapping = IpcMapping::open(&ctx, &IpcMemHandle(handle)).map_err(|e| {
                FabricError::Cuda(format!(
                    "opening the peer's (pid {}) CUDA IPC handle on device {device}: {e} (was the region freed, or is the peer gone?)",
                    dst.pid
                ))
            })?;
            self.mappings.insert(key, mapping);
        }
        let mapping = &self.mappings[&key];
        // The descriptor is the peer's word; the driver's size of the opened allocation is not.
        if ipc.offset.checked_add(dst.len).is_none_or(|end| end > mapping.len() as u64) {
            return Err(FabricError::InvalidDescriptor(format!(
                "GPU descriptor claims [{}, +{}) of an allocation that has {} bytes",
                ipc.offset,
                dst.len,
                mapping.len()
            )));
        }
        Ok(mapping.ptr() + ipc.offset)
    }

    /// Enqueues one same-host write; its completion is reported by [`LocalChannel::poll`].
    pub fn submit(&mut self, request: u64, region: u64, src: LocalSrc, dst: LocalDst, copy: LocalCopy) -> Result<()> {
        let device = self.copy_device(&src, &dst);
        let blocks = self.blocks;
        let mut buffers = Vec::new();
        let mut host_write = None;
        // Everything fallible that enqueues nothing happens first; once work is enqueued an
        // error is reported through the in-flight entry (after the stream passed it).
        let mut enqueue_error = None;
        match (src.kind, dst.kind) {
            (MemoryKind::Host, MemoryKind::Host) => {
                return Err(FabricError::InvalidArgument("host-to-host writes take the network path".into()))
            }
            (_, MemoryKind::Cuda(_)) => {
                let dst_base = self.dst_base(device, &dst)?;
                match &copy {
                    LocalCopy::Contiguous { src_offset, dst_offset, len } => {
                        let d = self.device(device)?;
                        let (dst_ptr, src_ptr) = (dst_base + dst_offset, src.ptr + src_offset);
                        // SAFETY: both ranges were checked against their registrations; the
                        // source stays registered (in-flight count) until the event completed.
                        let copied = unsafe { d.stream.memcpy_async(dst_ptr, src_ptr, *len as usize) };
                        if let Err(e) = copied {
                            enqueue_error = Some(e.into());
                        }
                    }
                    LocalCopy::Paged {
                        page_len,
                        src_pages,
                        src_stride,
                        src_offset,
                        dst_pages,
                        dst_stride,
                        dst_offset,
                    } => {
                        self.kernels(device)?;
                        let n = src_pages.len();
                        let mut idx = self.pinned(device, 8 * n)?;
                        {
                            let bytes = idx.as_mut_slice();
                            for (i, (&s, &d)) in src_pages.iter().zip(dst_pages).enumerate() {
                                bytes[4 * i..4 * i + 4].copy_from_slice(&s.to_le_bytes());
                                bytes[4 * (n + i)..4 * (n + i) + 4].copy_from_slice(&d.to_le_bytes());
                            }
                        }
                        let mut copy = PagedCopy {
                            dst: dst_base,
                            src: src.ptr,
                            dst_idx: idx.device_ptr() + 4 * n as u64,
                            src_idx: idx.device_ptr(),
                            dst_stride: *dst_stride,
                            dst_offset: *dst_offset,
                            src_stride: *src_stride,
                            src_offset: *src_offset,
                            page_len: *page_len,
                            num_pages: n as u32,
                            blocks,
                            ..Default::default()
                        };
                        if src.kind == MemoryKind::Host {
                            // Gather the (pageable) source pages into pinned staging memory
                            // the kernel can read; it then copies page i from staging slot i.
                            let total = n * *page_len as usize;
                            let mut staging = self.pinned(device, total)?;
                            let out = staging.as_mut_slice();
                            for (i, &s) in src_pages.iter().enumerate() {
                                let from = src.ptr + u64::from(s) * src_stride + src_offset;
                                // SAFETY: the page lies inside the registered source region
                                // (checked by the engine), which stays registered meanwhile.
                                let page = unsafe { std::slice::from_raw_parts(from as *const u8, *page_len as usize) };
                                out[i * *page_len as usize..(i + 1) * *page_len as usize].copy_from_slice(page);
                            }
                            copy.src = staging.device_ptr();
                            copy.src_idx = 0;
                            copy.src_stride = *page_len;
                            copy.src_offset = 0;
                            buffers.push(staging);
                        }
                        buffers.push(idx);
                        let d = self.device(device)?;
                        let kernels = d.kernels.as_ref().expect("loaded above");
                        // SAFETY: every page was checked against both regions; index arrays
                        // and staging live in `buffers` until the event completed.
                        if let Err(e) = unsafe { kernels.paged_copy(&d.stream, &copy) } {
                            enqueue_error = Some(e.into());
                        }
                    }
                }
            }
            (MemoryKind::Cuda(_), MemoryKind::Host) => {
                let (total, pieces, paged) = match &copy {
                    LocalCopy::Contiguous { dst_offset, len, .. } => {
                        (*len as usize, vec![(0usize, dst.base + dst_offset, *len as usize)], None)
                    }
                    LocalCopy::Paged { page_len, dst_pages, dst_stride, dst_offset, .. } => {
                        let pl = *page_len as usize;
                        let pieces = dst_pages
                            .iter()
                            .enumerate()
                            .map(|(i, &d)| (i * pl, dst.base + u64::from(d) * dst_stride + dst_offset, pl))
                            .collect();
                        (dst_pages.len() * pl, pieces, Some(()))
                    }
                };
                if paged.is_some() {
                    self.kernels(device)?;
                }
                let staging = self.pinned(device, total.max(1))?;
                let mut idx = None;
                if let LocalCopy::Paged { src_pages, .. } = &copy {
                    let mut b = self.pinned(device, 4 * src_pages.len())?;
                    let bytes = b.as_mut_slice();
                    for (i, &s) in src_pages.iter().enumerate() {
                        bytes[4 * i..4 * i + 4].copy_from_slice(&s.to_le_bytes());
                    }
                    idx = Some(b);
                }
                let d = self.device(device)?;
                let result = match &copy {
                    // SAFETY: the source range was checked; staging holds `len` bytes and lives
                    // in `buffers` until the event completed.
                    LocalCopy::Contiguous { src_offset, len, .. } => unsafe {
                        d.stream.memcpy_dtoh_async(staging.host_ptr(), src.ptr + src_offset, *len as usize)
                    },
                    LocalCopy::Paged { page_len, src_pages, src_stride, src_offset, .. } => {
                        let copy = PagedCopy {
                            dst: staging.device_ptr(),
                            src: src.ptr,
                            dst_idx: 0,
                            src_idx: idx.as_ref().expect("paged").device_ptr(),
                            dst_stride: *page_len,
                            dst_offset: 0,
                            src_stride: *src_stride,
                            src_offset: *src_offset,
                            page_len: *page_len,
                            num_pages: src_pages.len() as u32,
                            blocks,
                            ..Default::default()
                        };
                        let kernels = d.kernels.as_ref().expect("loaded above");
                        // SAFETY: pages checked against the source; staging holds every page.
                        unsafe { kernels.paged_copy(&d.stream, &copy) }
                    }
                };
                if let Err(e) = result {
                    enqueue_error = Some(e.into());
                }
                buffers.push(staging);
                buffers.extend(idx);
                host_write = Some(HostWrite { pid: dst.pid, same_process: dst.same_process, pieces });
            }
        }
        let d = self.device(device)?;
        let event = match d.events.pop() {
            Some(e) => e,
            None => Event::new(&d.ctx, false)?,
        };
        if let Err(e) = event.record(&d.stream) {
            // Nothing to poll: wait here so the buffers are not reused under a running copy.
            let _ = d.stream.synchronize();
            enqueue_error.get_or_insert(e.into());
        }
        d.inflight.push_back(InFlight { request, region, event, buffers, host_write, error: enqueue_error });
        Ok(())
    }

    /// Collects completed copies (finishing host writes); true if any completed.
    pub fn poll(&mut self, done: &mut Vec<LocalDone>) -> bool {
        let mut finished = Vec::new();
        for d in self.devices.values_mut() {
            while let Some(front) = d.inflight.front() {
                let state = front.event.is_complete();
                if let Ok(false) = state {
                    break;
                }
                let f = d.inflight.pop_front().expect("front exists");
                let mut result = match (state, f.error) {
                    (_, Some(e)) => Err(e),
                    (Err(e), None) => Err(FabricError::Cuda(format!("same-host copy failed: {e}"))),
                    (Ok(_), None) => Ok(()),
                };
                if result.is_ok() {
                    if let (Some(w), Some(staging)) = (&f.host_write, f.buffers.first()) {
                        result = write_host(w, staging);
                    }
                }
                d.events.push(f.event);
                done.push((f.request, f.region, result));
                finished.push(f.buffers);
            }
        }
        let any = !finished.is_empty();
        for b in finished {
            self.recycle(b);
        }
        any
    }
}

impl Drop for LocalChannel {
    fn drop(&mut self) {
        // Copies still running read and write memory that is about to be released.
        for d in self.devices.values() {
            if let Err(e) = d.stream.synchronize() {
                tracing::warn!("waiting for same-host copies on device {}: {e}", d.ctx.device().ordinal());
            }
        }
    }
}

/// Copies staged bytes into the destination process (or this one).
fn write_host(w: &HostWrite, staging: &PinnedHostBuffer) -> Result<()> {
    let base = staging.host_ptr();
    if w.same_process {
        for &(off, remote, len) in &w.pieces {
            // SAFETY: `remote..+len` lies in a region registered in this process (checked
            // against its descriptor); staging holds the bytes and the copy has completed.
            unsafe { std::ptr::copy_nonoverlapping(base.add(off), remote as *mut u8, len) };
        }
        return Ok(());
    }
    // SAFETY: staging holds every piece; the remote side is only written by the kernel, which
    // checks the target pages belong to the process (EFAULT otherwise).
    unsafe { process_vm_write(w.pid, base, &w.pieces) }
}

/// Writes `pieces` (local offset, remote address, length) into process `pid`.
///
/// # Safety
/// `base + off .. + len` must be readable for every piece.
pub(crate) unsafe fn process_vm_write(pid: u32, base: *const u8, pieces: &[(usize, u64, usize)]) -> Result<()> {
    const IOV_MAX: usize = 1024;
    for chunk in pieces.chunks(IOV_MAX) {
        let mut local: Vec<libc::iovec> = chunk
            .iter()
            // SAFETY: in bounds of the staging buffer (caller's contract).
            .map(|&(off, _, len)| libc::iovec { iov_base: unsafe { base.add(off) } as *mut libc::c_void, iov_len: len })
            .collect();
        let mut remote: Vec<libc::iovec> = chunk
            .iter()
            .map(|&(_, addr, len)| libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: len })
            .collect();
        let mut total: usize = chunk.iter().map(|p| p.2).sum();
        // process_vm_writev may stop early; resume after the bytes it wrote.
        let (mut li, mut ri) = (0usize, 0usize);
        while total > 0 {
            // SAFETY: the iovec arrays are valid for their lengths; the kernel validates the
            // remote ranges.
            let n = unsafe {
                libc::process_vm_writev(
                    pid as libc::pid_t,
                    local[li..].as_ptr(),
                    (local.len() - li) as libc::c_ulong,
                    remote[ri..].as_ptr(),
                    (remote.len() - ri) as libc::c_ulong,
                    0,
                )
            };
            if n < 0 {
                let err = std::io::Error::last_os_error();
                let hint = match err.raw_os_error() {
                    Some(libc::EPERM) => {
                        " (no ptrace permission over the peer: run both as the same user with \
                         /proc/sys/kernel/yama/ptrace_scope = 0, or grant CAP_SYS_PTRACE)"
                    }
                    Some(libc::ESRCH) => " (the peer process is gone)",
                    Some(libc::EFAULT) => " (the destination is no longer mapped in the peer: region freed?)",
                    _ => "",
                };
                return Err(FabricError::TransferFailed(format!(
                    "writing GPU data into host memory of process {pid} with process_vm_writev: {err}{hint}"
                )));
            }
            if n == 0 {
                return Err(FabricError::TransferFailed(format!(
                    "process_vm_writev into process {pid} made no progress"
                )));
            }
            let n = n as usize;
            total -= n.min(total);
            advance(&mut local, &mut li, n);
            advance(&mut remote, &mut ri, n);
        }
    }
    Ok(())
}

fn advance(iov: &mut [libc::iovec], index: &mut usize, mut n: usize) {
    while n > 0 && *index < iov.len() {
        let v = &mut iov[*index];
        if n >= v.iov_len {
            n -= v.iov_len;
            *index += 1;
        } else {
            v.iov_base = (v.iov_base as usize + n) as *mut libc::c_void;
            v.iov_len -= n;
            n = 0;
        }
    }
    while *index < iov.len() && iov[*index].iov_len == 0 {
        *index += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_vm_write_into_this_process_scatters_pieces() {
        let src: Vec<u8> = (0..=255u8).cycle().take(3 * 1000).collect();
        let mut dst = vec![0u8; 5000];
        let d = dst.as_mut_ptr() as u64;
        let pieces = [(0usize, d + 4000, 1000usize), (1000, d, 1000), (2000, d + 2000, 1000)];
        // SAFETY: every piece is inside `src` and `dst`, both alive.
        unsafe { process_vm_write(std::process::id(), src.as_ptr(), &pieces) }.unwrap();
        assert_eq!(&dst[4000..5000], &src[0..1000]);
        assert_eq!(&dst[0..1000], &src[1000..2000]);
        assert_eq!(&dst[2000..3000], &src[2000..3000]);
        assert!(dst[1000..2000].iter().all(|&b| b == 0));
    }

    #[test]
    fn process_vm_write_to_unmapped_memory_is_an_error() {
        let src = [1u8; 16];
        // SAFETY: the local side is valid; the remote address is unmapped, which the kernel reports.
        let e = unsafe { process_vm_write(std::process::id(), src.as_ptr(), &[(0, 8, 16)]) }.unwrap_err();
        assert!(e.to_string().contains("process_vm_writev"), "{e}");
    }

    #[test]
    fn advance_skips_whole_and_partial_vectors() {
        let mut v = vec![
            libc::iovec { iov_base: 100 as *mut libc::c_void, iov_len: 10 },
            libc::iovec { iov_base: 200 as *mut libc::c_void, iov_len: 10 },
        ];
        let mut i = 0;
        advance(&mut v, &mut i, 13);
        assert_eq!(i, 1);
        assert_eq!(v[1].iov_base as usize, 203);
        assert_eq!(v[1].iov_len, 7);
        advance(&mut v, &mut i, 7);
        assert_eq!(i, 2);
    }
}
