//! One rank's RDMA half: its TransferEngine, the proxy block, the remote-traffic buffers
//! (GPU memory registered with the NIC where the engine's provider has FI_HMEM, else mapped
//! pinned host memory that the kernels read and write directly), their registrations, and the
//! proxy (on the engine's worker, or a thread of its own) once every rank's regions are known.
use std::sync::Arc;
use std::time::Duration;

use cuda_lib::{Context, DeviceBuffer, Event, PinnedHostBuffer};
use fabric_lib::{
    CompletionCounter, DomainChoice, EngineConfig, MemoryKind, MrDescriptor, MrHandle, TransferEngine, WriteRequest,
};

use crate::error::{invalid, Result};
use crate::proxy::{
    CombineSample, DispatchSample, LocalRegions, PeerRegions, PlacementFence, Proxy, ProxyConfig, ProxyRunner,
};
use crate::proxy_block::BlockLayout;
use crate::remote::{RemoteLayout, Topology};

/// How a rank reaches the ranks outside its NVLink domain.
#[derive(Debug, Clone)]
pub struct RemoteOptions {
    /// Ranks per NVLink domain (consecutive ranks; divides the world size). The world size:
    /// everything over NVLink (no engine, no proxy). 1: everything through the engine.
    pub nvlink: usize,
    /// Records per (source, destination) pair sent speculatively into the destination's private
    /// area; the rest goes to its overflow area once every rank's counts are known.
    pub private_tokens: usize,
    /// The engine's provider, domains (NICs: `nets_per_gpu` of them), polling and timeouts.
    /// `force_network` is always set: remote ranks are reached as on another host.
    pub engine: EngineConfig,
    /// CPU to pin the proxy's thread to (one near the GPU): the engine's worker, which runs the
    /// proxy (`engine.worker_cpu`, where set, wins), or with `own_thread` the proxy's own.
    pub proxy_cpu: Option<usize>,
    /// The proxy on a thread of its own that hands its writes to the engine's worker
    /// (`ProxyRunner::OwnThread`) instead of on the worker itself: one more spinning thread
    /// per rank, and a hand-off before every post.
    pub own_thread: bool,
}

/// Memory of one remote-traffic buffer.
#[derive(Debug)]
enum Buffer {
    Device(DeviceBuffer),
    Host(PinnedHostBuffer),
}

impl Buffer {
    fn new(ctx: &Arc<Context>, len: usize, gpu: bool) -> Result<Self> {
        Ok(if gpu {
            Buffer::Device(DeviceBuffer::new(ctx, len)?)
        } else {
            Buffer::Host(PinnedHostBuffer::new(ctx, len)?)
        })
    }

    /// The address kernels use.
    fn device_ptr(&self) -> u64 {
        match self {
            Buffer::Device(b) => b.ptr(),
            Buffer::Host(b) => b.device_ptr(),
        }
    }

    fn register(&self, engine: &TransferEngine, device: usize) -> Result<(MrHandle, MrDescriptor)> {
        // SAFETY: the buffer outlives the engine's use of it: `RemotePath` drops the proxy and
        // the engine before its buffers.
        let (h, d) = unsafe {
            match self {
                Buffer::Device(b) => {
                    engine.register_memory(b.ptr() as *mut u8, b.len(), MemoryKind::Cuda(device as u32))
                }
                Buffer::Host(b) => engine.register_memory(b.host_ptr(), b.len(), MemoryKind::Host),
            }
        }?;
        if !d.network_reachable() {
            return Err(invalid!("the engine registered a remote-traffic buffer without network keys"));
        }
        Ok((h, d))
    }
}

/// The placement fence of `shm` with GPU buffers: marks are events recorded on the legacy
/// default stream, where shm queues its device copies (they complete in order).
struct LegacyStreamFence {
    ctx: Arc<Context>,
    state: parking_lot::Mutex<FenceEvents>,
}

#[derive(Default)]
struct FenceEvents {
    /// Recorded and not yet seen complete, oldest first, with their tickets.
    pending: std::collections::VecDeque<(u64, Event)>,
    /// Completed events, recorded again by later marks.
    spare: Vec<Event>,
    next: u64,
    /// Every ticket below this one passed.
    passed_below: u64,
}

