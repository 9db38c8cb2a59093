//! Loading libcuda at run time, and the thin fallible layer over cudarc's raw `sys` bindings.
//!
//! cudarc loads `libcuda.so` lazily and panics when it (or a symbol) is missing. Every path into
//! the driver in this crate goes through [`Driver::get`] first, which checks that the library and
//! every symbol in [`REQUIRED_SYMBOLS`] exist and runs `cuInit`, so those panics cannot happen:
//! a missing piece becomes [`CudaError::DriverUnavailable`].
use std::{ffi::c_void, sync::OnceLock};

use cudarc::driver::sys;

use crate::error::{CudaError, Result};

/// Calls a raw driver function and turns its `CUresult` into `Result<()>`; the error names the
/// call. Must be used inside an `unsafe` block (the callee is an `unsafe fn`), and only after
/// [`Driver::get`] succeeded (every safe type in this crate guarantees that by construction).
macro_rules! cu {
    ($f:ident ( $($arg:expr),* $(,)? )) => {
        $crate::driver::check(stringify!($f), cudarc::driver::sys::$f($($arg),*))
    };
}

/// Every driver symbol this crate calls through `cu!`; checked at load time so that an old driver
/// is reported as [`CudaError::DriverUnavailable`] instead of a panic. A unit test keeps this list
/// in sync with the sources.
pub(crate) const REQUIRED_SYMBOLS: &[&str] = &[
    "cuCtxGetCurrent",
    "cuCtxPopCurrent_v2",
    "cuCtxPushCurrent_v2",
    "cuCtxSetCurrent",
    "cuCtxEnablePeerAccess",
    "cuCtxSynchronize",
    "cuDeviceCanAccessPeer",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDeviceGetCount",
    "cuDeviceGetName",
    "cuDevicePrimaryCtxRelease_v2",
    "cuDevicePrimaryCtxRetain",
    "cuDeviceTotalMem_v2",
    "cuDriverGetVersion",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventElapsedTime_v2",
    "cuEventQuery",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuFuncSetAttribute",
    "cuGraphDestroy",
    "cuGraphExecDestroy",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuInit",
    "cuIpcCloseMemHandle",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuLaunchKernel",
    "cuMemAddressFree",
    "cuMemAddressReserve",
    "cuMemAlloc_v2",
    "cuMemCreate",
    "cuMemExportToShareableHandle",
    "cuMemFreeHost",
    "cuMemFree_v2",
    "cuMemGetAddressRange_v2",
    "cuMemGetAllocationGranularity",
    "cuMemGetHandleForAddressRange",
    "cuMemHostAlloc",
    "cuMemHostGetDevicePointer_v2",
    "cuMemImportFromShareableHandle",
    "cuMemMap",
    "cuMemRelease",
    "cuMemSetAccess",
    "cuMemUnmap",
    "cuMemcpyAsync",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyPeerAsync",
    "cuMemsetD8Async",
    "cuModuleGetFunction",
    "cuModuleLoadData",
    "cuModuleUnload",
    "cuPointerGetAttribute",
    "cuStreamBeginCapture_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamEndCapture",
    "cuStreamQuery",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuStreamWaitValue64_v2",
    "cuStreamWriteValue64_v2",
];

/// The loaded and initialized CUDA driver (one per process).
#[derive(Debug)]
pub struct Driver {
    version: i32,
}

static DRIVER: OnceLock<Result<Driver>> = OnceLock::new();

impl Driver {
    /// Loads libcuda, checks its symbols and runs `cuInit(0)` (once per process).
    pub fn get() -> Result<&'static Driver> {
        DRIVER.get_or_init(load).as_ref().map_err(Clone::clone)
    }

    /// Whether the driver loads and initializes in this process.
    pub fn is_available() -> bool {
        Self::get().is_ok()
    }

    /// The CUDA version the driver supports, as (major, minor), e.g. (13, 0).
    pub fn cuda_version(&self) -> (i32, i32) {
        (self.version / 1000, (self.version % 1000) / 10)
    }
}

const HOW_TO_GET: &str = "install the NVIDIA driver (it ships libcuda.so.1, CUDA 13.0 or newer), \
     or put the directory holding libcuda.so.1 on LD_LIBRARY_PATH; in a container, start it with \
     the NVIDIA container toolkit (e.g. `docker run --gpus all`)";

