//! The crate's one error type.
use cudarc::driver::sys;

/// Everything that can go wrong in `cuda-lib`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// `libcuda` could not be loaded or initialized; the message says what is missing and how to
    /// get it. Nothing CUDA-related works in this process.
    #[error("CUDA driver unavailable: {0}")]
    DriverUnavailable(String),
    /// A driver call returned an error.
    #[error("{call} failed: {name} ({code})")]
    Call {
        /// The driver function, as exported by libcuda (e.g. `cuMemCreate`).
        call: &'static str,
        /// The `CUresult` value.
        code: i32,
        /// The `CUresult` name (e.g. `CUDA_ERROR_OUT_OF_MEMORY`).
        name: String,
    },
    /// This build carries no kernels (nvcc was missing at build time).
    #[error("CUDA kernels not built: install nvcc 13.0.x (scripts/setup.sh does) and rebuild")]
    KernelsUnavailable,
    /// An argument the driver would reject or misuse (alignment, size, range).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The device lacks a feature this call needs (VMM, DMA-BUF, peer access, ...).
    #[error("not supported: {0}")]
    Unsupported(String),
}

/// `Result` with [`CudaError`].
pub type Result<T, E = CudaError> = std::result::Result<T, E>;

impl CudaError {
    /// Builds [`CudaError::Call`] from a failed `CUresult`.
    pub(crate) fn call(call: &'static str, result: sys::CUresult) -> Self {
        CudaError::Call { call, code: result as i32, name: error_name(result) }
    }

    /// The `CUresult` code when this is a failed driver call.
    pub fn code(&self) -> Option<i32> {
        match self {
            CudaError::Call { code, .. } => Some(*code),
            _ => None,
        }
    }
}

fn error_name(result: sys::CUresult) -> String {
    // cudarc's CUresult is a Rust enum named after the C constants: no driver call needed.
    format!("{result:?}")
}
