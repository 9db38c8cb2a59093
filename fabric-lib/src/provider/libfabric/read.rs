//! RMA reads on one domain: pulling a peer's registered (and remotely readable) bytes into a
//! local registration. The completion means the bytes are in local memory.
use std::ffi::c_void;

use libfabric_sys as sys;

use super::context::OpContext;
use super::domain::{LibfabricDomain, Posted};
use crate::error::Result;

impl LibfabricDomain {
    /// Whether this endpoint can issue RMA reads and serve them (FI_READ and FI_REMOTE_READ in
    /// its capabilities). Every peer runs the same provider, so one side's answer holds for both.
    pub fn supports_read(&self) -> bool {
        // SAFETY: the fi_info is owned by the domain and valid while it lives.
        let caps = unsafe { (*self.info.raw()).caps };
        let both = (sys::FI_READ | sys::FI_REMOTE_READ) as u64;
        caps & both == both
    }

    /// Posts one RMA read of `len` bytes at `remote_addr` (under `key`) of peer `src` into
    /// `local`.
    ///
    /// # Safety
    /// `local` must stay valid, writable and registered (with `desc`) until the completion of
    /// `context` is read; `context` must stay at its address until then.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn post_read(
        &mut self,
        local: *mut u8,
        len: usize,
        desc: *mut c_void,
        src: sys::fi_addr_t,
        remote_addr: u64,
        key: u64,
        context: *mut OpContext,
    ) -> Result<Posted> {
        // SAFETY: forwarded from the caller's contract; the endpoint is enabled.
        let ret = unsafe {
            sys::shim_fi_read(
                self.fids.ep,
                local as *mut c_void,
                len,
                desc,
                src,
                remote_addr,
                key,
                context as *mut c_void,
            )
        };
        Self::posted("fi_read", ret)
    }
}