impl LegacyStreamFence {
    fn new(ctx: Arc<Context>) -> Self {
        LegacyStreamFence { ctx, state: Default::default() }
    }
}

impl PlacementFence for LegacyStreamFence {
    fn mark(&self) -> std::result::Result<u64, String> {
        let mut st = self.state.lock();
        let event = match st.spare.pop() {
            Some(e) => e,
            None => Event::new(&self.ctx, false).map_err(|e| e.to_string())?,
        };
        event.record_on_legacy_stream().map_err(|e| e.to_string())?;
        let ticket = st.next;
        st.next += 1;
        st.pending.push_back((ticket, event));
        Ok(ticket)
    }

    fn passed(&self, ticket: u64) -> std::result::Result<bool, String> {
        let mut st = self.state.lock();
        while ticket >= st.passed_below {
            let Some((t, event)) = st.pending.front() else { break };
            if !event.is_complete().map_err(|e| e.to_string())? {
                break;
            }
            st.passed_below = t + 1;
            let (_, event) = st.pending.pop_front().expect("front exists");
            st.spare.push(event);
        }
        Ok(ticket < st.passed_below)
    }
}

const REGIONS_MAGIC: &[u8; 4] = b"A2AR";

/// How long a proxy on a thread of its own spins after its last work before it sleeps 20 µs
/// between polls: through the gaps between an inference step's calls.
const OWN_THREAD_IDLE_SPIN: Duration = Duration::from_millis(50);

/// Bytes of each warm-up write (see [`RemotePath::warm_up`]).
const WARM_UP_BYTES: usize = 64;

/// The RDMA half of one rank (see the module documentation).
pub struct RemotePath {
    pub topo: Topology,
    pub layout: RemoteLayout,
    pub block: BlockLayout,
    rank: usize,
    runner: ProxyRunner,
    placement_fence: Option<Arc<dyn PlacementFence>>,
    // Dropped in this order: the proxy (joins its thread), the engine, then the memory.
    proxy: Option<Proxy>,
    engine: Arc<TransferEngine>,
    regions: [(MrHandle, MrDescriptor); 5],
    block_buf: PinnedHostBuffer,
    bufs: [Buffer; 4],
    gpu_buffers: bool,
}

impl std::fmt::Debug for RemotePath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemotePath")
            .field("topo", &self.topo)
            .field("layout", &self.layout)
            .field("gpu_buffers", &self.gpu_buffers)
            .field("proxy", &self.proxy)
            .finish()
    }
}

/// Buffers in `bufs` (and regions 1..5).
const DSEND: usize = 0;
const DRECV: usize = 1;
const CSEND: usize = 2;
const CRECV: usize = 3;

impl RemotePath {
    /// Opens the engine, allocates and registers this rank's buffers. `rec_bytes`: bytes of one
    /// token record (values, scales, padding).
    pub fn new(
        ctx: &Arc<Context>,
        device: usize,
        rank: usize,
        topo: Topology,
        layout: RemoteLayout,
        opts: &RemoteOptions,
    ) -> Result<Self> {
        // The rank's GPU: the provider's CUDA work (shm's device copies) runs there.
        let cuda_device = opts.engine.cuda_device.or(Some(device as u32));
        // Where the worker runs the proxy (`ProxyRunner::EngineWorker`) it is the proxy's thread.
        let (runner, worker_cpu) = if opts.own_thread {
            (ProxyRunner::OwnThread { cpu: opts.proxy_cpu, idle_spin: OWN_THREAD_IDLE_SPIN }, opts.engine.worker_cpu)
        } else {
            (ProxyRunner::EngineWorker, opts.engine.worker_cpu.or(opts.proxy_cpu))
        };
        let engine = Arc::new(TransferEngine::new(EngineConfig {
            force_network: true,
            cuda_device,
            worker_cpu,
            ..opts.engine.clone()
        })?);
        let gpu = engine.gpu_network();
        let block = BlockLayout::new(&layout);
        let block_buf = PinnedHostBuffer::new(ctx, block.bytes)?;
        let bufs = [
            Buffer::new(ctx, layout.dsend_bytes(), gpu)?,
            Buffer::new(ctx, layout.drecv_bytes(), gpu)?,
            Buffer::new(ctx, layout.csend_bytes(), gpu)?,
            Buffer::new(ctx, layout.crecv_bytes(), gpu)?,
        ];
        // SAFETY: as in `Buffer::register`.
        let blk = unsafe { engine.register_memory(block_buf.host_ptr(), block.bytes, MemoryKind::Host) }?;
        let regions = [
            blk,
            bufs[DSEND].register(&engine, device)?,
            bufs[DRECV].register(&engine, device)?,
            bufs[CSEND].register(&engine, device)?,
            bufs[CRECV].register(&engine, device)?,
        ];
        // shm's device copies run on the legacy default stream and may still be queued when
        // their immediate is counted (docs/gpu.md): the proxy raises a flag once an event it
        // recorded there (the kernels, on a non-blocking stream, are not on it) completed.
        let placement_fence = (gpu && engine.provider().starts_with("shm"))
            .then(|| Arc::new(LegacyStreamFence::new(ctx.clone())) as Arc<dyn PlacementFence>);
        Ok(RemotePath {
            topo,
            layout,
            block,
            rank,
            runner,
            placement_fence,
            proxy: None,
            engine,
            regions,
            block_buf,
            bufs,
            gpu_buffers: gpu,
        })
    }

