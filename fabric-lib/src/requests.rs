//! The requests callers build: single and paged writes, scatter targets, peer groups.
use crate::descriptor::MrDescriptor;
use crate::engine::MrHandle;
use crate::sharding::DomainChoice;

/// One single write: `len` bytes from a local region to a peer's region, optionally with an
/// immediate that the peer counts once the bytes are in place.
#[derive(Clone, Copy, Debug)]
pub struct WriteRequest<'a> {
    pub src: MrHandle,
    pub src_offset: u64,
    pub len: u64,
    pub dst: &'a MrDescriptor,
    pub dst_offset: u64,
    pub imm: Option<u32>,
    /// How the bytes are spread over the device's domains.
    pub domains: DomainChoice,
}

/// Fixed-size pages gathered from a local region and scattered into a peer region:
/// page `i` moves `page_len` bytes from `src_pages[i] * src_stride + src_offset` to
/// `dst_pages[i] * dst_stride + dst_offset`. Pages are spread over every domain.
#[derive(Clone, Copy, Debug)]
pub struct PagedWriteRequest<'a> {
    pub page_len: u64,
    pub src: MrHandle,
    pub src_pages: &'a [u32],
    pub src_stride: u64,
    pub src_offset: u64,
    pub dst: &'a MrDescriptor,
    pub dst_pages: &'a [u32],
    pub dst_stride: u64,
    pub dst_offset: u64,
    pub imm: Option<u32>,
}

/// One read: `len` bytes of a peer's (remotely readable) region, from `src_offset`, into a
/// local region at `dst_offset`. Completes once the bytes are in the local region.
#[derive(Clone, Copy, Debug)]
pub struct ReadRequest<'a> {
    pub src: &'a MrDescriptor,
    pub src_offset: u64,
    pub len: u64,
    pub dst: MrHandle,
    pub dst_offset: u64,
    /// How the bytes are spread over the device's domains.
    pub domains: DomainChoice,
}

/// Fixed-size pages gathered from a peer region into a local region (the mirror of
/// [`PagedWriteRequest`]): page `i` moves `page_len` bytes from the peer's
/// `src_pages[i] * src_stride + src_offset` to the local `dst_pages[i] * dst_stride + dst_offset`.
#[derive(Clone, Copy, Debug)]
pub struct PagedReadRequest<'a> {
    pub page_len: u64,
    pub src: &'a MrDescriptor,
    pub src_pages: &'a [u32],
    pub src_stride: u64,
    pub src_offset: u64,
    pub dst: MrHandle,
    pub dst_pages: &'a [u32],
    pub dst_stride: u64,
    pub dst_offset: u64,
}

/// One destination of a scatter.
#[derive(Clone, Copy, Debug)]
pub struct ScatterTarget<'a> {
    pub len: u64,
    pub src_offset: u64,
    pub dst: &'a MrDescriptor,
    pub dst_offset: u64,
}

/// One slice of a prepared scatter (see [`crate::TransferEngine::submit_prepared_scatter`]):
/// `len` bytes from `src_offset` of the source into destination `dst` (its index in the
/// prepared list) at `dst_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScatterSlice {
    pub dst: usize,
    pub src_offset: u64,
    pub len: u64,
    pub dst_offset: u64,
}

/// How a scatter is spread over domains.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScatterSharding {
    /// Each target whole on one domain, targets rotating over the domains.
    ByPeer,
    /// Each target's bytes sharded over all domains like a single write.
    ByBytes,
}

/// A handle returned by [`crate::TransferEngine::add_peer_group`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PeerGroup(pub u64);
