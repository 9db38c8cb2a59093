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
    /// The engine was stopped before or while the operation ran.
    #[error("engine stopped")]
    Stopped,
}

impl FabricError {
    /// Builds a [`FabricError::Libfabric`] from a negative libfabric return code.
    pub fn libfabric(call: &'static str, ret: i64) -> Self {
        let code = ret.unsigned_abs() as i32;
        FabricError::Libfabric { call, code, message: crate::provider::libfabric::strerror(code) }
    }
}
