//! Modules loaded from in-memory images (fatbin, cubin, PTX) and kernel launch.
use std::{ffi::CString, sync::Arc};

use cudarc::driver::sys;

use crate::{
    context::Context,
    driver::log_drop_error,
    error::{CudaError, Result},
    stream::Stream,
};

/// A loaded module; unloaded when the last [`Module`]/[`Function`] handle drops.
#[derive(Debug)]
pub struct Module {
    ctx: Arc<Context>,
    raw: sys::CUmodule,
}

// SAFETY: module handles are driver objects usable from any thread; nothing mutates through &self.
unsafe impl Send for Module {}
// SAFETY: as above.
unsafe impl Sync for Module {}

impl Module {
    /// Loads a fatbin or cubin image (or NUL-terminated PTX) into `ctx`.
    pub fn load(ctx: &Arc<Context>, image: &[u8]) -> Result<Arc<Self>> {
        if image.is_empty() {
            return Err(CudaError::InvalidArgument("empty module image".into()));
        }
        // Fatbin and ELF headers hold 8-byte fields: give the driver an aligned copy.
        let mut aligned = vec![0u128; image.len().div_ceil(16) + 1];
        // SAFETY: `aligned` has at least image.len() bytes; the regions do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(image.as_ptr(), aligned.as_mut_ptr().cast::<u8>(), image.len()) };
        let _cur = ctx.enter()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: the context is current; the image is readable (and NUL-padded) for the call.
        unsafe { cu!(cuModuleLoadData(&mut raw, aligned.as_ptr().cast())) }?;
        Ok(Arc::new(Module { ctx: ctx.clone(), raw }))
    }

    /// The `extern "C"` kernel `name`.
    pub fn function(self: &Arc<Self>, name: &str) -> Result<Function> {
        let cname = CString::new(name).map_err(|_| CudaError::InvalidArgument(format!("kernel name {name:?}")))?;
        let _cur = self.ctx.enter()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: the module is live; `cname` is NUL-terminated; `raw` is a valid out pointer.
        unsafe { cu!(cuModuleGetFunction(&mut raw, self.raw, cname.as_ptr())) }?;
        Ok(Function { module: self.clone(), raw, name: name.to_owned() })
    }

    /// The owning context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        let result = self.ctx.enter().and_then(|_cur| {
            // SAFETY: `raw` came from cuModuleLoadData and is unloaded once.
            unsafe { cu!(cuModuleUnload(self.raw)) }
        });
        log_drop_error("module", result);
    }
}

/// Grid and block shape of a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block.
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// A 1-D launch of `blocks` x `threads`.
    pub fn linear(blocks: u32, threads: u32) -> Self {
        LaunchConfig { grid: (blocks, 1, 1), block: (threads, 1, 1), shared_mem_bytes: 0 }
    }
}

/// A kernel of a loaded module (keeps the module loaded).
#[derive(Debug, Clone)]
pub struct Function {
    module: Arc<Module>,
    raw: sys::CUfunction,
    name: String,
}

// SAFETY: function handles are immutable driver objects usable from any thread.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

impl Function {
    /// The kernel's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Raises the dynamic shared memory one block of this kernel may use to `bytes` (above the
    /// default 48 KiB, up to the device's opt-in limit).
    pub fn set_max_dynamic_shared_bytes(&self, bytes: u32) -> Result<()> {
        let bytes = i32::try_from(bytes)
            .map_err(|_| CudaError::InvalidArgument(format!("{bytes} bytes of dynamic shared memory")))?;
        let _cur = self.module.ctx.enter()?;
        // SAFETY: the function is live; the attribute takes a byte count.
        unsafe {
            cu!(cuFuncSetAttribute(
                self.raw,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes
            ))
        }
    }

    /// Launches the kernel on `stream` (which must belong to the module's context).
    ///
    /// # Safety
    /// `params` must hold one pointer per kernel parameter, in order, each pointing to a value
    /// of exactly the parameter's type; every address the kernel dereferences must be valid for
    /// its accesses until the kernel completed.
    pub unsafe fn launch(
        &self,
        stream: &Stream,
        cfg: LaunchConfig,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        if stream.context().raw() != self.module.ctx.raw() {
            return Err(CudaError::InvalidArgument(format!(
                "kernel {} launched on a stream of another context",
                self.name
            )));
        }
        // SAFETY: the stream is live and of the module's context; the caller guarantees the rest.
        unsafe { self.launch_on(stream.raw(), cfg, params) }
    }

    /// Launches the kernel on a stream known only by its raw handle: one another library made
    /// (e.g. torch's current stream), or 0 for the legacy default stream.
    ///
    /// # Safety
    /// As for [`Function::launch`]; and `stream` must be a live stream of the module's context
    /// (or 0), which cannot be checked from the handle.
    pub unsafe fn launch_on(
        &self,
        stream: sys::CUstream,
        cfg: LaunchConfig,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        let _cur = self.module.ctx.enter()?;
        // SAFETY: the caller guarantees the parameters and the stream; the function is live.
        unsafe {
            cu!(cuLaunchKernel(
                self.raw,
                cfg.grid.0,
                cfg.grid.1,
                cfg.grid.2,
                cfg.block.0,
                cfg.block.1,
                cfg.block.2,
                cfg.shared_mem_bytes,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut()
            ))
        }
    }
}
