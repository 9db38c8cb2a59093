//! Checks that host memory handed to `register_memory` is mapped and writable in this process.
//! Peers write into registered memory from the provider's progress thread or through shared
//! memory; an unmapped or read-only range would turn a peer's legitimate write into a SIGSEGV.
use crate::error::{FabricError, Result};

/// Mapped ranges `[start, end)` with their permission string, from `/proc/self/maps`.
fn mappings() -> Result<Vec<(u64, u64, String)>> {
    let text = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| FabricError::InvalidArgument(format!("cannot read /proc/self/maps: {e}")))?;
    Ok(text
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (range, perms) = (fields.next()?, fields.next()?);
            let (start, end) = range.split_once('-')?;
            Some((u64::from_str_radix(start, 16).ok()?, u64::from_str_radix(end, 16).ok()?, perms.to_string()))
        })
        .collect())
}

/// Fails unless every byte of `[ptr, ptr + len)` lies in readable, writable mappings.
pub(crate) fn check_host_range(ptr: u64, len: u64) -> Result<()> {
    let end = ptr.checked_add(len).ok_or_else(|| FabricError::InvalidArgument("region extent overflows".into()))?;
    let mut maps = mappings()?;
    maps.sort_by_key(|m| m.0);
    let mut covered = ptr;
    for (start, stop, perms) in maps {
        if stop <= covered {
            continue;
        }
        if start > covered {
            break; // a hole at `covered`
        }
        if !perms.starts_with("rw") {
            return Err(FabricError::InvalidArgument(format!(
                "memory at {covered:#x} is mapped '{perms}', not writable: peers could not write into it"
            )));
        }
        covered = stop;
        if covered >= end {
            return Ok(());
        }
    }
    Err(FabricError::InvalidArgument(format!(
        "[{ptr:#x}, +{len}) is not mapped memory of this process (unmapped at {covered:#x})"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_memory_passes_and_wild_or_read_only_memory_fails() {
        let buf = vec![0u8; 1 << 20];
        assert!(check_host_range(buf.as_ptr() as u64, buf.len() as u64).is_ok());
        assert!(check_host_range(8, 4096).is_err());
        assert!(check_host_range(u64::MAX - 10, 5).is_err());
        // SAFETY: an anonymous mapping we own, then unmap half of it and protect a page.
        unsafe {
            let page = 4096usize;
            let p = libc::mmap(
                std::ptr::null_mut(),
                4 * page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            let base = p as u64;
            assert!(check_host_range(base, 4 * page as u64).is_ok());
            libc::mprotect((base + page as u64) as *mut libc::c_void, page, libc::PROT_READ);
            assert!(check_host_range(base, 4 * page as u64).is_err());
            assert!(check_host_range(base + 2 * page as u64, 2 * page as u64).is_ok());
            libc::munmap((base + 3 * page as u64) as *mut libc::c_void, page);
            assert!(check_host_range(base + 2 * page as u64, 2 * page as u64).is_err());
            libc::munmap(p, 3 * page);
        }
    }
}
