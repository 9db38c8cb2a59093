//! The `AllToAll` Python class (MoE dispatch/combine over NVLink): converts plain ints and bytes
//! and forwards to `p2p_all_to_all::AllToAll`. Tensors, dtypes and shapes are checked in
//! `fabric_lib.all_to_all`, which wraps this class.
use std::time::Duration;

use crate::config::engine_config;
use crate::errors::{to_pyerr, IntoPyResult as IntoPy, PyErrorClass};
use fabric_lib::{EngineConfig, ProviderSpec};
use p2p_all_to_all::{
    A2aError, AllToAll, CombineRecv, CombineSend, Config, CudaError, DispatchDtype, DispatchRecv, DispatchSend,
    RemoteOptions,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

impl PyErrorClass for A2aError {
    fn class_name(&self) -> &'static str {
        match self {
            A2aError::InvalidArgument(_) => "InvalidArgumentError",
            A2aError::Cuda(CudaError::DriverUnavailable(_) | CudaError::KernelsUnavailable) => "CudaUnavailableError",
            A2aError::Cuda(CudaError::InvalidArgument(_)) => "InvalidArgumentError",
            A2aError::Cuda(_) => "FabricError",
            A2aError::NotConnected(_) => "FabricError",
            A2aError::Fabric(e) => e.class_name(),
        }
    }
}

