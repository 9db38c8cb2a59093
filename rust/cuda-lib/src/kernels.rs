//! The kernels of `kernels/*.cu`, compiled by build.rs into one embedded fatbin.
use std::{ffi::c_void, sync::Arc, time::Duration};

use crate::{
    context::Context,
    error::{CudaError, Result},
    module::{Function, LaunchConfig, Module},
    paged_copy::PagedCopy,
    stream::Stream,
};

crate::embed_kernels!("CUDA_LIB_FATBIN", "CUDA_LIB_KERNEL_ARCHS");

/// Whether this build carries the kernels.
pub fn kernels_available() -> bool {
    kernel_image().is_ok()
}

/// The embedded kernels loaded into one context. Launches are `unsafe`: they take raw addresses.
#[derive(Debug)]
pub struct Kernels {
    ctx: Arc<Context>,
    paged_copy: [Function; 4], // 16, 8, 4, 1-byte accesses
    write_u64: Function,
    flag_poll: Function,
    clock_khz: u64,
}

/// SM clock assumed when the driver reports none (clock64 timeouts only need the right order).
const FALLBACK_CLOCK_KHZ: u64 = 2_000_000;

impl Kernels {
    /// Loads the embedded fatbin into `ctx`.
    pub fn load(ctx: &Arc<Context>) -> Result<Self> {
        let image = kernel_image()?;
        let module = Module::load(ctx, image)?;
        Ok(Kernels {
            ctx: ctx.clone(),
            paged_copy: [
                module.function("fabric_paged_copy_16")?,
                module.function("fabric_paged_copy_8")?,
                module.function("fabric_paged_copy_4")?,
                module.function("fabric_paged_copy_1")?,
            ],
            write_u64: module.function("fabric_write_u64")?,
            flag_poll: module.function("fabric_flag_poll")?,
            clock_khz: ctx.device().clock_rate_khz().map_or(FALLBACK_CLOCK_KHZ, u64::from),
        })
    }

    /// The context the kernels are loaded in.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Enqueues a paged copy (see [`PagedCopy`]) on `stream`; returns without launching when
    /// there is nothing to copy.
    ///
    /// # Safety
    /// Every source page must be readable and every destination page writable from this device
    /// (peer memory: access granted / enabled), the index arrays must hold `num_pages` valid
    /// `u32`s, destination pages must not overlap each other or any source page, and all of it
    /// must stay allocated until the copy completed.
    pub unsafe fn paged_copy(&self, stream: &Stream, copy: &PagedCopy) -> Result<()> {
        let Some(plan) = copy.plan()? else {
            return Ok(());
        };
        let function = match plan.vector_bytes {
            16 => &self.paged_copy[0],
            8 => &self.paged_copy[1],
            4 => &self.paged_copy[2],
            _ => &self.paged_copy[3],
        };
        let (mut dst, mut src, mut dst_idx, mut src_idx) = (copy.dst, copy.src, copy.dst_idx, copy.src_idx);
        let (mut dst_stride, mut dst_off, mut src_stride, mut src_off, mut page_len) =
            (copy.dst_stride, copy.dst_offset, copy.src_stride, copy.src_offset, copy.page_len);
        let (mut num_pages, mut group_threads) = (copy.num_pages, plan.group_threads);
        let mut params: [*mut c_void; 11] = [
            (&mut dst as *mut u64).cast(),
            (&mut src as *mut u64).cast(),
            (&mut dst_idx as *mut u64).cast(),
            (&mut src_idx as *mut u64).cast(),
            (&mut dst_stride as *mut u64).cast(),
            (&mut dst_off as *mut u64).cast(),
            (&mut src_stride as *mut u64).cast(),
            (&mut src_off as *mut u64).cast(),
            (&mut page_len as *mut u64).cast(),
            (&mut num_pages as *mut u32).cast(),
            (&mut group_threads as *mut u32).cast(),
        ];
        // SAFETY: the parameters match `fabric_paged_copy_*`'s signature (pointers as u64, u64
        // strides/offsets/len, u32 count and group size); the caller guarantees the memory.
        unsafe { function.launch(stream, LaunchConfig::linear(plan.blocks, plan.threads), &mut params) }
    }

