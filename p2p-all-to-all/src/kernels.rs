//! The embedded fatbin of `kernels/*.cu` (see build.rs), loaded into one context through
//! cuda-lib, and launches on the raw stream handle the caller gives (e.g. torch's current stream).
use std::{ffi::c_void, sync::Arc};

use cuda_lib::{sys, Context, Function, LaunchConfig, Module};

use crate::error::Result;

cuda_lib::embed_kernels!("P2P_A2A_FATBIN", "P2P_A2A_KERNEL_ARCHS");

/// The kernels (each half, and both halves fused), loaded into one context; the module is
/// unloaded when the last of them drops.
#[derive(Debug)]
pub struct Kernels {
    pub(crate) dispatch_send: Function,
    pub(crate) dispatch_recv: Function,
    pub(crate) combine_send: Function,
    pub(crate) combine_recv: Function,
    pub(crate) dispatch: Function,
    pub(crate) combine: Function,
}

impl Kernels {
    /// Loads the embedded fatbin into `ctx`: the build with the RDMA half (`remote`) or the one
    /// where every rank is reached over NVLink (the remote code compiled out); for groups of
    /// more than 32 ranks (`wide`), the dispatch send builds that keep rank sets in two words.
    pub fn load(ctx: &Arc<Context>, remote: bool, wide: bool) -> Result<Self> {
        let module = Module::load(ctx, kernel_image()?)?;
        let suffix = if remote { "_remote" } else { "" };
        let f = |name: &str| module.function(&format!("{name}{suffix}"));
        let send = |name: &str| module.function(&format!("{name}{suffix}{}", if wide { "_wide" } else { "" }));
        Ok(Kernels {
            dispatch_send: send("a2a_dispatch_send")?,
            dispatch_recv: f("a2a_dispatch_recv")?,
            combine_send: f("a2a_combine_send")?,
            combine_recv: f("a2a_combine_recv")?,
            dispatch: send("a2a_dispatch")?,
            combine: f("a2a_combine")?,
        })
    }

    /// Launches `f` as `grid` blocks of `threads`, with one by-value parameter block `params`, on
    /// the raw stream `stream`.
    ///
    /// # Safety
    /// `P` must be the exact `#[repr(C)]` mirror of `f`'s single parameter; every address in it
    /// must be valid for the kernel's accesses until it completed; `stream` must be a live stream
    /// of the kernels' context (0: the legacy default stream).
    pub unsafe fn launch<P>(
        f: &Function,
        grid: u32,
        threads: u32,
        shared_bytes: u32,
        stream: u64,
        params: &P,
    ) -> Result<()> {
        let mut args: [*mut c_void; 1] = [(params as *const P).cast_mut().cast()];
        let cfg = LaunchConfig { grid: (grid, 1, 1), block: (threads, 1, 1), shared_mem_bytes: shared_bytes };
        // SAFETY: the caller guarantees the parameter block and the stream; the driver copies
        // the parameter bytes during the call.
        Ok(unsafe { f.launch_on(stream as sys::CUstream, cfg, &mut args) }?)
    }
}

#[cfg(test)]
mod tests {
    use cuda_lib::CudaError;

    use super::*;

    #[test]
    fn kernels_match_the_build() {
        if cfg!(cuda_kernels_missing) {
            assert_eq!(kernel_image(), Err(CudaError::KernelsUnavailable));
            assert_eq!(kernel_archs(), "");
        } else {
            let image = kernel_image().unwrap();
            assert_eq!(&image[..4], &[0x50, 0xed, 0x55, 0xba]);
            assert!(kernel_archs().contains("sm_90a"));
        }
    }
}
