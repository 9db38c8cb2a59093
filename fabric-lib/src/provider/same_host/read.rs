//! Same-host reads where either side is GPU memory: the mirror of the same-host writes, with the
//! peer's region as the source and a local region as the destination.
//!
//! - peer GPU → local GPU: the peer allocation is opened through its IPC handle on the local
//!   device; a copy engine (contiguous) or the paged-copy kernel (pages) moves the bytes.
//! - peer GPU → local host: the bytes are staged in pinned memory (copy engine or kernel) and
//!   copied into the local pages once the event completed.
//! - peer host → local GPU: `process_vm_readv` (a plain copy for a peer in this process) gathers
//!   the peer's bytes into pinned staging memory, from which the copy engine or the kernel
//!   moves them to the GPU. Needs ptrace permission over the peer, like GPU → host writes.
//!
//! `copy`'s source side is the peer, its destination side the local region; both were checked
//! against their regions by the engine.
use super::channel::{InFlightCopy, SameHostChannel};
use super::process_vm::process_vm_read;
use super::{Pages, SameHostCopy, SameHostDst, SameHostSrc};
use crate::descriptor::MemoryKind;
use crate::error::{FabricError, Result};

impl SameHostChannel {
    /// Enqueues one same-host read of `peer` into the local region `local` (`region`); its
    /// completion is reported by [`SameHostChannel::poll`].
    pub fn submit_read(
        &mut self,
        request: u64,
        region: u64,
        local: SameHostSrc,
        peer: SameHostDst,
        copy: SameHostCopy,
    ) -> Result<()> {
        let mut buffers = Vec::new();
        let (device, host_write, error) = match (peer.kind, local.kind) {
            (MemoryKind::Host, MemoryKind::Host) => {
                return Err(FabricError::InvalidArgument("host-to-host reads take the network path".into()))
            }
            (MemoryKind::Cuda(_), MemoryKind::Cuda(local_dev)) => {
                let device = local_dev as usize;
                let src = SameHostSrc { kind: MemoryKind::Cuda(local_dev), ptr: self.dst_base(device, &peer)? };
                (device, None, self.enqueue_to_gpu(device, &src, local.ptr, &copy, &mut buffers)?)
            }
            (MemoryKind::Cuda(peer_dev), MemoryKind::Host) => {
                let device = peer_dev as usize;
                let src = SameHostSrc { kind: peer.kind, ptr: self.dst_base(device, &peer)? };
                // The local region is the "peer" of a GPU → host write that stages and copies.
                let here = SameHostDst {
                    kind: MemoryKind::Host,
                    base: local.ptr,
                    len: 0, // not consulted for host destinations
                    pid: std::process::id(),
                    process: 0,
                    same_process: true,
                    cuda: None,
                };
                let (error, write) = self.enqueue_to_host(device, &src, &here, &copy, &mut buffers)?;
                (device, Some(write), error)
            }
            (MemoryKind::Host, MemoryKind::Cuda(local_dev)) => {
                let device = local_dev as usize;
                let (staged, staged_copy) = self.gather_peer_host(device, &peer, &copy)?;
                buffers.push(staged);
                let src = SameHostSrc { kind: MemoryKind::Cuda(local_dev), ptr: buffers[0].device_ptr() };
                (device, None, self.enqueue_to_gpu(device, &src, local.ptr, &staged_copy, &mut buffers)?)
            }
        };
        self.track_copy(device, InFlightCopy { request, region, buffers, host_write, error })
    }

    /// Reads the peer's host bytes named by `copy` into pinned staging memory (pages in list
    /// order, consecutively); returns the staging and the copy from it to the local region.
    fn gather_peer_host(
        &mut self,
        device: usize,
        peer: &SameHostDst,
        copy: &SameHostCopy,
    ) -> Result<(cuda_lib::PinnedHostBuffer, SameHostCopy)> {
        let (pieces, staged_copy): (Vec<(usize, u64, usize)>, SameHostCopy) = match copy {
            SameHostCopy::Contiguous { src_offset, dst_offset, len } => (
                vec![(0, peer.base + src_offset, *len as usize)],
                SameHostCopy::Contiguous { src_offset: 0, dst_offset: *dst_offset, len: *len },
            ),
            SameHostCopy::Paged(p) => {
                let page_len = p.page_len as usize;
                let pieces = p
                    .src_pages
                    .iter()
                    .enumerate()
                    .map(|(i, &s)| (i * page_len, peer.base + u64::from(s) * p.src_stride + p.src_offset, page_len))
                    .collect();
                let staged = Pages {
                    src_pages: (0..p.src_pages.len() as u32).collect(),
                    src_stride: p.page_len,
                    src_offset: 0,
                    ..p.clone()
                };
                (pieces, SameHostCopy::Paged(staged))
            }
        };
        let total: usize = pieces.iter().map(|p| p.2).sum();
        let mut staging = self.pinned(device, total.max(1))?;
        if peer.same_process {
            let out = staging.as_mut_slice();
            for &(off, addr, len) in &pieces {
                // SAFETY: the range lies in a region registered in this process (checked
                // against its descriptor by the engine).
                let from = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
                out[off..off + len].copy_from_slice(from);
            }
        } else {
            // SAFETY: staging holds `total` bytes, every piece inside it.
            unsafe { process_vm_read(peer.pid, staging.host_ptr(), &pieces) }?;
        }
        Ok((staging, staged_copy))
    }
}
