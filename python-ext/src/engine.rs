//! The `TransferEngine` Python class: converts arguments, releases the GIL around anything that
//! blocks, and forwards to `fabric_lib::TransferEngine`.

use fabric_lib::{
    DomainChoice, EngineConfig, FabricError, MemoryKind, MrHandle, OnDone, PagedReadRequest, PagedWriteRequest,
    PeerGroup, ProviderSpec, ReadRequest, RegisterOptions, ScatterSharding, ScatterTarget, TransferEngine, Trigger,
    WatcherRunsOn, WriteRequest,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::callbacks;
use crate::completion::{self, PyCompletion};
use crate::config::{engine_config, invalid, seconds};
use crate::errors::IntoPyResult;
use crate::gpu::{PyGpuFlag, PyUvmWatcher};
use crate::values::{PyEngineAddress, PyMrDescriptor};

/// Page indices from little-endian `u32` bytes (what the Python wrapper passes) or a sequence
/// of ints.
fn page_indices(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if let Ok(bytes) = obj.cast::<pyo3::types::PyBytes>() {
        let b = bytes.as_bytes();
        if b.len() % 4 != 0 {
            return Err(invalid(obj.py(), "page index bytes must be a multiple of 4 long (little-endian u32)".into()));
        }
        return Ok(b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect());
    }
    obj.extract::<Vec<u32>>()
}

/// A trigger from Python: (immediate, count, timeout in seconds or None).
fn trigger(py: Python<'_>, (imm, count, timeout): (u32, u64, Option<f64>)) -> PyResult<Trigger> {
    let timeout = timeout.map(|t| seconds(py, t, "after_timeout")).transpose()?;
    Ok(Trigger { imm, count, timeout })
}

/// The domains of a transfer from Python: `domain` pins one, None shards over up to
/// `shard_domains`.
fn domain_choice(domain: Option<usize>, shard_domains: usize) -> DomainChoice {
    domain.map_or(DomainChoice::Shard(shard_domains), DomainChoice::Pinned)
}

/// Native engine; use `fabric_lib.TransferEngine`, which wraps it.
#[pyclass(name = "TransferEngine", module = "fabric_lib._rust", frozen)]
pub struct PyTransferEngine {
    engine: TransferEngine,
    /// How long waits on this engine's completions poll before they sleep.
    wait_spin: std::time::Duration,
}

impl PyTransferEngine {
    /// Posts a request through `post` with the GIL released. It completes to `callback` when one
    /// is given, else to the returned `Completion`.
    fn post(
        &self,
        py: Python<'_>,
        callback: Option<Py<PyAny>>,
        post: impl Send + FnOnce(&TransferEngine, OnDone) -> Result<(), FabricError>,
    ) -> PyResult<Option<PyCompletion>> {
        let (completion, on_done) = completion::request_callback(callback, self.wait_spin);
        py.detach(|| post(&self.engine, on_done)).py(py)?;
        Ok(completion)
    }
}

#[pymethods]
impl PyTransferEngine {
    /// `options`: engine settings by name (see `engine_defaults()`); None keeps a default.
    #[new]
    #[pyo3(signature = (provider=None, domains=Vec::new(), **options))]
    fn new(
        py: Python<'_>,
        provider: Option<String>,
        domains: Vec<String>,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let config = EngineConfig { provider: ProviderSpec { provider, domains }, ..engine_config(py, options)? };
        let engine = py.detach(|| TransferEngine::new(config)).py(py)?;
        let wait_spin = engine.config().wait_spin();
        Ok(PyTransferEngine { engine, wait_spin })
    }

    fn main_address(&self) -> PyEngineAddress {
        PyEngineAddress(self.engine.main_address().clone())
    }

    #[getter]
    fn provider(&self) -> String {
        self.engine.provider().to_string()
    }

    #[getter]
    fn domain_names(&self) -> Vec<String> {
        self.engine.domain_names().to_vec()
    }

    #[getter]
    fn max_message_size(&self) -> usize {
        self.engine.config().max_message_size
    }

    /// Registers memory at `ptr`; the caller keeps it alive until unregistered. `device`: None
    /// detects host or CUDA memory (without loading CUDA when it is not loaded), -1 forces
    /// host memory, N >= 0 CUDA memory of device N. `remote_read`: peers may read the region.
    #[pyo3(signature = (ptr, length, device=None, remote_read=false))]
    fn register_memory(
        &self,
        py: Python<'_>,
        ptr: usize,
        length: usize,
        device: Option<i64>,
        remote_read: bool,
    ) -> PyResult<(u64, PyMrDescriptor)> {
        let kind = match device {
            None => fabric_lib::gpu::detect_memory_kind(ptr as u64),
            Some(d) if d < 0 => MemoryKind::Host,
            Some(d) => MemoryKind::Cuda(u32::try_from(d).map_err(|_| invalid(py, format!("device {d} out of range")))?),
        };
        let options = RegisterOptions { remote_read };
        // SAFETY: the Python wrapper keeps the owning object (tensor/buffer) alive while the
        // registration exists; raw-pointer callers accept that contract in the docs.
        let (handle, desc) =
            py.detach(|| unsafe { self.engine.register_memory_with(ptr as *mut u8, length, kind, options) }).py(py)?;
        Ok((handle.0, PyMrDescriptor(desc)))
    }

    /// How a registration reached the NIC: "host" (host memory), "dmabuf" or "cuda" (GPU memory
    /// through DMA-BUF or the CUDA interface), or "same-host" (GPU memory the NIC cannot reach).
    fn region_registration(&self, py: Python<'_>, handle: u64) -> PyResult<&'static str> {
        let handle = fabric_lib::MrHandle(handle);
        let kind = self.engine.region_kind(handle).py(py)?;
        Ok(match (kind, self.engine.region_nic_registration(handle).py(py)?) {
            (_, Some(how)) => how.name(),
            (MemoryKind::Host, None) => "host",
            (MemoryKind::Cuda(_), None) => "same-host",
        })
    }

    /// A UVM watcher on `device`: `callback(old, new)` runs per change on the callback thread,
    /// or with `inline` on the watcher thread itself.
    #[pyo3(signature = (callback, device=0, inline=false))]
    fn alloc_uvm_watcher(
        &self,
        py: Python<'_>,
        callback: Py<PyAny>,
        device: usize,
        inline: bool,
    ) -> PyResult<PyUvmWatcher> {
        let cb = callbacks::on_watch(callback);
        let runs_on = if inline { WatcherRunsOn::WatcherThread } else { WatcherRunsOn::CallbackThread };
        py.detach(|| self.engine.alloc_uvm_watcher_on(device, cb, runs_on)).py(py).map(PyUvmWatcher)
    }

    /// A GPU flag (mapped pinned host memory) for `device`.
    #[pyo3(signature = (device=0))]
    fn alloc_gpu_flag(&self, py: Python<'_>, device: usize) -> PyResult<PyGpuFlag> {
        py.detach(|| self.engine.alloc_gpu_flag(device)).py(py).map(PyGpuFlag)
    }

    /// Sets `flag` to `value` once `imm` arrived `count` times, then calls `callback` if given.
    #[pyo3(signature = (imm, count, flag, value, callback=None))]
    fn set_imm_count_expected_flag(
        &self,
        py: Python<'_>,
        imm: u32,
        count: u64,
        flag: PyRef<'_, PyGpuFlag>,
        value: u64,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<()> {
        let flag = flag.0.clone();
        self.engine.set_imm_count_expected_flag(imm, count, flag, value, callback.map(callbacks::on_reached)).py(py)
    }

    fn unregister_memory(&self, py: Python<'_>, handle: u64) -> PyResult<()> {
        py.detach(|| self.engine.unregister_memory(MrHandle(handle))).py(py)
    }

    /// `domain`: None shards over up to `shard_domains` domains; an int pins one domain.
    #[pyo3(signature = (src, src_offset, length, dst, dst_offset, imm, callback, domain=None, shard_domains=usize::MAX))]
    #[allow(clippy::too_many_arguments)]
    fn submit_write(
        &self,
        py: Python<'_>,
        src: u64,
        src_offset: u64,
        length: u64,
        dst: PyRef<'_, PyMrDescriptor>,
        dst_offset: u64,
        imm: Option<u32>,
        callback: Option<Py<PyAny>>,
        domain: Option<usize>,
        shard_domains: usize,
    ) -> PyResult<Option<PyCompletion>> {
        let dst = &dst.0;
        let domains = domain_choice(domain, shard_domains);
        let req = WriteRequest { src: MrHandle(src), src_offset, len: length, dst, dst_offset, imm, domains };
        self.post(py, callback, |engine, on_done| engine.submit_write(&req, on_done))
    }

    /// `submit_write` posted by the worker once `after` = (imm, count, timeout) is reached.
    #[pyo3(signature = (after, src, src_offset, length, dst, dst_offset, imm, callback, domain=None, shard_domains=usize::MAX))]
    #[allow(clippy::too_many_arguments)]
    fn arm_write(
        &self,
        py: Python<'_>,
        after: (u32, u64, Option<f64>),
        src: u64,
        src_offset: u64,
        length: u64,
        dst: PyRef<'_, PyMrDescriptor>,
        dst_offset: u64,
        imm: Option<u32>,
        callback: Option<Py<PyAny>>,
        domain: Option<usize>,
        shard_domains: usize,
    ) -> PyResult<Option<PyCompletion>> {
        let when = trigger(py, after)?;
        let dst = &dst.0;
        let domains = domain_choice(domain, shard_domains);
        let req = WriteRequest { src: MrHandle(src), src_offset, len: length, dst, dst_offset, imm, domains };
        self.post(py, callback, |engine, on_done| engine.arm_write(when, &req, on_done))
    }

    /// `submit_imm` posted by the worker once `after` is reached.
    fn arm_imm(
        &self,
        py: Python<'_>,
        after: (u32, u64, Option<f64>),
        imm: u32,
        dst: PyRef<'_, PyMrDescriptor>,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Option<PyCompletion>> {
        let when = trigger(py, after)?;
        let dst = &dst.0;
        self.post(py, callback, |engine, on_done| engine.arm_imm(when, imm, dst, on_done))
    }

    /// `submit_imm_to` posted by the worker once `after` is reached.
    fn arm_imm_to(
        &self,
        py: Python<'_>,
        after: (u32, u64, Option<f64>),
        imm: u32,
        peer: PyRef<'_, PyEngineAddress>,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Option<PyCompletion>> {
        let when = trigger(py, after)?;
        let peer = &peer.0;
        self.post(py, callback, |engine, on_done| engine.arm_imm_to(when, imm, peer, on_done))
    }

    /// `submit_send` posted by the worker once `after` is reached.
    fn arm_send(
        &self,
        py: Python<'_>,
        after: (u32, u64, Option<f64>),
        peer: PyRef<'_, PyEngineAddress>,
        data: Vec<u8>,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Option<PyCompletion>> {
        let when = trigger(py, after)?;
        let peer = &peer.0;
        self.post(py, callback, |engine, on_done| engine.arm_send(when, peer, data, on_done))
    }

    fn submit_imm(
        &self,
        py: Python<'_>,
        imm: u32,
        dst: PyRef<'_, PyMrDescriptor>,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Option<PyCompletion>> {
        let dst = &dst.0;
        self.post(py, callback, |engine, on_done| engine.submit_imm(imm, dst, on_done))
    }

    #[allow(clippy::too_many_arguments)]
    fn submit_paged_writes(
        &self,
        py: Python<'_>,
        page_len: u64,
        src: u64,
        src_pages: &Bound<'_, PyAny>,
        src_stride: u64,
        src_offset: u64,
        dst: PyRef<'_, PyMrDescriptor>,
        dst_pages: &Bound<'_, PyAny>,
        dst_stride: u64,
        dst_offset: u64,
        imm: Option<u32>,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Option<PyCompletion>> {
        let dst = &dst.0;
        let (src_pages, dst_pages) = (page_indices(src_pages)?, page_indices(dst_pages)?);
        let req = PagedWriteRequest {
            page_len,
            src: MrHandle(src),
            src_pages: &src_pages,
            src_stride,
            src_offset,
            dst,
            dst_pages: &dst_pages,
            dst_stride,
            dst_offset,
            imm,
        };
        self.post(py, callback, |engine, on_done| engine.submit_paged_writes(&req, on_done))
    }

    /// `domain`: None shards over up to `shard_domains` domains; an int pins one domain.
    #[pyo3(signature = (src, src_offset, length, dst, dst_offset, callback, domain=None, shard_domains=usize::MAX))]
    #[allow(clippy::too_many_arguments)]
    fn submit_read(
        &self,
        py: Python<'_>,
        src: PyRef<'_, PyMrDescriptor>,
        src_offset: u64,
        length: u64,
        dst: u64,
        dst_offset: u64,
        callback: Option<Py<PyAny>>,
        domain: Option<usize>,
        shard_domains: usize,
    ) -> PyResult<Option<PyCompletion>> {
        let src = &src.0;
        let domains = domain_choice(domain, shard_domains);
        let req = ReadRequest { src, src_offset, len: length, dst: MrHandle(dst), dst_offset, domains };
        self.post(py, callback, |engine, on_done| engine.submit_read(&req, on_done))
    }

    #[allow(clippy::too_many_arguments)]
    fn submit_paged_reads(
        &self,
        py: Python<'_>,
        page_len: u64,
        src: PyRef<'_, PyMrDescriptor>,
        src_pages: &Bound<'_, PyAny>,
        src_stride: u64,
        src_offset: u64,
        dst: u64,
        dst_pages: &Bound<'_, PyAny>,
        dst_stride: u64,
        dst_offset: u64,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Option<PyCompletion>> {
        let src = &src.0;
        let (src_pages, dst_pages) = (page_indices(src_pages)?, page_indices(dst_pages)?);
        let req = PagedReadRequest {
            page_len,
            src,
            src_pages: &src_pages,
            src_stride,
            src_offset,
            dst: MrHandle(dst),
            dst_pages: &dst_pages,
            dst_stride,
            dst_offset,
        };
        self.post(py, callback, |engine, on_done| engine.submit_paged_reads(&req, on_done))
    }

    fn submit_imm_to(
        &self,
        py: Python<'_>,
        imm: u32,
        peer: PyRef<'_, PyEngineAddress>,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Option<PyCompletion>> {
        let peer = &peer.0;
        self.post(py, callback, |engine, on_done| engine.submit_imm_to(imm, peer, on_done))
    }

    fn add_peer_group(&self, py: Python<'_>, peers: Vec<PyRef<'_, PyEngineAddress>>) -> PyResult<u64> {
        let peers: Vec<_> = peers.iter().map(|p| p.0.clone()).collect();
        self.engine.add_peer_group(&peers).py(py).map(|g| g.0)
    }

    /// `targets`: (length, src_offset, dst descriptor, dst_offset) tuples.
    #[allow(clippy::too_many_arguments)]
    fn submit_scatter(
        &self,
        py: Python<'_>,
        group: Option<u64>,
        src: u64,
        targets: Vec<(u64, u64, PyRef<'_, PyMrDescriptor>, u64)>,
        imm: Option<u32>,
        by_bytes: bool,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Option<PyCompletion>> {
        let targets: Vec<ScatterTarget<'_>> = targets
            .iter()
            .map(|(len, src_offset, dst, dst_offset)| ScatterTarget {
                len: *len,
                src_offset: *src_offset,
                dst: &dst.0,
                dst_offset: *dst_offset,
            })
            .collect();
        let sharding = if by_bytes { ScatterSharding::ByBytes } else { ScatterSharding::ByPeer };
        let group = group.map(PeerGroup);
        self.post(py, callback, |engine, on_done| {
            engine.submit_scatter(group, MrHandle(src), &targets, imm, sharding, on_done)
        })
    }

    fn submit_barrier(
        &self,
        py: Python<'_>,
        imm: u32,
        group: u64,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Option<PyCompletion>> {
        self.post(py, callback, |engine, on_done| engine.submit_barrier(imm, PeerGroup(group), on_done))
    }

    fn submit_send(
        &self,
        py: Python<'_>,
        peer: PyRef<'_, PyEngineAddress>,
        data: Vec<u8>,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Option<PyCompletion>> {
        let peer = &peer.0;
        self.post(py, callback, |engine, on_done| engine.submit_send(peer, data, on_done))
    }

    #[pyo3(signature = (callback=None))]
    fn set_recv_callback(&self, py: Python<'_>, callback: Option<Py<PyAny>>) -> PyResult<()> {
        let cb = callback.map(callbacks::on_recv);
        py.detach(|| self.engine.set_recv_callback(cb)).py(py)
    }

    fn set_imm_count_expected(&self, py: Python<'_>, imm: u32, count: u64, callback: Py<PyAny>) -> PyResult<()> {
        self.engine.set_imm_count_expected(imm, count, callbacks::on_reached(callback)).py(py)
    }

    /// Like `set_imm_count_expected`, reporting to a `Completion` (no Python on the callback
    /// thread unless a callable is registered on it).
    fn expect_imm_count(&self, py: Python<'_>, imm: u32, count: u64) -> PyResult<PyCompletion> {
        let (completion, on_reached) = PyCompletion::for_expectation(self.wait_spin);
        self.engine.set_imm_count_expected(imm, count, on_reached).py(py)?;
        Ok(completion)
    }

    fn remove_imm_count(&self, imm: u32) -> u64 {
        self.engine.remove_imm_count(imm)
    }

    fn imm_count(&self, imm: u32) -> u64 {
        self.engine.imm_count(imm)
    }

    fn wait_imm_count(&self, py: Python<'_>, imm: u32, count: u64, timeout: f64) -> PyResult<()> {
        let timeout = seconds(py, timeout, "timeout")?;
        py.detach(|| self.engine.wait_imm_count(imm, count, timeout)).py(py)
    }

    /// Lifts the fence a timed-out request put on `peer` (a handshake where the provider
    /// carries epochs); returns (whether it was fenced, what the peer counted from this engine
    /// in the epoch that ended, per immediate, or None where unknown).
    fn readmit_peer(
        &self,
        py: Python<'_>,
        peer: PyRef<'_, PyEngineAddress>,
    ) -> PyResult<(bool, Option<std::collections::HashMap<u32, u64>>)> {
        let peer = peer.0.clone();
        let r = py.detach(|| self.engine.readmit_peer(&peer)).py(py)?;
        Ok((r.fenced, r.counted))
    }

    /// Immediates refused for belonging to a writer's epoch that ended (late deliveries).
    #[getter]
    fn stale_immediates(&self) -> u64 {
        self.engine.stale_immediates()
    }

    /// Operations and bytes posted on each domain since the engine started: [(ops, bytes)].
    fn domain_stats(&self) -> Vec<(u64, u64)> {
        self.engine.domain_stats().iter().map(|s| (s.ops, s.bytes)).collect()
    }

    /// Malformed entries of the same-host inbox refused (never counted).
    #[getter]
    fn refused_immediates(&self) -> u64 {
        self.engine.refused_immediates()
    }

    /// Consumes `count` arrivals of `imm` if all are there (atomic check-and-take).
    fn try_take_imm_count(&self, imm: u32, count: u64) -> bool {
        self.engine.try_take_imm_count(imm, count)
    }

    /// Whether GPU regions are registered with the NIC (FI_HMEM provider, gpu_network on).
    #[getter]
    fn gpu_network(&self) -> bool {
        self.engine.gpu_network()
    }

    /// Whether GPU memory the NIC cannot reach travels staged through host memory.
    #[getter]
    fn staging(&self) -> bool {
        self.engine.staging()
    }

    /// Staged traffic: (requests sent, bytes bounced, requests landed, bytes landed).
    #[getter]
    fn staging_stats(&self) -> (u64, u64, u64, u64) {
        let s = self.engine.staging_stats();
        (s.requests_sent, s.bounced_bytes, s.requests_landed, s.landed_bytes)
    }

    /// Messages refused for exceeding this engine's max_message_size.
    #[getter]
    fn refused_messages(&self) -> u64 {
        self.engine.refused_messages()
    }

    fn claim_imm(&self, imm: u32) {
        self.engine.claim_imm(imm)
    }

    fn unclaim_imm(&self, imm: u32) {
        self.engine.unclaim_imm(imm)
    }

    #[pyo3(signature = (callback=None))]
    fn set_imm_callback(&self, callback: Option<Py<PyAny>>) {
        self.engine.set_imm_callback(callback.map(callbacks::on_imm))
    }

    /// Turns the latency probe on (clearing its marks) or off.
    fn enable_latency_probe(&self, on: bool) {
        self.engine.latency_probe().enable(on)
    }

    /// The probe's latest time of each stage it recorded: {stage name: CLOCK_MONOTONIC ns}.
    fn latency_marks(&self) -> std::collections::HashMap<&'static str, u64> {
        let probe = self.engine.latency_probe();
        probe.snapshot().into_iter().filter_map(|(stage, t)| t.map(|t| (stage.name(), t))).collect()
    }

    fn stop(&self, py: Python<'_>) {
        py.detach(|| self.engine.stop())
    }

    #[getter]
    fn stopped(&self) -> bool {
        self.engine.is_stopped()
    }
}
