//! libfabric FI_EP_RDM domains: provider selection, endpoint set-up, memory registration and the
//! data-path calls. Everything here runs on the owning worker thread (FI_THREAD_DOMAIN).
mod context;
mod domain;
mod endpoint;
mod info;
mod mr;

pub use context::{OpContext, OpKind};
pub use domain::{Completion, LibfabricDomain, Posted, CQ_BATCH};
pub use endpoint::check_endpoint;
pub use info::{is_software, list_providers, DomainSpec, ProviderSpec, SOFTWARE_DEFAULT_DOMAIN};
pub use mr::{Access, LocalMr};

use std::ffi::CStr;

/// `fi_strerror` for a positive libfabric error code.
pub fn strerror(code: i32) -> String {
    // SAFETY: fi_strerror returns a pointer to a static, NUL-terminated string for any input.
    unsafe { CStr::from_ptr(libfabric_sys::fi_strerror(code)) }.to_string_lossy().into_owned()
}
