//! The crate's one error type.
use cuda_lib::CudaError;

/// Everything that can go wrong in `p2p-all-to-all`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum A2aError {
    /// A CUDA driver call failed, no driver is available, or this build carries no kernels
    /// (nvcc was missing at build time): everything CUDA goes through `cuda-lib`.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// A configuration or call argument is out of range or inconsistent; nothing was launched.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The object is used before [`crate::AllToAll::connect`] or after a peer was lost.
    #[error("not connected: {0}")]
    NotConnected(String),
    /// The TransferEngine that carries traffic to remote ranks failed.
    #[error(transparent)]
    Fabric(#[from] fabric_lib::FabricError),
}

/// `Result` with [`A2aError`].
pub type Result<T, E = A2aError> = std::result::Result<T, E>;

/// Builds an [`A2aError::InvalidArgument`] from a format string.
macro_rules! invalid {
    ($($arg:tt)*) => { $crate::error::A2aError::InvalidArgument(format!($($arg)*)) };
}
pub(crate) use invalid;