    /// Enqueues a one-thread kernel that stores `value` at `addr` with release semantics at
    /// system scope (the "bump watcher" a UVM/flag watcher on the CPU observes). Capturable in
    /// CUDA graphs.
    ///
    /// # Safety
    /// `addr` must be an 8-byte aligned word writable from this device (device, peer or mapped
    /// pinned host memory) that stays allocated until the kernel ran.
    pub unsafe fn write_u64(&self, stream: &Stream, addr: u64, value: u64) -> Result<()> {
        check_aligned(addr, 8, "write_u64 address")?;
        let (mut addr, mut value) = (addr, value);
        let mut params: [*mut c_void; 2] = [(&mut addr as *mut u64).cast(), (&mut value as *mut u64).cast()];
        // SAFETY: matches `fabric_write_u64(uint64_t*, uint64_t)`; the caller guarantees `addr`.
        unsafe { self.write_u64.launch(stream, LaunchConfig::linear(1, 32), &mut params) }
    }

    /// Enqueues a one-thread kernel that spins (acquire loads, system scope) until the word at
    /// `flag` equals `expected` or `timeout` passed (measured in SM clock cycles), then stores 0
    /// (seen) or 1 (timed out) as a `u32` at `status`. Later work on `stream` waits for it.
    ///
    /// # Safety
    /// `flag` (8-byte aligned) must be readable and `status` (4-byte aligned) writable from this
    /// device until the kernel finished; the kernel occupies one SM slot while it spins.
    pub unsafe fn flag_poll(
        &self,
        stream: &Stream,
        flag: u64,
        expected: u64,
        timeout: Duration,
        status: u64,
    ) -> Result<()> {
        check_aligned(flag, 8, "flag address")?;
        check_aligned(status, 4, "status address")?;
        let (mut flag, mut expected, mut cycles, mut status) = (flag, expected, self.timeout_cycles(timeout), status);
        let mut params: [*mut c_void; 4] = [
            (&mut flag as *mut u64).cast(),
            (&mut expected as *mut u64).cast(),
            (&mut cycles as *mut u64).cast(),
            (&mut status as *mut u64).cast(),
        ];
        // SAFETY: matches `fabric_flag_poll(const uint64_t*, uint64_t, uint64_t, uint32_t*)`;
        // the caller guarantees both addresses.
        unsafe { self.flag_poll.launch(stream, LaunchConfig::linear(1, 32), &mut params) }
    }

    /// `timeout` in SM clock cycles (what `clock64()` counts).
    pub fn timeout_cycles(&self, timeout: Duration) -> u64 {
        let cycles = timeout.as_nanos().saturating_mul(u128::from(self.clock_khz)) / 1_000_000;
        u64::try_from(cycles).unwrap_or(u64::MAX)
    }
}

fn check_aligned(addr: u64, align: u64, what: &str) -> Result<()> {
    if addr == 0 || addr % align != 0 {
        return Err(CudaError::InvalidArgument(format!("{what} {addr:#x} must be non-null and {align}-byte aligned")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_match_the_build() {
        if cfg!(cuda_kernels_missing) {
            assert_eq!(kernel_image(), Err(CudaError::KernelsUnavailable));
            assert!(!kernels_available());
            assert_eq!(kernel_archs(), "");
            let msg = CudaError::KernelsUnavailable.to_string();
            assert!(msg.contains("nvcc 13.0") && msg.contains("scripts/setup.sh"), "{msg}");
        } else {
            let image = kernel_image().unwrap();
            assert!(image.len() > 1000);
            assert_eq!(image.as_ptr() as usize % 16, 0);
            // Fatbin magic 0xBA55ED50, little-endian.
            assert_eq!(&image[..4], &[0x50, 0xed, 0x55, 0xba]);
            assert!(kernel_archs().contains("sm_90a"));
        }
    }
}
