//! The crate's one error type.
use cuda_lib::CudaError;

/// Everything that can go wrong in `p2p-all-to-all`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum A2aError {
    /// A CUDA driver call made through `cuda-lib` failed (or no driver is available).
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// A raw driver call made by this crate (module load, launch) failed.
    #[error("{call} failed: CUresult {code}")]
    Call {
        /// The driver function (e.g. `cuLaunchKernel`).
        call: &'static str,
        /// The `CUresult` value.
        code: i32,
    },
    /// This build carries no kernels (nvcc was missing at build time).
    #[error("all-to-all CUDA kernels not built: install nvcc 13.0.x (scripts/setup.sh does) and rebuild")]
    KernelsUnavailable,
    /// A configuration or call argument is out of range or inconsistent; nothing was launched.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The object is used before [`crate::AllToAll::connect`] or after a peer was lost.
    #[error("not connected: {0}")]
    NotConnected(String),
}

/// `Result` with [`A2aError`].
pub type Result<T, E = A2aError> = std::result::Result<T, E>;

/// Builds an [`A2aError::InvalidArgument`] from a format string.
macro_rules! invalid {
    ($($arg:tt)*) => { $crate::error::A2aError::InvalidArgument(format!($($arg)*)) };
}
pub(crate) use invalid;
