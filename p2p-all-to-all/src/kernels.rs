//! The embedded fatbin of `kernels/*.cu`, loaded into one context, and launches on a raw stream
//! handle (the caller's, e.g. torch's current stream): cuda-lib's `Function::launch` takes a
//! `cuda_lib::Stream` it created, so the thin driver layer for the launch lives here.
use std::{ffi::c_void, marker::PhantomData, sync::Arc};

use cuda_lib::{sys, Context};

use crate::error::{A2aError, Result};

#[cfg(not(cuda_kernels_missing))]
#[repr(C, align(16))]
struct Aligned<T: ?Sized>(T);

#[cfg(not(cuda_kernels_missing))]
static FATBIN: &Aligned<[u8]> = &Aligned(*include_bytes!(env!("P2P_A2A_FATBIN")));

/// The embedded fatbin, or [`A2aError::KernelsUnavailable`] when nvcc was missing at build time.
pub fn kernel_image() -> Result<&'static [u8]> {
    #[cfg(not(cuda_kernels_missing))]
    {
        Ok(&FATBIN.0)
    }
    #[cfg(cuda_kernels_missing)]
    {
        Err(A2aError::KernelsUnavailable)
    }
}

/// The machine-code architectures in the embedded fatbin (e.g. "sm_90a,sm_100a"), empty if none.
pub fn kernel_archs() -> &'static str {
    env!("P2P_A2A_KERNEL_ARCHS")
}

fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(A2aError::Call { call, code: r as i32 })
    }
}

/// Makes a context current until dropped (then restores the previous one).
struct Current<'a> {
    pushed: bool,
    _ctx: PhantomData<(&'a Context, *const ())>,
}

impl<'a> Current<'a> {
    fn enter(ctx: &'a Context) -> Result<Self> {
        let mut cur = std::ptr::null_mut();
        // SAFETY: `cur` is a valid out pointer; the driver is loaded (a Context exists).
        check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut cur) })?;
        if cur == ctx.raw() {
            return Ok(Current { pushed: false, _ctx: PhantomData });
        }
        // SAFETY: the context is retained and live; popped again in Drop.
        check("cuCtxPushCurrent", unsafe { sys::cuCtxPushCurrent_v2(ctx.raw()) })?;
        Ok(Current { pushed: true, _ctx: PhantomData })
    }
}

impl Drop for Current<'_> {
    fn drop(&mut self) {
        if self.pushed {
            let mut popped = std::ptr::null_mut();
            // SAFETY: `enter` pushed exactly one context on this thread.
            let r = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
            if r != sys::CUresult::CUDA_SUCCESS {
                tracing::warn!("p2p-all-to-all: cuCtxPopCurrent failed: {r:?}");
            }
        }
    }
}

/// The kernels (each half, and both halves fused), loaded into one context; unloaded on drop.
#[derive(Debug)]
pub struct Kernels {
    ctx: Arc<Context>,
    module: sys::CUmodule,
    pub(crate) dispatch_send: sys::CUfunction,
    pub(crate) dispatch_recv: sys::CUfunction,
    pub(crate) combine_send: sys::CUfunction,
    pub(crate) combine_recv: sys::CUfunction,
    pub(crate) dispatch: sys::CUfunction,
    pub(crate) combine: sys::CUfunction,
}

// SAFETY: module and function handles are immutable driver objects usable from any thread.
unsafe impl Send for Kernels {}
// SAFETY: as above; nothing mutates through &self.
unsafe impl Sync for Kernels {}