    /// Whether the buffers are GPU memory (FI_HMEM) rather than mapped host memory.
    pub fn gpu_buffers(&self) -> bool {
        self.gpu_buffers
    }

    /// The engine.
    pub fn engine(&self) -> &Arc<TransferEngine> {
        &self.engine
    }

    /// Device addresses of (proxy block, dsend, drecv, csend, crecv).
    pub fn device_ptrs(&self) -> [u64; 5] {
        [
            self.block_buf.device_ptr(),
            self.bufs[DSEND].device_ptr(),
            self.bufs[DRECV].device_ptr(),
            self.bufs[CSEND].device_ptr(),
            self.bufs[CRECV].device_ptr(),
        ]
    }

    /// What peers need: the layout every rank must share (NVLink domain size, private quota),
    /// then the descriptors of the block, drecv and crecv.
    pub fn export(&self) -> Vec<u8> {
        let mut out = REGIONS_MAGIC.to_vec();
        out.extend_from_slice(&(self.topo.nvlink as u64).to_le_bytes());
        out.extend_from_slice(&(self.layout.private_tokens as u64).to_le_bytes());
        for i in [0, 2, 4] {
            let d = self.regions[i].1.to_bytes();
            out.extend_from_slice(&(d.len() as u32).to_le_bytes());
            out.extend_from_slice(&d);
        }
        out
    }

    /// Starts the proxy with every rank's [`RemotePath::export`] (`exports[r]` of rank r).
    pub fn connect(&mut self, exports: &[&[u8]]) -> Result<()> {
        let shape = (self.topo.nvlink as u64, self.layout.private_tokens as u64);
        let peers = exports.iter().enumerate().map(|(r, b)| decode_regions(r, b, shape)).collect::<Result<Vec<_>>>()?;
        self.warm_up(&peers)?;
        let local = LocalRegions {
            block_ptr: self.block_buf.host_ptr(),
            block: self.regions[0].0,
            dsend: self.regions[1].0,
            csend: self.regions[3].0,
        };
        let cfg = ProxyConfig {
            rank: self.rank,
            topo: self.topo,
            layout: self.layout,
            runner: self.runner,
            scatter_data: true,
            placement_fence: self.placement_fence.clone(),
            eager_targets: crate::proxy::EAGER_TARGETS,
        };
        self.proxy = Some(Proxy::start(self.engine.clone(), cfg, local, peers)?);
        Ok(())
    }

