//! Moving bytes between this process and another process's host memory (`process_vm_writev`,
//! `process_vm_readv`): the last step of a GPU → host same-host write, whose data CUDA staged in
//! pinned memory of this process, the whole of a host → host one (`same_host_host_memory`), and
//! the first step of a same-host read of a peer's host memory into GPU memory (read into pinned
//! staging, then copied to the GPU).
use crate::error::{FabricError, Result};

/// Which way the bytes go.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// From this process into the peer (`process_vm_writev`).
    Write,
    /// From the peer into this process (`process_vm_readv`).
    Read,
}

/// Writes `pieces` (local offset, remote address, length) into process `pid`.
///
/// # Safety
/// `base + off .. + len` must be readable for every piece.
pub(super) unsafe fn process_vm_write(pid: u32, base: *const u8, pieces: &[(usize, u64, usize)]) -> Result<()> {
    // SAFETY: forwarded; a write only reads the local side.
    unsafe { process_vm_copy(Direction::Write, pid, base as *mut u8, pieces) }
}

/// Reads `pieces` (local offset, remote address, length) of process `pid` into `base`.
///
/// # Safety
/// `base + off .. + len` must be writable for every piece.
pub(super) unsafe fn process_vm_read(pid: u32, base: *mut u8, pieces: &[(usize, u64, usize)]) -> Result<()> {
    // SAFETY: forwarded from the caller's contract.
    unsafe { process_vm_copy(Direction::Read, pid, base, pieces) }
}

unsafe fn process_vm_copy(direction: Direction, pid: u32, base: *mut u8, pieces: &[(usize, u64, usize)]) -> Result<()> {
    const IOV_MAX: usize = 1024;
    let (call, what) = match direction {
        Direction::Write => ("process_vm_writev", "writing GPU data into host memory of"),
        Direction::Read => ("process_vm_readv", "reading host memory of"),
    };
    for chunk in pieces.chunks(IOV_MAX) {
        let mut local: Vec<libc::iovec> = chunk
            .iter()
            // SAFETY: in bounds of the local buffer (caller's contract).
            .map(|&(off, _, len)| libc::iovec { iov_base: unsafe { base.add(off) } as *mut libc::c_void, iov_len: len })
            .collect();
        let mut remote: Vec<libc::iovec> = chunk
            .iter()
            .map(|&(_, addr, len)| libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: len })
            .collect();
        let mut total: usize = chunk.iter().map(|p| p.2).sum();
        // process_vm_{readv,writev} may stop early; resume after the bytes it moved.
        let (mut li, mut ri) = (0usize, 0usize);
        while total > 0 {
            let (lp, ln) = (local[li..].as_ptr(), (local.len() - li) as libc::c_ulong);
            let (rp, rn) = (remote[ri..].as_ptr(), (remote.len() - ri) as libc::c_ulong);
            // SAFETY: the iovec arrays are valid for their lengths; the kernel validates the
            // remote ranges.
            let n = unsafe {
                match direction {
                    Direction::Write => libc::process_vm_writev(pid as libc::pid_t, lp, ln, rp, rn, 0),
                    Direction::Read => libc::process_vm_readv(pid as libc::pid_t, lp, ln, rp, rn, 0),
                }
            };
            if n < 0 {
                let err = std::io::Error::last_os_error();
                let hint = match err.raw_os_error() {
                    Some(libc::EPERM) => {
                        " (no ptrace permission over the peer: run both as the same user with \
                         /proc/sys/kernel/yama/ptrace_scope = 0, or grant CAP_SYS_PTRACE)"
                    }
                    Some(libc::ESRCH) => " (the peer process is gone)",
                    Some(libc::EFAULT) => " (the peer's region is no longer mapped: region freed?)",
                    _ => "",
                };
                return Err(FabricError::TransferFailed(format!("{what} process {pid} with {call}: {err}{hint}")));
            }
            if n == 0 {
                return Err(FabricError::TransferFailed(format!("{call} with process {pid} made no progress")));
            }
            let n = n as usize;
            total -= n.min(total);
            advance(&mut local, &mut li, n);
            advance(&mut remote, &mut ri, n);
        }
    }
    Ok(())
}

fn advance(iov: &mut [libc::iovec], index: &mut usize, mut n: usize) {
    while n > 0 && *index < iov.len() {
        let v = &mut iov[*index];
        if n >= v.iov_len {
            n -= v.iov_len;
            *index += 1;
        } else {
            v.iov_base = (v.iov_base as usize + n) as *mut libc::c_void;
            v.iov_len -= n;
            n = 0;
        }
    }
    while *index < iov.len() && iov[*index].iov_len == 0 {
        *index += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_vm_write_into_this_process_scatters_pieces() {
        let src: Vec<u8> = (0..=255u8).cycle().take(3 * 1000).collect();
        let mut dst = vec![0u8; 5000];
        let d = dst.as_mut_ptr() as u64;
        let pieces = [(0usize, d + 4000, 1000usize), (1000, d, 1000), (2000, d + 2000, 1000)];
        // SAFETY: every piece is inside `src` and `dst`, both alive.
        unsafe { process_vm_write(std::process::id(), src.as_ptr(), &pieces) }.unwrap();
        assert_eq!(&dst[4000..5000], &src[0..1000]);
        assert_eq!(&dst[0..1000], &src[1000..2000]);
        assert_eq!(&dst[2000..3000], &src[2000..3000]);
        assert!(dst[1000..2000].iter().all(|&b| b == 0));
    }

    #[test]
    fn process_vm_read_from_this_process_gathers_pieces() {
        let src: Vec<u8> = (0..=255u8).cycle().take(5000).collect();
        let mut dst = vec![0u8; 3000];
        let s = src.as_ptr() as u64;
        let pieces = [(0usize, s + 4000, 1000usize), (1000, s, 1000), (2000, s + 2000, 1000)];
        // SAFETY: every piece is inside `src` and `dst`, both alive.
        unsafe { process_vm_read(std::process::id(), dst.as_mut_ptr(), &pieces) }.unwrap();
        assert_eq!(&dst[0..1000], &src[4000..5000]);
        assert_eq!(&dst[1000..2000], &src[0..1000]);
        assert_eq!(&dst[2000..3000], &src[2000..3000]);
        // SAFETY: as above; the remote address is unmapped, which the kernel reports.
        let e = unsafe { process_vm_read(std::process::id(), dst.as_mut_ptr(), &[(0, 8, 16)]) }.unwrap_err();
        assert!(e.to_string().contains("process_vm_readv"), "{e}");
    }

    #[test]
    fn process_vm_write_to_unmapped_memory_is_an_error() {
        let src = [1u8; 16];
        // SAFETY: the local side is valid; the remote address is unmapped, which the kernel reports.
        let e = unsafe { process_vm_write(std::process::id(), src.as_ptr(), &[(0, 8, 16)]) }.unwrap_err();
        assert!(e.to_string().contains("process_vm_writev"), "{e}");
    }

    #[test]
    fn advance_skips_whole_and_partial_vectors() {
        let mut v = vec![
            libc::iovec { iov_base: 100 as *mut libc::c_void, iov_len: 10 },
            libc::iovec { iov_base: 200 as *mut libc::c_void, iov_len: 10 },
        ];
        let mut i = 0;
        advance(&mut v, &mut i, 13);
        assert_eq!(i, 1);
        assert_eq!(v[1].iov_base as usize, 203);
        assert_eq!(v[1].iov_len, 7);
        advance(&mut v, &mut i, 7);
        assert_eq!(i, 2);
    }
}
