//! Library-owned, registered buffers for two-sided messages and zero-byte immediates.
use crate::error::Result;
use crate::provider::libfabric::{Access, LibfabricDomain, LocalMr};

/// `count` slots of `slot_size` bytes in one registered allocation.
pub struct MsgBuffers {
    // Declared before `mem`: the registration is closed before the memory is freed.
    mr: LocalMr,
    mem: Box<[u8]>,
    slot_size: usize,
}

impl MsgBuffers {
    /// Allocates and registers the slots on `domain` with `access`.
    pub fn new(domain: &mut LibfabricDomain, count: usize, slot_size: usize, access: Access) -> Result<Self> {
        let mut mem = vec![0u8; count.max(1) * slot_size.max(1)].into_boxed_slice();
        let mr = domain.register(mem.as_mut_ptr(), mem.len(), access)?;
        Ok(MsgBuffers { mr, mem, slot_size: slot_size.max(1) })
    }

    /// Pointer to the start of `slot`.
    pub fn slot_ptr(&mut self, slot: usize) -> *mut u8 {
        self.mem[slot * self.slot_size..].as_mut_ptr()
    }

    /// The first `len` bytes of `slot`.
    pub fn slot_bytes(&self, slot: usize, len: usize) -> &[u8] {
        let start = slot * self.slot_size;
        &self.mem[start..start + len.min(self.slot_size)]
    }

    /// Copies `data` into `slot` (the caller checked it fits).
    pub fn fill(&mut self, slot: usize, data: &[u8]) {
        let start = slot * self.slot_size;
        self.mem[start..start + data.len()].copy_from_slice(data);
    }

    pub fn slot_size(&self) -> usize {
        self.slot_size
    }

    pub fn desc(&self) -> *mut std::ffi::c_void {
        self.mr.desc()
    }

    pub fn key(&self) -> u64 {
        self.mr.key()
    }

    pub fn remote_base(&self) -> u64 {
        self.mr.remote_base()
    }
}
