//! Embedding a crate's kernels: the one helper for every crate whose build script calls
//! `cuda_build::compile_kernels` (cuda-lib itself, p2p-all-to-all).

/// A 16-byte aligned wrapper: the embedded fatbin starts on the alignment its header needs.
#[doc(hidden)]
#[repr(C, align(16))]
pub struct Aligned16<T: ?Sized>(pub T);

/// Defines `pub fn kernel_image() -> cuda_lib::Result<&'static [u8]>` (the fatbin that the
/// crate's build script compiled, or [`crate::CudaError::KernelsUnavailable`] when nvcc was
/// missing) and `pub fn kernel_archs() -> &'static str` (its machine-code architectures, e.g.
/// "sm_90a,sm_100a", empty if none) in the module that invokes it.
///
/// The arguments name the compile-time variables `cuda_build::compile_kernels` sets:
/// `embed_kernels!("PREFIX_FATBIN", "PREFIX_KERNEL_ARCHS")`.
#[macro_export]
macro_rules! embed_kernels {
    ($fatbin_var:literal, $archs_var:literal) => {
        /// The embedded fatbin, or `CudaError::KernelsUnavailable` when nvcc was missing at build
        /// time.
        pub fn kernel_image() -> $crate::Result<&'static [u8]> {
            #[cfg(not(cuda_kernels_missing))]
            {
                static FATBIN: &$crate::Aligned16<[u8]> = &$crate::Aligned16(*include_bytes!(env!($fatbin_var)));
                Ok(&FATBIN.0)
            }
            #[cfg(cuda_kernels_missing)]
            {
                Err($crate::CudaError::KernelsUnavailable)
            }
        }

        /// The machine-code architectures in the embedded fatbin (e.g. "sm_90a,sm_100a"), empty
        /// if none.
        pub fn kernel_archs() -> &'static str {
            env!($archs_var)
        }
    };
}