impl Kernels {
    /// Loads the embedded fatbin into `ctx`.
    pub fn load(ctx: &Arc<Context>) -> Result<Self> {
        let image = kernel_image()?;
        // The driver reads 8-byte header fields: hand it an aligned, NUL-padded copy.
        let mut aligned = vec![0u128; image.len().div_ceil(16) + 1];
        // SAFETY: `aligned` holds at least image.len() bytes; the regions do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(image.as_ptr(), aligned.as_mut_ptr().cast::<u8>(), image.len()) };
        let _cur = Current::enter(ctx)?;
        let mut module = std::ptr::null_mut();
        // SAFETY: the context is current; the image is readable for the call.
        check("cuModuleLoadData", unsafe { sys::cuModuleLoadData(&mut module, aligned.as_ptr().cast()) })?;
        let mut kernels = Kernels {
            ctx: ctx.clone(),
            module,
            dispatch_send: std::ptr::null_mut(),
            dispatch_recv: std::ptr::null_mut(),
            combine_send: std::ptr::null_mut(),
            combine_recv: std::ptr::null_mut(),
            dispatch: std::ptr::null_mut(),
            combine: std::ptr::null_mut(),
        };
        let get = |name: &std::ffi::CStr| -> Result<sys::CUfunction> {
            let mut f = std::ptr::null_mut();
            // SAFETY: the module is live; `name` is NUL-terminated; `f` is a valid out pointer.
            check("cuModuleGetFunction", unsafe { sys::cuModuleGetFunction(&mut f, module, name.as_ptr()) })?;
            Ok(f)
        };
        kernels.dispatch_send = get(c"a2a_dispatch_send")?;
        kernels.dispatch_recv = get(c"a2a_dispatch_recv")?;
        kernels.combine_send = get(c"a2a_combine_send")?;
        kernels.combine_recv = get(c"a2a_combine_recv")?;
        kernels.dispatch = get(c"a2a_dispatch")?;
        kernels.combine = get(c"a2a_combine")?;
        Ok(kernels)
    }

    /// Lets `f` use up to `bytes` of dynamic shared memory per block (above the default 48 KiB).
    pub fn set_max_dynamic_shared(&self, f: sys::CUfunction, bytes: u32) -> Result<()> {
        let _cur = Current::enter(&self.ctx)?;
        // SAFETY: `f` is a function of this loaded module; the attribute takes a byte count.
        check("cuFuncSetAttribute", unsafe {
            sys::cuFuncSetAttribute(
                f,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        })
    }

    /// Launches `f` with one by-value parameter block `params` on the raw stream `stream`.
    ///
    /// # Safety
    /// `P` must be the exact `#[repr(C)]` mirror of `f`'s single parameter; every address in it
    /// must be valid for the kernel's accesses until it completed; `stream` must be a live stream
    /// of this context (0: the legacy default stream).
    pub unsafe fn launch<P>(
        &self,
        f: sys::CUfunction,
        grid: u32,
        threads: u32,
        shared_bytes: u32,
        stream: u64,
        params: &P,
    ) -> Result<()> {
        let _cur = Current::enter(&self.ctx)?;
        let mut args: [*mut c_void; 1] = [(params as *const P).cast_mut().cast()];
        // SAFETY: the caller guarantees the parameter block and the stream; the driver copies
        // the parameter bytes during the call.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                f,
                grid,
                1,
                1,
                threads,
                1,
                1,
                shared_bytes,
                stream as sys::CUstream,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        let result = Current::enter(&self.ctx).and_then(|_cur| {
            // SAFETY: the module came from cuModuleLoadData and is unloaded once.
            check("cuModuleUnload", unsafe { sys::cuModuleUnload(self.module) })
        });
        match result {
            // Deinitialized: the process is exiting and the driver already freed everything.
            Err(A2aError::Call { code, .. }) if code == sys::CUresult::CUDA_ERROR_DEINITIALIZED as i32 => {}
            Err(e) => tracing::warn!("p2p-all-to-all: unloading the kernels: {e}"),
            Ok(()) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_match_the_build() {
        if cfg!(cuda_kernels_missing) {
            assert_eq!(kernel_image(), Err(A2aError::KernelsUnavailable));
            assert_eq!(kernel_archs(), "");
        } else {
            let image = kernel_image().unwrap();
            assert_eq!(&image[..4], &[0x50, 0xed, 0x55, 0xba]);
            assert!(kernel_archs().contains("sm_90a"));
        }
    }
}
