//! Per-operation contexts handed to libfabric. They start with the provider-owned scratch area
//! (FI_CONTEXT/FI_CONTEXT2 mode) and stay at a fixed address until their completion is read.
use libfabric_sys::fi_context2;

/// What a completed context stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    /// One posted write of `request`, reading from registered region `region` (0: scratch).
    Write { request: u64, region: u64 },
    /// One posted read of `request`, landing in registered region `region`.
    Read { request: u64, region: u64 },
    /// A posted send of `request` from send buffer `slot` of `domain`.
    Send { request: u64, slot: usize, domain: u16 },
    /// A posted receive buffer `slot` of `domain`.
    Recv { slot: usize, domain: u16 },
}

/// The context of one posted operation. `#[repr(C)]` so the provider's area comes first.
#[repr(C)]
pub struct OpContext {
    provider_area: fi_context2,
    /// What to do when this operation completes.
    pub kind: OpKind,
}

impl OpContext {
    /// A boxed context, ready to be leaked into a post.
    pub fn new(kind: OpKind) -> Box<Self> {
        Box::new(OpContext { provider_area: fi_context2::default(), kind })
    }

    /// Makes a context whose operation completed (or was never taken) ready for another post,
    /// as if it were new: the same box, so posting allocates nothing.
    pub fn reuse(mut self: Box<Self>, kind: OpKind) -> Box<Self> {
        self.provider_area = fi_context2::default();
        self.kind = kind;
        self
    }
}
