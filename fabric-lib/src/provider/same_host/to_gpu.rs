//! Same-host writes into GPU memory: a copy engine for contiguous writes, the paged-copy kernel
//! for pages (host sources are first gathered into pinned staging memory the kernel can read).
use cuda_lib::{PagedCopy, PinnedHostBuffer};

use super::channel::SameHostChannel;
use super::{Pages, SameHostCopy, SameHostSrc};
use crate::descriptor::MemoryKind;
use crate::error::{FabricError, Result};

impl SameHostChannel {
    /// Enqueues a write into GPU memory at `dst_base` (as seen from `device`). `Err`: nothing was
    /// enqueued; `Ok(Some(e))`: the launch failed after buffers were committed.
    pub(super) fn enqueue_to_gpu(
        &mut self,
        device: usize,
        src: &SameHostSrc,
        dst_base: u64,
        copy: &SameHostCopy,
        buffers: &mut Vec<PinnedHostBuffer>,
    ) -> Result<Option<FabricError>> {
        match copy {
            SameHostCopy::Contiguous { src_offset, dst_offset, len } => {
                let d = self.device(device)?;
                // SAFETY: both ranges were checked against their registrations; the source stays
                // registered (in-flight count) until the copy's event completed.
                let copied =
                    unsafe { d.stream.memcpy_async(dst_base + dst_offset, src.ptr + src_offset, *len as usize) };
                Ok(copied.err().map(Into::into))
            }
            SameHostCopy::Paged(pages) => self.paged_to_gpu(device, src, dst_base, pages, buffers),
        }
    }

    fn paged_to_gpu(
        &mut self,
        device: usize,
        src: &SameHostSrc,
        dst_base: u64,
        p: &Pages,
        buffers: &mut Vec<PinnedHostBuffer>,
    ) -> Result<Option<FabricError>> {
        self.kernels(device)?;
        let n = p.src_pages.len();
        let mut idx = self.pinned(device, 8 * n)?;
        let bytes = idx.as_mut_slice();
        for (i, (&s, &d)) in p.src_pages.iter().zip(&p.dst_pages).enumerate() {
            bytes[4 * i..4 * i + 4].copy_from_slice(&s.to_le_bytes());
            bytes[4 * (n + i)..4 * (n + i) + 4].copy_from_slice(&d.to_le_bytes());
        }
        let mut copy = PagedCopy {
            dst: dst_base,
            dst_idx: idx.device_ptr() + 4 * n as u64,
            dst_stride: p.dst_stride,
            dst_offset: p.dst_offset,
            ..p.gather_from(src.ptr, idx.device_ptr(), self.blocks)
        };
        if src.kind == MemoryKind::Host {
            let staging = self.gather_host_pages(device, src.ptr, p)?;
            // The kernel copies page i from staging slot i.
            copy.src = staging.device_ptr();
            copy.src_idx = 0;
            copy.src_stride = p.page_len;
            copy.src_offset = 0;
            buffers.push(staging);
        }
        buffers.push(idx);
        let d = self.device(device)?;
        let kernels = d.kernels.as_ref().expect("loaded above");
        // SAFETY: every page was checked against both regions; index arrays and staging live in
        // `buffers` until the copy's event completed.
        Ok(unsafe { kernels.paged_copy(&d.stream, &copy) }.err().map(Into::into))
    }

    /// Copies the (pageable) source pages into pinned staging memory, page i into slot i.
    fn gather_host_pages(&mut self, device: usize, src: u64, p: &Pages) -> Result<PinnedHostBuffer> {
        let page_len = p.page_len as usize;
        let mut staging = self.pinned(device, p.src_pages.len() * page_len)?;
        let out = staging.as_mut_slice();
        for (i, &s) in p.src_pages.iter().enumerate() {
            let from = src + u64::from(s) * p.src_stride + p.src_offset;
            // SAFETY: the page lies inside the registered source region (checked by the engine),
            // which stays registered meanwhile.
            let page = unsafe { std::slice::from_raw_parts(from as *const u8, page_len) };
            out[i * page_len..(i + 1) * page_len].copy_from_slice(page);
        }
        Ok(staging)
    }
}
