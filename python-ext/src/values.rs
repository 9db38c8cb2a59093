//! Python wrappers of the engine's value types: addresses and memory descriptors.
use fabric_lib::{EngineAddress, MemoryKind, MrDescriptor};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyType};

use crate::errors::IntoPyResult;

/// The address of a TransferEngine: what peers need to reach it.
#[pyclass(name = "EngineAddress", module = "fabric_lib._rust", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PyEngineAddress(pub EngineAddress);

#[pymethods]
impl PyEngineAddress {
    /// Decodes bytes from `to_bytes()`; raises InvalidDescriptorError on garbage.
    #[classmethod]
    fn from_bytes(_cls: &Bound<'_, PyType>, py: Python<'_>, data: &[u8]) -> PyResult<Self> {
        EngineAddress::from_bytes(data).py(py).map(Self)
    }

    /// Parses `to_hex()` output.
    #[classmethod]
    fn from_hex(_cls: &Bound<'_, PyType>, py: Python<'_>, text: &str) -> PyResult<Self> {
        EngineAddress::from_hex(text).py(py).map(Self)
    }

    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.0.to_bytes())
    }

    fn to_hex(&self) -> String {
        self.0.to_hex()
    }

    /// Provider name, e.g. "tcp;ofi_rxm".
    #[getter]
    fn provider(&self) -> String {
        self.0.provider.clone()
    }

    /// Number of domains (NICs) of the engine's device.
    #[getter]
    fn num_domains(&self) -> usize {
        self.0.domains.len()
    }

    /// The engine's same-host immediate inbox as (pid, fd, nonce, slots), or None.
    #[getter]
    fn same_host_inbox(&self) -> Option<(u32, u32, u64, u32)> {
        self.0.inbox.map(|i| (self.0.pid, i.fd, i.nonce, i.slots))
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyBytes>,))> {
        let py = slf.py();
        Ok((slf.getattr("from_bytes")?, (slf.get().to_bytes(py),)))
    }

    fn __repr__(&self) -> String {
        format!("EngineAddress(provider={:?}, domains={})", self.0.provider, self.0.domains.len())
    }
}

/// A registered memory region as peers see it; pass it (or its bytes) to writers.
#[pyclass(name = "MrDescriptor", module = "fabric_lib._rust", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PyMrDescriptor(pub MrDescriptor);

#[pymethods]
impl PyMrDescriptor {
    /// Decodes bytes from `to_bytes()`; raises InvalidDescriptorError on garbage.
    #[classmethod]
    fn from_bytes(_cls: &Bound<'_, PyType>, py: Python<'_>, data: &[u8]) -> PyResult<Self> {
        MrDescriptor::from_bytes(data).py(py).map(Self)
    }

    /// Parses `to_hex()` output; raises InvalidDescriptorError on anything else.
    #[classmethod]
    fn from_hex(_cls: &Bound<'_, PyType>, py: Python<'_>, text: &str) -> PyResult<Self> {
        let bytes = hex::decode(text.trim())
            .map_err(|e| fabric_lib::FabricError::InvalidDescriptor(format!("memory descriptor is not hex: {e}")))
            .py(py)?;
        MrDescriptor::from_bytes(&bytes).py(py).map(Self)
    }

    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.0.to_bytes())
    }

    /// The `to_bytes()` encoding as lower-case hex, for text channels (logs, JSON, env vars).
    fn to_hex(&self) -> String {
        hex::encode(self.0.to_bytes())
    }

    /// Address of the region in its owner's process.
    #[getter]
    fn base(&self) -> u64 {
        self.0.base
    }

    /// Length in bytes.
    #[getter]
    fn length(&self) -> u64 {
        self.0.len
    }

    /// "host" or "cuda:N".
    #[getter]
    fn kind(&self) -> String {
        match self.0.kind {
            MemoryKind::Host => "host".into(),
            MemoryKind::Cuda(d) => format!("cuda:{d}"),
        }
    }

    /// False for GPU regions registered for same-host (CUDA IPC) transfers only.
    #[getter]
    fn network_reachable(&self) -> bool {
        self.0.network_reachable()
    }

    /// True for GPU regions that peers on other hosts reach staged, through the owner's
    /// landing area (providers without FI_HMEM, staging on).
    #[getter]
    fn staged_reachable(&self) -> bool {
        self.0.staged_reachable()
    }

    /// Whether the owner registered the region with remote_read=True (peers may read it).
    #[getter]
    fn remote_readable(&self) -> bool {
        self.0.remote_read
    }

    /// Address of the owning engine.
    #[getter]
    fn owner(&self) -> PyEngineAddress {
        PyEngineAddress(self.0.owner.clone())
    }

    fn __len__(&self) -> usize {
        self.0.len as usize
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyBytes>,))> {
        let py = slf.py();
        Ok((slf.getattr("from_bytes")?, (slf.get().to_bytes(py),)))
    }

    fn __repr__(&self) -> String {
        format!(
            "MrDescriptor(base=0x{:x}, length={}, kind={}, provider={:?})",
            self.0.base,
            self.0.len,
            self.kind(),
            self.0.owner.provider
        )
    }
}