fn load() -> Result<Driver> {
    // SAFETY: only tries to dlopen the candidate names of libcuda; loading the NVIDIA driver's
    // library runs its initializers, as for any CUDA program.
    if !unsafe { sys::is_culib_present() } {
        let mut names = cudarc::get_lib_name_candidates("cuda");
        let mut seen = std::collections::HashSet::new();
        names.retain(|n| seen.insert(n.clone()));
        return Err(CudaError::DriverUnavailable(format!(
            "libcuda (the NVIDIA driver's CUDA library) was not found (tried {}); {HOW_TO_GET}",
            names.join(", ")
        )));
    }
    // SAFETY: a candidate loaded just above, so culib() finds one and does not panic.
    let lib = unsafe { sys::culib() };
    for name in REQUIRED_SYMBOLS {
        // SAFETY: resolving a symbol's address calls nothing; the pointer is not used.
        if unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err() {
            return Err(CudaError::DriverUnavailable(format!(
                "libcuda has no `{name}`: the NVIDIA driver is too old; {HOW_TO_GET}"
            )));
        }
    }
    // SAFETY: the library and its symbols are present; cuInit takes a flags value of 0.
    unsafe { cu!(cuInit(0)) }.map_err(|e| {
        CudaError::DriverUnavailable(format!(
            "{e}: libcuda loaded but found no usable GPU (is one visible to this process? \
             check nvidia-smi and CUDA_VISIBLE_DEVICES)"
        ))
    })?;
    let mut version = 0;
    // SAFETY: cuInit succeeded; `version` is a valid out pointer.
    unsafe { cu!(cuDriverGetVersion(&mut version)) }?;
    Ok(Driver { version })
}

/// Converts a raw `CUresult` into a `Result`, naming the failed call.
#[inline]
pub(crate) fn check(call: &'static str, result: sys::CUresult) -> Result<()> {
    if result == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::call(call, result))
    }
}

/// Logs a failure in a `Drop` impl (drops never panic and have nobody to return an error to).
pub(crate) fn log_drop_error(what: &str, result: Result<()>) {
    if let Err(e) = result {
        // Deinitialized: the process is exiting and the driver already freed everything.
        if e.code() != Some(sys::CUresult::CUDA_ERROR_DEINITIALIZED as i32) {
            tracing::warn!("cuda-lib: releasing {what}: {e}");
        }
    }
}

/// Number of CUDA devices visible to this process.
pub fn device_count() -> Result<usize> {
    Driver::get()?;
    let mut n = 0;
    // SAFETY: the driver is initialized; `n` is a valid out pointer.
    unsafe { cu!(cuDeviceGetCount(&mut n)) }?;
    Ok(n as usize)
}

/// The ordinal of the device whose memory `ptr` points into, or `None` when `ptr` is host memory
/// (pinned and mapped included), unknown to CUDA, or when no driver is available.
pub fn pointer_device(ptr: u64) -> Option<usize> {
    Driver::get().ok()?;
    let mut mem_type: u32 = 0;
    // SAFETY: the driver is initialized; MEMORY_TYPE writes one `unsigned int` into `mem_type`.
    // Unknown pointers make the call fail, which is an answer here, not an error.
    unsafe {
        cu!(cuPointerGetAttribute(
            (&mut mem_type as *mut u32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            ptr
        ))
    }
    .ok()?;
    if mem_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return None;
    }
    let mut ordinal: i32 = -1;
    // SAFETY: as above; DEVICE_ORDINAL writes one `int`.
    unsafe {
        cu!(cuPointerGetAttribute(
            (&mut ordinal as *mut i32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr
        ))
    }
    .ok()?;
    usize::try_from(ordinal).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a GPU (CI, this dev machine) the driver reports itself unavailable, no panic.
    #[test]
    fn driver_missing_is_an_error_not_a_panic() {
        match Driver::get() {
            Ok(d) => assert!(d.cuda_version().0 >= 11),
            Err(CudaError::DriverUnavailable(msg)) => {
                assert!(msg.contains("libcuda") || msg.contains("cuInit"), "{msg}");
                assert!(matches!(device_count(), Err(CudaError::DriverUnavailable(_))));
                assert_eq!(pointer_device(0x1000), None);
                assert!(!Driver::is_available());
            }
            Err(e) => panic!("unexpected error {e}"),
        }
    }

    /// Every driver call made through the `cu` macro names a symbol checked at load time.
    #[test]
    fn required_symbols_cover_every_call() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut used = std::collections::BTreeSet::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
            for part in text.split("cu!(").skip(1) {
                let name: String = part.trim_start().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                if name.starts_with("cu") {
                    used.insert(name);
                }
            }
        }
        let missing: Vec<_> = used.iter().filter(|n| !REQUIRED_SYMBOLS.contains(&n.as_str())).collect();
        assert!(missing.is_empty(), "add to REQUIRED_SYMBOLS: {missing:?}");
        let unused: Vec<_> = REQUIRED_SYMBOLS.iter().filter(|n| !used.contains(**n)).collect();
        assert!(unused.is_empty(), "unused in REQUIRED_SYMBOLS: {unused:?}");
    }
}
