//! Maps the crates' error enums to the Python exception classes defined in `fabric_lib.errors`.
use fabric_lib::FabricError;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

/// An error enum whose variants map to classes of `fabric_lib.errors`.
pub trait PyErrorClass: std::fmt::Display {
    /// The class's name in `fabric_lib.errors`.
    fn class_name(&self) -> &'static str;
}

impl PyErrorClass for FabricError {
    fn class_name(&self) -> &'static str {
        match self {
            FabricError::ProviderUnavailable(_) => "ProviderUnavailableError",
            FabricError::InvalidArgument(_) => "InvalidArgumentError",
            FabricError::InvalidDescriptor(_) => "InvalidDescriptorError",
            FabricError::Libfabric { .. } => "FabricError",
            FabricError::TransferFailed(_) => "TransferError",
            FabricError::Timeout(_) => "FabricTimeoutError",
            FabricError::PeerFenced(_) => "PeerFencedError",
            FabricError::NotReadable(_) => "RegionNotReadableError",
            FabricError::Stopped => "EngineStoppedError",
            FabricError::CudaUnavailable(_) => "CudaUnavailableError",
            FabricError::Cuda(_) => "CudaError",
        }
    }
}

/// Builds the Python exception for `e` (falls back to RuntimeError if the package is broken).
pub fn to_pyerr(py: Python<'_>, e: impl PyErrorClass) -> PyErr {
    let message = e.to_string();
    let built = py
        .import("fabric_lib.errors")
        .and_then(|m| m.getattr(e.class_name()))
        .and_then(|cls| cls.call1((message.clone(),)));
    match built {
        Ok(exc) => PyErr::from_value(exc),
        Err(_) => PyRuntimeError::new_err(message),
    }
}

/// `?`-friendly conversion.
pub trait IntoPyResult<T> {
    fn py(self, py: Python<'_>) -> PyResult<T>;
}

impl<T, E: PyErrorClass> IntoPyResult<T> for Result<T, E> {
    fn py(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_pyerr(py, e))
    }
}
