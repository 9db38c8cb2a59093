//! libfabric return codes as [`FabricError`]s.
use std::ffi::CStr;

use crate::error::FabricError;

/// `fi_strerror` for a positive libfabric error code.
pub fn strerror(code: i32) -> String {
    // SAFETY: fi_strerror returns a pointer to a static, NUL-terminated string for any input.
    unsafe { CStr::from_ptr(libfabric_sys::fi_strerror(code)) }.to_string_lossy().into_owned()
}

/// A [`FabricError::Libfabric`] from a negative libfabric return code of `call`.
pub fn libfabric_error(call: &'static str, ret: i64) -> FabricError {
    let code = ret.unsigned_abs() as i32;
    FabricError::Libfabric { call, code, message: strerror(code) }
}