/// Declares a half's arguments, read by attribute name from the frozen dataclass of the same name
/// in `fabric_lib.all_to_all` (one object per half, shared by the separate and the fused calls),
/// and their conversion into the `p2p_all_to_all` struct with the same fields.
macro_rules! half_args {
    ($(#[$doc:meta])* $args:ident => $half:ident { $($field:ident: $ty:ty),* $(,)? }) => {
        $(#[$doc])*
        #[derive(FromPyObject)]
        pub struct $args {
            $($field: $ty),*
        }

        impl From<$args> for $half {
            fn from(args: $args) -> Self {
                $half { $($field: args.$field),* }
            }
        }
    };
}

half_args! {
    /// `fabric_lib.all_to_all.DispatchSendArgs`.
    DispatchSendArgs => DispatchSend {
        x: u64,
        x_stride: u64,
        scales: u64,
        scales_stride: u64,
        indices: u64,
        indices_stride: u64,
        indices_are_i64: bool,
        num_tokens: usize,
        num_tokens_ptr: u64,
        publish_host_counts: bool,
    }
}

half_args! {
    /// `fabric_lib.all_to_all.DispatchRecvArgs`.
    DispatchRecvArgs => DispatchRecv { out_x: u64, out_scales: u64, out_counts: u64 }
}

half_args! {
    /// `fabric_lib.all_to_all.CombineSendArgs`.
    CombineSendArgs => CombineSend { expert_out: u64, expert_out_stride: u64, weights: u64, weights_stride: u64 }
}

half_args! {
    /// `fabric_lib.all_to_all.CombineRecvArgs`.
    CombineRecvArgs => CombineRecv { out: u64, out_stride: u64, num_rows: usize }
}

/// Native all-to-all; use `fabric_lib.all_to_all.AllToAll`, which wraps it.
#[pyclass(name = "AllToAll", module = "fabric_lib._rust")]
pub struct PyAllToAll {
    inner: AllToAll,
}

#[pymethods]
impl PyAllToAll {
    #[new]
    #[pyo3(signature = (device, rank, world_size, max_num_tokens, hidden, num_experts, experts_per_token,
                        max_tokens_per_expert, dispatch_dtype, timeout, nvlink=None, private_tokens=0,
                        provider=None, domains=Vec::new(), proxy_cpu=None, engine_options=None,
                        proxy_thread=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        device: usize,
        rank: usize,
        world_size: usize,
        max_num_tokens: usize,
        hidden: usize,
        num_experts: usize,
        experts_per_token: usize,
        max_tokens_per_expert: usize,
        dispatch_dtype: &str,
        timeout: f64,
        nvlink: Option<usize>,
        private_tokens: usize,
        provider: Option<String>,
        domains: Vec<String>,
        proxy_cpu: Option<usize>,
        engine_options: Option<&Bound<'_, PyDict>>,
        proxy_thread: bool,
    ) -> PyResult<Self> {
        let dispatch_dtype = match dispatch_dtype {
            "bf16" => DispatchDtype::Bf16,
            "fp8_e4m3" => DispatchDtype::Fp8E4m3,
            other => {
                return Err(to_pyerr(
                    py,
                    A2aError::InvalidArgument(format!("dispatch_dtype must be 'bf16' or 'fp8_e4m3', not {other:?}")),
                ))
            }
        };
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(to_pyerr(py, A2aError::InvalidArgument("timeout must be a positive number of seconds".into())));
        }
        let cfg = Config {
            rank,
            world_size,
            max_num_tokens,
            hidden,
            num_experts,
            experts_per_token,
            max_tokens_per_expert,
            dispatch_dtype,
            timeout: Duration::from_secs_f64(timeout),
        };
        let remote = match nvlink {
            Some(nvlink) if nvlink != world_size => {
                let engine =
                    EngineConfig { provider: ProviderSpec { provider, domains }, ..engine_config(py, engine_options)? };
                Some(RemoteOptions { nvlink, private_tokens, engine, proxy_cpu, own_thread: proxy_thread })
            }
            _ => None,
        };
        let inner = py.detach(|| AllToAll::with_remote(device, cfg, remote)).py(py)?;
        Ok(PyAllToAll { inner })
    }

    /// Opaque bytes a peer passes to `connect`.
    fn export_handle<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self.inner.export_handle().py(py)?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Maps every rank's buffers (`handles[r]` from rank r's `export_handle`).
    fn connect(&mut self, py: Python<'_>, handles: Vec<Bound<'_, PyBytes>>) -> PyResult<()> {
        let handles: Vec<Vec<u8>> = handles.iter().map(|h| h.as_bytes().to_vec()).collect();
        let inner = &mut self.inner;
        py.detach(|| inner.connect(&handles)).py(py)
    }

    /// Blocks per launch: (dispatch kernels, combine kernels).
    #[getter]
    fn grid(&self) -> (u32, u32) {
        self.inner.grid()
    }

    #[getter]
    fn shared_bytes(&self) -> usize {
        self.inner.layout().shared_bytes
    }

    fn dispatch_send(&self, py: Python<'_>, stream: u64, send: DispatchSendArgs) -> PyResult<()> {
        // SAFETY: the Python wrapper passes data pointers of live CUDA tensors of this device with
        // checked shapes, and keeps them alive on the stream (torch's stream semantics).
        unsafe { self.inner.dispatch_send(stream, &send.into()) }.py(py)
    }

    fn dispatch_recv(&self, py: Python<'_>, stream: u64, recv: DispatchRecvArgs) -> PyResult<()> {
        // SAFETY: as for dispatch_send.
        unsafe { self.inner.dispatch_recv(stream, &recv.into()) }.py(py)
    }

    fn combine_send(&self, py: Python<'_>, stream: u64, send: CombineSendArgs) -> PyResult<()> {
        // SAFETY: as for dispatch_send.
        unsafe { self.inner.combine_send(stream, &send.into()) }.py(py)
    }

    fn combine_recv(&self, py: Python<'_>, stream: u64, recv: CombineRecvArgs) -> PyResult<()> {
        // SAFETY: as for dispatch_send.
        unsafe { self.inner.combine_recv(stream, &recv.into()) }.py(py)
    }

    /// Both halves of dispatch in one launch.
    fn dispatch(&self, py: Python<'_>, stream: u64, send: DispatchSendArgs, recv: DispatchRecvArgs) -> PyResult<()> {
        // SAFETY: as for dispatch_send.
        unsafe { self.inner.dispatch(stream, &send.into(), &recv.into()) }.py(py)
    }

    /// Both halves of combine in one launch.
    fn combine(&self, py: Python<'_>, stream: u64, send: CombineSendArgs, recv: CombineRecvArgs) -> PyResult<()> {
        // SAFETY: as for dispatch_send.
        unsafe { self.inner.combine(stream, &send.into(), &recv.into()) }.py(py)
    }

    /// Bits of errors the kernels reported (see fabric_lib.all_to_all).
    fn errors(&self) -> u32 {
        self.inner.errors()
    }

    /// What the proxy of the RDMA half reported, if it failed.
    fn proxy_error(&self) -> Option<String> {
        self.inner.proxy_error()
    }

    /// Whether the RDMA half's buffers are GPU memory (FI_HMEM) rather than mapped host memory;
    /// None without remote ranks.
    #[getter]
    fn remote_gpu_buffers(&self) -> Option<bool> {
        self.inner.remote().map(|r| r.gpu_buffers())
    }

    /// The proxy's costs of the calls since the last call (cleared): two lists of dicts.
    fn proxy_samples<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyList>)> {
        let (dispatch, combine) = self.inner.proxy_samples();
        let d = PyList::empty(py);
        for s in dispatch {
            let item = PyDict::new(py);
            item.set_item("counts_signal_to_first_write_ns", s.counts_signal_to_first_write_ns)?;
            item.set_item("counts_post_ns", s.counts_post_ns)?;
            item.set_item("signal_to_first_write_ns", s.signal_to_first_write_ns)?;
            item.set_item("post_per_peer_ns", s.post_per_peer_ns)?;
            item.set_item("data_writes", s.data_writes)?;
            item.set_item("count_writes", s.count_writes)?;
            item.set_item("remote_peers", s.remote_peers)?;
            item.set_item("total_ns", s.total_ns)?;
            d.append(item)?;
        }
        let c = PyList::empty(py);
        for s in combine {
            let item = PyDict::new(py);
            item.set_item("signal_to_first_write_ns", s.signal_to_first_write_ns)?;
            item.set_item("post_per_peer_ns", s.post_per_peer_ns)?;
            item.set_item("writes", s.writes)?;
            item.set_item("remote_peers", s.remote_peers)?;
            c.append(item)?;
        }
        Ok((d, c))
    }

    fn clear_errors(&self) {
        self.inner.clear_errors()
    }

    /// (sequence number, per-expert row counts) of the last dispatch that published them.
    fn host_counts<'py>(&self, py: Python<'py>) -> PyResult<(u64, Bound<'py, PyList>)> {
        let (seq, counts) = self.inner.host_counts();
        Ok((seq, PyList::new(py, counts)?))
    }

    /// The machine-code architectures of the embedded all-to-all kernels ("" if none).
    #[staticmethod]
    fn kernel_archs() -> &'static str {
        p2p_all_to_all::kernel_archs()
    }
}

/// Adds the all-to-all class to the extension module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyAllToAll>()
}
