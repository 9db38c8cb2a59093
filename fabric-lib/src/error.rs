//! The one error type of the crate. Every fallible public call returns [`FabricError`]; the Python
//! binding maps each variant to its own exception class.
use thiserror::Error;

/// Result alias used throughout the crate.
pub type Result<T, E = FabricError> = std::result::Result<T, E>;

/// What went wrong, specific enough to act on.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum FabricError {
    /// No libfabric provider (or domain) matches what was asked for.
    #[error("provider unavailable: {0}")]
    ProviderUnavailable(String),
    /// A caller-supplied value is out of range or inconsistent; nothing was posted.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Descriptor or address bytes that do not decode, or that belong to an incompatible engine.
    #[error("invalid descriptor: {0}")]
    InvalidDescriptor(String),
    /// A libfabric call returned an error code.
    #[error("{call} failed: {message} (code {code})")]
    Libfabric { call: &'static str, code: i32, message: String },
    /// A posted operation completed with an error (peer gone, connection reset, ...).
    #[error("transfer failed: {0}")]
    TransferFailed(String),
    /// A bounded wait ran out.
    #[error("timed out: {0}")]
    Timeout(String),
    /// An earlier request to this peer timed out, so the peer is fenced: nothing more is sent
    /// to it until [`crate::TransferEngine::readmit_peer`] (a timed-out request may or may not
    /// have landed; resending blindly could count an immediate twice, so re-admission reports
    /// what the peer counted and makes it drop later deliveries of the ended epoch).
    #[error("peer fenced: {0}")]
    PeerFenced(String),
    /// A read of a peer region its owner did not make remotely readable; nothing was posted.
    #[error("region not readable: {0}")]
    NotReadable(String),
    /// The engine was stopped before or while the operation ran.
    #[error("engine stopped")]
    Stopped,
    /// CUDA (driver, device or the embedded kernels) is missing; the message says what and how
    /// to get it.
    #[error("CUDA unavailable: {0}")]
    CudaUnavailable(String),
    /// A CUDA driver call failed (or CUDA refused an argument).
    #[error("CUDA error: {0}")]
    Cuda(String),
}

impl From<cuda_lib::CudaError> for FabricError {
    fn from(e: cuda_lib::CudaError) -> Self {
        match e {
            cuda_lib::CudaError::DriverUnavailable(m) => FabricError::CudaUnavailable(m),
            e @ cuda_lib::CudaError::KernelsUnavailable => FabricError::CudaUnavailable(e.to_string()),
            other => FabricError::Cuda(other.to_string()),
        }
    }
}
