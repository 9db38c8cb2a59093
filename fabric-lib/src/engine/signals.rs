//! GPU-side signals: UVM watchers (kernels write, a callback runs) and GPU flags (a count is
//! reached, a word kernels poll is set).
use super::TransferEngine;
use crate::error::{FabricError, Result};
use crate::gpu::{GpuFlag, UvmWatcher, WatcherCallback, WatcherRunsOn};
use crate::imm_counter::OnReached;

impl TransferEngine {
    /// Allocates a UVM watcher on `device`: a 64-bit word in mapped pinned host memory that
    /// kernels (also inside CUDA graphs) write; `callback(old, new)` runs on the callback thread
    /// after every change a per-device polling thread sees.
    pub fn alloc_uvm_watcher(&self, device: usize, callback: WatcherCallback) -> Result<UvmWatcher> {
        self.alloc_uvm_watcher_on(device, callback, WatcherRunsOn::CallbackThread)
    }

    /// [`TransferEngine::alloc_uvm_watcher`] with the choice of the thread the callback runs on
    /// ([`WatcherRunsOn::WatcherThread`]: the polling thread itself, no hand-off).
    pub fn alloc_uvm_watcher_on(
        &self,
        device: usize,
        callback: WatcherCallback,
        runs_on: WatcherRunsOn,
    ) -> Result<UvmWatcher> {
        if self.is_stopped() {
            return Err(FabricError::Stopped);
        }
        self.watchers.alloc(
            device,
            self.config.uvm_watcher_cpu,
            self.config.poll_mode,
            self.callbacks.queue(),
            callback,
            runs_on,
        )
    }

    /// Allocates a GPU flag on `device` (a word kernels poll; set from the CPU or by an
    /// ImmCounter, see [`TransferEngine::set_imm_count_expected_flag`]).
    pub fn alloc_gpu_flag(&self, device: usize) -> Result<GpuFlag> {
        GpuFlag::new(device)
    }

    /// Stores `value` into `flag` once `imm` has arrived `n` times (no Python involved; the
    /// store runs on the engine's callback thread right after the count is reached). Then
    /// `on_reached`, if given, runs.
    pub fn set_imm_count_expected_flag(
        &self,
        imm: u32,
        n: u64,
        flag: GpuFlag,
        value: u64,
        on_reached: Option<OnReached>,
    ) -> Result<()> {
        self.set_imm_count_expected(
            imm,
            n,
            Box::new(move || {
                flag.set(value);
                if let Some(cb) = on_reached {
                    cb();
                }
            }),
        )
    }
}
