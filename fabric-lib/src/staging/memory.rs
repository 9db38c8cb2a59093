//! The memory staged bytes pass through, and the copies in and out of it.
//!
//! Bounce buffers and landing areas are page-locked host memory (CUDA copies to and from them
//! are asynchronous), registered with the NIC by the worker. Copies run on the engine's own
//! non-blocking streams, two per device (one per direction, so copies out of and into GPU
//! memory overlap), and end with an event the worker polls: nothing here ever blocks the
//! worker. Host memory (the `stage_host_memory` testing aid) is copied by memcpy at once.
use std::alloc::Layout;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::descriptor::MemoryKind;
use crate::error::{FabricError, Result};

/// Memory of a bounce buffer or a landing area.
pub(crate) enum StagingMemory {
    /// Page-locked with CUDA (portable: every context copies to and from it asynchronously).
    Pinned(cuda_lib::PinnedHostBuffer),
    /// Ordinary page-aligned host memory (no GPU involved).
    Host { ptr: NonNull<u8>, layout: Layout },
}

impl StagingMemory {
    /// `len` bytes, pinned through the context of `device`, or plain host memory for `None`.
    pub fn new(device: Option<u32>, len: usize) -> Result<Self> {
        match device {
            Some(device) => {
                let ctx = cuda_lib::Context::new(device as usize)?;
                Ok(StagingMemory::Pinned(cuda_lib::PinnedHostBuffer::new(&ctx, len)?))
            }
            None => {
                let layout = Layout::from_size_align(len.max(1), 4096)
                    .map_err(|e| FabricError::InvalidArgument(format!("staging memory of {len} bytes: {e}")))?;
                // SAFETY: the layout has a non-zero size.
                let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).ok_or_else(|| {
                    FabricError::InvalidArgument(format!("cannot allocate {len} bytes of staging memory"))
                })?;
                Ok(StagingMemory::Host { ptr, layout })
            }
        }
    }

    pub fn ptr(&self) -> *mut u8 {
        match self {
            StagingMemory::Pinned(b) => b.host_ptr(),
            StagingMemory::Host { ptr, .. } => ptr.as_ptr(),
        }
    }
}

impl Drop for StagingMemory {
    fn drop(&mut self) {
        if let StagingMemory::Host { ptr, layout } = self {
            // SAFETY: allocated in `new` with this layout, freed once.
            unsafe { std::alloc::dealloc(ptr.as_ptr(), *layout) };
        }
    }
}

/// Which way a staging copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Out of the source region into a bounce slot.
    ToStaging,
    /// Out of a landing slot into the destination region.
    FromStaging,
}

/// A copy in progress; `None` when it completed at once (host memory).
pub(crate) struct Copying(Option<cuda_lib::Event>);

impl Copying {
    /// Whether the copied bytes are in place (a failed copy is an error).
    pub fn is_done(&self) -> Result<bool> {
        match &self.0 {
            None => Ok(true),
            Some(event) => Ok(event.is_complete()?),
        }
    }
}

struct DeviceStreams {
    ctx: Arc<cuda_lib::Context>,
    to_staging: cuda_lib::Stream,
    from_staging: cuda_lib::Stream,
}

/// The engine's copy streams, opened per device on first use.
#[derive(Default)]
pub(crate) struct Copier {
    devices: HashMap<u32, DeviceStreams>,
}

impl Copier {
    fn streams(&mut self, device: u32) -> Result<&DeviceStreams> {
        if let std::collections::hash_map::Entry::Vacant(slot) = self.devices.entry(device) {
            let ctx = cuda_lib::Context::new(device as usize)?;
            let to_staging = cuda_lib::Stream::new(&ctx)?;
            let from_staging = cuda_lib::Stream::new(&ctx)?;
            slot.insert(DeviceStreams { ctx, to_staging, from_staging });
        }
        Ok(&self.devices[&device])
    }

    /// Starts copying `pieces` (destination address, source address, length) between memory
    /// of `kind` (the region's side) and staging memory.
    ///
    /// # Safety
    /// Every range must be valid for the copy and stay allocated, and the destination ranges
    /// untouched by anyone else, until the returned copy reports done.
    pub unsafe fn copy(
        &mut self,
        kind: MemoryKind,
        direction: Direction,
        pieces: &[(u64, u64, u64)],
    ) -> Result<Copying> {
        let device = match kind {
            MemoryKind::Host => {
                for &(dst, src, len) in pieces {
                    // SAFETY: the caller guarantees both ranges; staging slots and regions are
                    // distinct allocations, so they never overlap.
                    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len as usize) };
                }
                return Ok(Copying(None));
            }
            MemoryKind::Cuda(device) => device,
        };
        let streams = self.streams(device)?;
        let stream = match direction {
            Direction::ToStaging => &streams.to_staging,
            Direction::FromStaging => &streams.from_staging,
        };
        for &(dst, src, len) in pieces {
            // SAFETY: as the caller guarantees; staging memory is pinned, so both are async.
            unsafe {
                match direction {
                    Direction::ToStaging => stream.memcpy_dtoh_async(dst as *mut u8, src, len as usize)?,
                    Direction::FromStaging => stream.memcpy_htod_async(dst, src as *const u8, len as usize)?,
                }
            }
        }
        let event = cuda_lib::Event::new(&streams.ctx, false)?;
        event.record(stream)?;
        Ok(Copying(Some(event)))
    }

    /// Waits for every copy issued (shutdown only: staging memory is freed next).
    pub fn synchronize(&self) {
        for streams in self.devices.values() {
            for stream in [&streams.to_staging, &streams.from_staging] {
                if let Err(e) = stream.synchronize() {
                    tracing::warn!("waiting for staging copies at shutdown: {e}");
                }
            }
        }
    }
}
