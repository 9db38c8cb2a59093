//! Maps `FabricError` to the Python exception classes defined in `fabric_lib.errors`.
use fabric_lib::FabricError;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

fn class_name(e: &FabricError) -> &'static str {
    match e {
        FabricError::ProviderUnavailable(_) => "ProviderUnavailableError",
        FabricError::InvalidArgument(_) => "InvalidArgumentError",
        FabricError::InvalidDescriptor(_) => "InvalidDescriptorError",
        FabricError::Libfabric { .. } => "FabricError",
        FabricError::TransferFailed(_) => "TransferError",
        FabricError::Timeout(_) => "FabricTimeoutError",
        FabricError::Stopped => "EngineStoppedError",
        FabricError::CudaUnavailable(_) => "CudaUnavailableError",
        FabricError::Cuda(_) => "CudaError",
    }
}

/// Builds the Python exception for `e` (falls back to RuntimeError if the package is broken).
pub fn to_pyerr(py: Python<'_>, e: FabricError) -> PyErr {
    let message = e.to_string();
    let built = py
        .import("fabric_lib.errors")
        .and_then(|m| m.getattr(class_name(&e)))
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

impl<T> IntoPyResult<T> for Result<T, FabricError> {
    fn py(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_pyerr(py, e))
    }
}
