//! The worker-owned CUDA state of the same-host path: streams, events, IPC mappings, pinned
//! staging memory; `submit` enqueues a copy, `poll` reports finished ones in submission order.
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use cuda_lib::{Context, Event, IpcMapping, IpcMemHandle, Kernels, PinnedHostBuffer, Stream};

use super::process_vm::process_vm_write;
use super::{SameHostCopy, SameHostDone, SameHostDst, SameHostSrc};
use crate::descriptor::MemoryKind;
use crate::error::{FabricError, Result};

pub(super) struct DeviceState {
    pub ctx: Arc<Context>,
    pub stream: Stream,
    pub kernels: Option<Kernels>,
    events: Vec<Event>,
    inflight: VecDeque<InFlight>,
}

/// Bytes to write into a host destination once the staging copy completed.
pub(super) struct HostWrite {
    pub pid: u32,
    pub same_process: bool,
    /// (offset in the staging buffer, remote address, length)
    pub pieces: Vec<(usize, u64, usize)>,
}

/// What was enqueued for one request, before its event is recorded.
pub(super) struct InFlightCopy {
    pub request: u64,
    pub region: u64,
    /// Kept alive until the copy completed; `buffers[0]` is the staging of a `host_write`.
    pub buffers: Vec<PinnedHostBuffer>,
    pub host_write: Option<HostWrite>,
    /// An error after work was enqueued (reported once the stream passed it).
    pub error: Option<FabricError>,
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
pub(crate) struct SameHostChannel {
    devices: HashMap<usize, DeviceState>,
    mappings: HashMap<(u64, [u8; 64], usize), IpcMapping>,
    peer_access: HashSet<(usize, usize)>,
    pool: Vec<PinnedHostBuffer>,
    device_count: usize,
    pub(super) blocks: u32,
}

const POOL_LIMIT: usize = 32;
const MIN_PINNED: usize = 64 * 1024;

impl SameHostChannel {
    pub fn new(blocks: u32) -> Result<Self> {
        let device_count = cuda_lib::device_count()?;
        if device_count == 0 {
            return Err(FabricError::CudaUnavailable("no CUDA device is visible to this process".into()));
        }
        Ok(SameHostChannel {
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

    pub(super) fn device(&mut self, ordinal: usize) -> Result<&mut DeviceState> {
        match self.devices.entry(ordinal) {
            std::collections::hash_map::Entry::Occupied(e) => Ok(e.into_mut()),
            std::collections::hash_map::Entry::Vacant(v) => {
                let ctx = Context::new(ordinal)?;
                let stream = Stream::new(&ctx)?;
                Ok(v.insert(DeviceState { ctx, stream, kernels: None, events: Vec::new(), inflight: VecDeque::new() }))
            }
        }
    }

    pub(super) fn kernels(&mut self, ordinal: usize) -> Result<()> {
        let dev = self.device(ordinal)?;
        if dev.kernels.is_none() {
            dev.kernels = Some(Kernels::load(&dev.ctx)?);
        }
        Ok(())
    }

    pub(super) fn pinned(&mut self, ordinal: usize, len: usize) -> Result<PinnedHostBuffer> {
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
    fn copy_device(&self, src: &SameHostSrc, dst: &SameHostDst) -> usize {
        match (src.kind, dst.kind) {
            (MemoryKind::Cuda(d), _) => d as usize,
            (MemoryKind::Host, MemoryKind::Cuda(d)) if (d as usize) < self.device_count => d as usize,
            _ => 0,
        }
    }

    /// The address of the destination region's byte 0 as seen from `device` in this process
    /// (for reads: of the peer's GPU region, the source).
    pub(super) fn dst_base(&mut self, device: usize, dst: &SameHostDst) -> Result<u64> {
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

    /// Enqueues one same-host write; its completion is reported by [`SameHostChannel::poll`].
    pub fn submit(
        &mut self,
        request: u64,
        region: u64,
        src: SameHostSrc,
        dst: SameHostDst,
        copy: SameHostCopy,
    ) -> Result<()> {
        let device = self.copy_device(&src, &dst);
        let mut buffers = Vec::new();
        let mut host_write = None;
        // Everything fallible that enqueues nothing fails here with `?`; once work is enqueued
        // an error travels with the in-flight entry (reported after the stream passed it).
        let enqueue_error = match (src.kind, dst.kind) {
            (MemoryKind::Host, MemoryKind::Host) => {
                return Err(FabricError::InvalidArgument("host-to-host writes take the network path".into()))
            }
            (_, MemoryKind::Cuda(_)) => {
                let dst_base = self.dst_base(device, &dst)?;
                self.enqueue_to_gpu(device, &src, dst_base, &copy, &mut buffers)?
            }
            (MemoryKind::Cuda(_), MemoryKind::Host) => {
                let (error, write) = self.enqueue_to_host(device, &src, &dst, &copy, &mut buffers)?;
                host_write = Some(write);
                error
            }
        };
        self.track_copy(device, InFlightCopy { request, region, buffers, host_write, error: enqueue_error })
    }

    /// Ends what was enqueued on `device` with an event that [`SameHostChannel::poll`] watches.
    pub(super) fn track_copy(&mut self, device: usize, copy: InFlightCopy) -> Result<()> {
        let InFlightCopy { request, region, buffers, host_write, mut error } = copy;
        let d = self.device(device)?;
        let event = match d.events.pop() {
            Some(e) => e,
            None => Event::new(&d.ctx, false)?,
        };
        if let Err(e) = event.record(&d.stream) {
            // Nothing to poll: wait here so the buffers are not reused under a running copy.
            let _ = d.stream.synchronize();
            error.get_or_insert(e.into());
        }
        d.inflight.push_back(InFlight { request, region, event, buffers, host_write, error });
        Ok(())
    }

    /// Collects completed copies (finishing host writes); true if any completed.
    pub fn poll(&mut self, done: &mut Vec<SameHostDone>) -> bool {
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

impl Drop for SameHostChannel {
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
