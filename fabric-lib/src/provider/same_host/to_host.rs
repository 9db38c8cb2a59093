//! Same-host writes from GPU memory into another process's host memory: CUDA stages the bytes
//! in pinned memory of this process (copy engine, or the paged-copy kernel for pages); once the
//! event completed, `process_vm_writev` places them (see `channel::write_host`).
use cuda_lib::{PagedCopy, PinnedHostBuffer};

use super::channel::{HostWrite, SameHostChannel};
use super::{Pages, SameHostCopy, SameHostDst, SameHostSrc};
use crate::error::{FabricError, Result};

impl SameHostChannel {
    /// Enqueues the staging copy and returns what to write where once it completed. The staging
    /// buffer is `buffers[0]`. `Err`: nothing was enqueued; `Ok((Some(e), _))`: the copy failed
    /// after buffers were committed.
    pub(super) fn enqueue_to_host(
        &mut self,
        device: usize,
        src: &SameHostSrc,
        dst: &SameHostDst,
        copy: &SameHostCopy,
        buffers: &mut Vec<PinnedHostBuffer>,
    ) -> Result<(Option<FabricError>, HostWrite)> {
        let (error, pieces) = match copy {
            SameHostCopy::Contiguous { src_offset, dst_offset, len } => {
                let staging = self.pinned(device, (*len as usize).max(1))?;
                let d = self.device(device)?;
                // SAFETY: the source range was checked; staging holds `len` bytes and lives in
                // `buffers` until the event completed.
                let copied =
                    unsafe { d.stream.memcpy_dtoh_async(staging.host_ptr(), src.ptr + src_offset, *len as usize) };
                buffers.push(staging);
                (copied.err().map(Into::into), vec![(0usize, dst.base + dst_offset, *len as usize)])
            }
            SameHostCopy::Paged(pages) => self.stage_pages(device, src.ptr, dst.base, pages, buffers)?,
        };
        Ok((error, HostWrite { pid: dst.pid, same_process: dst.same_process, pieces }))
    }

    /// Gathers the source pages into consecutive staging slots with the paged-copy kernel;
    /// returns the (staging offset, remote address, length) of each page.
    #[allow(clippy::type_complexity)]
    fn stage_pages(
        &mut self,
        device: usize,
        src: u64,
        dst_base: u64,
        p: &Pages,
        buffers: &mut Vec<PinnedHostBuffer>,
    ) -> Result<(Option<FabricError>, Vec<(usize, u64, usize)>)> {
        self.kernels(device)?;
        let page_len = p.page_len as usize;
        let n = p.src_pages.len();
        let staging = self.pinned(device, (n * page_len).max(1))?;
        let mut idx = self.pinned(device, 4 * n)?;
        let bytes = idx.as_mut_slice();
        for (i, &s) in p.src_pages.iter().enumerate() {
            bytes[4 * i..4 * i + 4].copy_from_slice(&s.to_le_bytes());
        }
        let copy = PagedCopy {
            dst: staging.device_ptr(),
            dst_idx: 0,
            dst_stride: p.page_len,
            dst_offset: 0,
            ..p.gather_from(src, idx.device_ptr(), self.blocks)
        };
        let d = self.device(device)?;
        let kernels = d.kernels.as_ref().expect("loaded above");
        // SAFETY: pages checked against the source; staging holds every page; both buffers live
        // in `buffers` until the event completed.
        let error = unsafe { kernels.paged_copy(&d.stream, &copy) }.err().map(Into::into);
        buffers.push(staging);
        buffers.push(idx);
        let pieces = p
            .dst_pages
            .iter()
            .enumerate()
            .map(|(i, &d)| (i * page_len, dst_base + u64::from(d) * p.dst_stride + p.dst_offset, page_len))
            .collect();
        Ok((error, pieces))
    }
}
