//! The same-host channel: writes between processes (or engines) of one host where either side is
//! GPU memory, carried out by CUDA instead of the NIC.
//!
//! - GPU → GPU: the destination allocation is opened once through its legacy IPC handle (cached
//!   per (owner process, handle, local device); a region of this very process is used through its
//!   pointer, since CUDA refuses to open a handle in the process that exported it). Contiguous
//!   writes are one `cuMemcpyAsync` (copy engines, no SMs); paged writes are one launch of
//!   cuda-lib's paged-copy kernel (`paged_copy_blocks` blocks, default 16) with both page index
//!   arrays in mapped pinned host memory.
//! - host → GPU: contiguous: `cuMemcpyAsync` from the (pageable) source into the IPC-mapped peer
//!   memory; paged: the worker gathers the source pages into pinned staging memory, then the
//!   kernel scatters them from there.
//! - GPU → host: the peer's host memory cannot be opened through CUDA, so the data goes to
//!   local pinned staging memory first (copy engine, or the kernel for pages), and once that
//!   completed the worker writes it into the peer process with `process_vm_writev` (a plain
//!   copy when the peer is this process). Needs ptrace permission over the peer (same user and
//!   Yama `ptrace_scope` 0, or CAP_SYS_PTRACE).
//!
//! - host → host (only with `same_host_host_memory`): the worker writes into the peer with
//!   `process_vm_writev` itself (`host_copy`), no CUDA involved.
//!
//! Reads (a peer region into a local one, GPU memory on either side) mirror these paths; see
//! `read.rs`.
//!
//! Every copy runs on a worker-owned stream per device and ends with an event; the worker polls
//! those events alongside its completion queues (never a blocking synchronize). Completions of
//! one device come in submission order.
//!
//! Immediates: once the data is visible, the writer pushes the immediate into the destination
//! engine's shared-memory inbox (`inbox`), or where the peer has none (or it cannot be mapped)
//! announces it with a zero-byte write over the provider.
use crate::descriptor::{CudaIpc, MemoryKind};
use crate::error::Result;

mod channel;
mod host_copy;
mod inbox;
mod process_vm;
mod read;
mod to_gpu;
mod to_host;

pub(crate) use channel::SameHostChannel;
pub(crate) use host_copy::copy_host_to_host;
pub(crate) use inbox::{Inbox, PeerInbox, MAX_INBOX_SLOTS};

/// The local side of a same-host write.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SameHostSrc {
    pub kind: MemoryKind,
    pub ptr: u64,
}

/// The destination region as its descriptor describes it.
#[derive(Clone, Debug)]
pub(crate) struct SameHostDst {
    pub kind: MemoryKind,
    /// The region's address in its owner's process.
    pub base: u64,
    /// The region's length (as its descriptor says; checked against the opened allocation).
    pub len: u64,
    pub pid: u32,
    /// The owner's random process id (cache key).
    pub process: u64,
    pub same_process: bool,
    pub cuda: Option<CudaIpc>,
}

/// Page `i` moves `page_len` bytes from `src_pages[i] * src_stride + src_offset` to
/// `dst_pages[i] * dst_stride + dst_offset`.
#[derive(Clone, Debug)]
pub(crate) struct Pages {
    pub page_len: u64,
    pub src_pages: Vec<u32>,
    pub src_stride: u64,
    pub src_offset: u64,
    pub dst_pages: Vec<u32>,
    pub dst_stride: u64,
    pub dst_offset: u64,
}

impl Pages {
    /// A paged-copy kernel launch reading these pages from `src` (page indices at `src_idx`),
    /// with the destination side left for the caller to fill in.
    pub(crate) fn gather_from(&self, src: u64, src_idx: u64, blocks: u32) -> cuda_lib::PagedCopy {
        cuda_lib::PagedCopy {
            src,
            src_idx,
            src_stride: self.src_stride,
            src_offset: self.src_offset,
            page_len: self.page_len,
            num_pages: self.src_pages.len() as u32,
            blocks,
            ..Default::default()
        }
    }
}

/// What to copy (already checked against both regions).
#[derive(Clone, Debug)]
pub(crate) enum SameHostCopy {
    Contiguous { src_offset: u64, dst_offset: u64, len: u64 },
    Paged(Pages),
}

/// A finished same-host copy: (request, source region, result).
pub(crate) type SameHostDone = (u64, u64, Result<()>);
