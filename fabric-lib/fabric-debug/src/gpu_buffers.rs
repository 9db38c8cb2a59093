//! GPU buffers of a run: checking that the listed GPUs exist, allocating and filling each
//! engine's buffer on its GPU (or in host memory), and naming how a buffer and a transfer
//! reach the peer (`dmabuf`, `cuda`, `staged`, `same-host`, `host`) for the report.
use fabric_lib::{MemoryKind, MrDescriptor, MrHandle, TransferEngine};
use serde::Serialize;

use crate::bail;
use crate::error::{Context, Result};
use crate::gpu_list::{GpuList, Placement};

/// Fails with a clear message unless CUDA is usable and every listed GPU exists.
pub fn check_gpus(list: &GpuList) -> Result<()> {
    let count = cuda_lib::device_count().with_context(|| format!("GPU buffers on GPU(s) {list} need CUDA"))?;
    if count == 0 {
        bail!("GPU buffers on GPU(s) {list} need a GPU, and the CUDA driver sees none");
    }
    if let Some(missing) = list.0.iter().find(|&&g| g as usize >= count) {
        bail!("GPU {missing} does not exist: the CUDA driver sees {count} GPU(s), 0..={}", count - 1);
    }
    Ok(())
}

/// A buffer an engine registers: its address, length and memory kind. Leaked on purpose: it
/// must outlive the engine, which callbacks may still reference when the endpoint is dropped.
pub struct Buffer {
    pub ptr: *mut u8,
    pub len: usize,
    pub kind: MemoryKind,
}

/// Allocates a `len`-byte buffer where `placement` says, filled with one byte value (host
/// buffers are touched so no page fault lands inside a measurement).
pub fn allocate(placement: Placement, len: usize) -> Result<Buffer> {
    let len = len.max(1);
    match placement {
        Placement::Host => {
            let buffer: &'static mut [u8] = Box::leak(vec![0x5au8; len].into_boxed_slice());
            Ok(Buffer { ptr: buffer.as_mut_ptr(), len, kind: MemoryKind::Host })
        }
        Placement::Gpu(gpu) => {
            let what = || format!("allocating {len} bytes on GPU {gpu}");
            let ctx = cuda_lib::Context::new(gpu as usize).with_context(what)?;
            let buffer = cuda_lib::DeviceBuffer::new(&ctx, len).with_context(what)?;
            let stream = cuda_lib::Stream::new(&ctx).with_context(what)?;
            // SAFETY: the range is the whole buffer just allocated, which stays allocated (leaked).
            unsafe { stream.memset_d8_async(buffer.ptr(), 0x5a, len) }.with_context(what)?;
            stream.synchronize().with_context(what)?;
            let buffer: &'static cuda_lib::DeviceBuffer = Box::leak(Box::new(buffer));
            Ok(Buffer { ptr: buffer.ptr() as *mut u8, len, kind: MemoryKind::Cuda(gpu) })
        }
    }
}

/// How a local region reaches network peers: `host`, `dmabuf` or `cuda` (GPU memory registered
/// with the NIC), `staged` (GPU memory through host bounce buffers and the landing area), or
/// `same-host` (GPU memory that only CUDA IPC peers reach).
pub fn registration_name(engine: &TransferEngine, handle: MrHandle, descriptor: &MrDescriptor) -> Result<String> {
    let nic = engine.region_nic_registration(handle).context("reading the region's registration")?;
    Ok(match (descriptor.kind, nic) {
        (_, Some(how)) => how.name().to_string(),
        (MemoryKind::Host, None) => "host".into(),
        (MemoryKind::Cuda(_), None) if engine.staging() => "staged".into(),
        (MemoryKind::Cuda(_), None) => "same-host".into(),
    })
}

/// How a peer's region is reached, from its descriptor (the same names).
pub fn peer_registration_name(descriptor: &MrDescriptor) -> &'static str {
    match descriptor.kind {
        MemoryKind::Host => "host",
        MemoryKind::Cuda(_) if descriptor.network_reachable() => "nic",
        MemoryKind::Cuda(_) if descriptor.staged_reachable() => "staged",
        MemoryKind::Cuda(_) => "same-host",
    }
}

/// The memory side of one engine pair in a report.
#[derive(Serialize, Debug, Clone)]
pub struct MemoryReport {
    /// Where the client's send buffer lives: `host` or `cuda:N`.
    pub client_buffer: String,
    /// Where the server's receive buffer lives.
    pub server_buffer: String,
    /// How the client's buffer is registered (see [`registration_name`]).
    pub client_registration: String,
    /// How the server's buffer is reached: `host`, `nic` (registered with the NIC), `staged`
    /// (through the server's landing area) or `same-host`.
    pub server_registration: String,
    /// The path writes take: `network` (the provider, directly), `staged` (the provider,
    /// through host bounce buffers and/or the landing area) or `same-host` (CUDA IPC, or
    /// `process_vm_writev` for host memory with `--same-host-host-memory`).
    pub path: String,
    /// Staged requests the client's engine sent during the run (zero unless the path is staged).
    pub staged_requests: u64,
    /// Bytes it copied from GPU memory into bounce buffers for them.
    pub bounced_bytes: u64,
}

/// The path single writes from `local` (this engine's region) to `peer` take.
pub fn write_path(
    engine: &TransferEngine,
    local: MemoryKind,
    local_registration: &str,
    peer: &MrDescriptor,
) -> &'static str {
    let gpu = local != MemoryKind::Host || peer.kind != MemoryKind::Host;
    let config = engine.config();
    let same_host_path = gpu || config.same_host_host_memory;
    if same_host_path && peer.owner.is_same_host() && !config.force_network {
        return "same-host";
    }
    if local_registration == "staged" || (peer.kind != MemoryKind::Host && !peer.network_reachable()) {
        return "staged";
    }
    "network"
}

/// Whether reads can take `path`: reads are never staged (the engine refuses a network read of
/// GPU memory the NIC cannot reach; the owner writes it instead).
pub fn reads_supported(path: &str) -> bool {
    path != "staged"
}
