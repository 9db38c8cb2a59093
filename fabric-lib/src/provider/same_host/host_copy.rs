//! Same-host writes between host memory of two processes (`same_host_host_memory`): the worker
//! places the bytes with `process_vm_writev` (a plain copy when the peer is this process). Once
//! it returned the data is in the destination's memory, so the immediate may follow at once.
use super::process_vm::process_vm_write;
use super::{SameHostCopy, SameHostDst};
use crate::error::Result;

/// Copies from the local host region at `src` into `dst` (both ranges checked by the engine).
pub(crate) fn copy_host_to_host(src: u64, dst: &SameHostDst, copy: &SameHostCopy) -> Result<()> {
    // (offset from `src`, remote address, length) of every piece.
    let pieces: Vec<(usize, u64, usize)> = match copy {
        SameHostCopy::Contiguous { src_offset, dst_offset, len } => {
            vec![(*src_offset as usize, dst.base + dst_offset, *len as usize)]
        }
        SameHostCopy::Paged(p) => p
            .src_pages
            .iter()
            .zip(&p.dst_pages)
            .map(|(&s, &d)| {
                let from = u64::from(s) * p.src_stride + p.src_offset;
                (from as usize, dst.base + u64::from(d) * p.dst_stride + p.dst_offset, p.page_len as usize)
            })
            .collect(),
    };
    if dst.same_process {
        for &(off, remote, len) in &pieces {
            // SAFETY: both ranges lie in regions registered in this process (checked against
            // their registration and descriptor); `copy` is used since they may overlap.
            unsafe { std::ptr::copy((src as *const u8).add(off), remote as *mut u8, len) };
        }
        return Ok(());
    }
    // SAFETY: every piece lies in the registered source region; the remote side is only
    // written by the kernel, which checks the pages belong to the destination process.
    unsafe { process_vm_write(dst.pid, src as *const u8, &pieces) }
}