    /// Writes a few bytes from each send buffer into the matching receive buffer of every remote
    /// rank (no immediate) and waits for them. A provider sets a path up at its first use: `shm`
    /// maps the peer's segment and registers it with CUDA, and opens the peer buffer's CUDA IPC
    /// handle, calls that need the CUDA driver's exclusive lock. During a call that lock can be
    /// held by the application's thread blocked in a copy behind the call's kernels (a pageable
    /// `tensor.cpu()`), which wait for these very writes: so every path is set up here, before
    /// any call. The receive buffers hold nothing yet; every call overwrites what it reads. The
    /// caller must not start a call before every rank returned from here (a barrier): a peer's
    /// writes are complete once this rank's engine has set them up.
    fn warm_up(&self, peers: &[PeerRegions]) -> Result<()> {
        let counter = CompletionCounter::new();
        let mut posted = 0u64;
        for (r, peer) in peers.iter().enumerate() {
            if !self.topo.is_remote(self.rank, r) {
                continue;
            }
            for (src, dst) in [(DSEND, &peer.drecv), (CSEND, &peer.crecv)] {
                let (handle, own) = &self.regions[src + 1];
                let len = WARM_UP_BYTES.min(own.len as usize).min(dst.len as usize);
                let req = WriteRequest {
                    src: *handle,
                    src_offset: 0,
                    len: len as u64,
                    dst,
                    dst_offset: 0,
                    imm: None,
                    domains: DomainChoice::Shard(self.engine.num_domains()),
                };
                self.engine.submit_write_counted(&req, &counter)?;
                posted += 1;
            }
        }
        let timeout = self.engine.config().transfer_timeout;
        counter.wait_for(posted, timeout)?;
        counter.first_error().map_or(Ok(()), |e| Err(e.into()))
    }

    /// The proxy's first failure, or the block's error word raised.
    pub fn error(&self) -> Option<String> {
        self.proxy.as_ref().and_then(|p| p.error())
    }

    /// The proxy's recorded costs of recent calls (cleared).
    pub fn take_samples(&self) -> (Vec<DispatchSample>, Vec<CombineSample>) {
        self.proxy.as_ref().map(|p| p.take_samples()).unwrap_or_default()
    }
}

/// Decodes rank `r`'s [`RemotePath::export`]; its (nvlink, private_tokens) must be `shape`.
fn decode_regions(r: usize, bytes: &[u8], shape: (u64, u64)) -> Result<PeerRegions> {
    let bad = || {
        invalid!(
            "rank {r}'s remote regions are malformed ({} bytes): every rank must create the all-to-all \
             with remote ranks",
            bytes.len()
        )
    };
    if bytes.len() < 20 || &bytes[..4] != REGIONS_MAGIC {
        return Err(bad());
    }
    let word = |i: usize| u64::from_le_bytes(bytes[4 + 8 * i..12 + 8 * i].try_into().expect("8 bytes"));
    if (word(0), word(1)) != shape {
        return Err(invalid!(
            "rank {r} uses nvlink={} and private_tokens={}, this rank {} and {}: every rank must use the same",
            word(0),
            word(1),
            shape.0,
            shape.1
        ));
    }
    let mut at = 20;
    let mut next = || -> Result<MrDescriptor> {
        let len = u32::from_le_bytes(bytes.get(at..at + 4).ok_or_else(bad)?.try_into().map_err(|_| bad())?) as usize;
        let d = MrDescriptor::from_bytes(bytes.get(at + 4..at + 4 + len).ok_or_else(bad)?)?;
        at += 4 + len;
        Ok(d)
    };
    Ok(PeerRegions { block: next()?, drecv: next()?, crecv: next()? })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(nvlink: u64, q: u64) -> Vec<u8> {
        let mut b = REGIONS_MAGIC.to_vec();
        b.extend_from_slice(&nvlink.to_le_bytes());
        b.extend_from_slice(&q.to_le_bytes());
        b
    }

    #[test]
    fn peers_with_another_layout_or_garbage_are_refused() {
        let e = decode_regions(1, b"", (2, 8)).unwrap_err().to_string();
        assert!(e.contains("every rank must create"), "{e}");
        let e = decode_regions(1, &header(4, 8), (2, 8)).unwrap_err().to_string();
        assert!(e.contains("nvlink=4") && e.contains("every rank must use the same"), "{e}");
        let e = decode_regions(1, &header(2, 9), (2, 8)).unwrap_err().to_string();
        assert!(e.contains("private_tokens=9"), "{e}");
        // The right shape but no descriptors behind it.
        let mut truncated = header(2, 8);
        truncated.extend_from_slice(&100u32.to_le_bytes());
        assert!(decode_regions(1, &truncated, (2, 8)).is_err());
    }
}
