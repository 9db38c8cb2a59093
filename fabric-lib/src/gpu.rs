//! GPU-side helpers of the engine: memory-kind detection, UVM watchers (GPU-written words a CPU
//! thread watches), GPU flags (CPU-written words kernels poll) and a small stream for launching
//! cuda-lib's signalling kernels from Python.
//!
//! Nothing here touches CUDA before it is used: importing or creating a host-only engine never
//! loads libcuda.
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::callback::CallbackQueue;
use crate::config::PollMode;
use crate::descriptor::MemoryKind;
use crate::error::{FabricError, Result};

/// Whether libcuda is already loaded in this process (without loading it). A device pointer can
/// only exist in a process that loaded the driver.
pub fn cuda_loaded() -> bool {
    for name in [c"libcuda.so.1", c"libcuda.so"] {
        // SAFETY: RTLD_NOLOAD only looks the library up; a returned handle is closed at once.
        let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
        if !h.is_null() {
            // SAFETY: `h` came from dlopen just above.
            unsafe { libc::dlclose(h) };
            return true;
        }
    }
    false
}

/// Where `ptr` points: device memory of some ordinal, or host memory (also when CUDA is not
/// loaded in this process, without loading it).
pub fn detect_memory_kind(ptr: u64) -> MemoryKind {
    if !cuda_loaded() {
        return MemoryKind::Host;
    }
    match cuda_lib::pointer_device(ptr) {
        Some(d) => MemoryKind::Cuda(d as u32),
        None => MemoryKind::Host,
    }
}

/// Whether this build embeds cuda-lib's kernels (nvcc was present at build time).
pub fn kernels_available() -> bool {
    cuda_lib::kernels_available()
}

/// Architectures of the embedded kernels, e.g. "sm_90a,sm_100a" (empty without kernels).
pub fn kernel_archs() -> &'static str {
    cuda_lib::kernel_archs()
}

/// Number of visible CUDA devices, or the reason there are none usable.
pub fn device_count() -> Result<usize> {
    Ok(cuda_lib::device_count()?)
}

fn context(device: usize) -> Result<Arc<cuda_lib::Context>> {
    let n = cuda_lib::device_count()?;
    if device >= n {
        return Err(FabricError::InvalidArgument(format!("CUDA device {device} does not exist ({n} visible)")));
    }
    Ok(cuda_lib::Context::new(device)?)
}

/// A 64-bit word in mapped pinned host memory: kernels read or write it through
/// [`GpuWord::device_ptr`], the CPU through atomics. (No GDRCopy: hosts without
/// `/dev/gdrdrv`; mapped host memory costs about 1.5 µs one way.)
pub struct GpuWord {
    buf: cuda_lib::PinnedHostBuffer,
    device: usize,
}

impl GpuWord {
    fn new(device: usize) -> Result<Self> {
        let ctx = context(device)?;
        Ok(GpuWord { buf: cuda_lib::PinnedHostBuffer::new(&ctx, 64)?, device })
    }

    /// The address kernels use (8-byte aligned).
    pub fn device_ptr(&self) -> u64 {
        self.buf.device_ptr()
    }

    /// The device it was allocated for.
    pub fn device(&self) -> usize {
        self.device
    }

    fn word(&self) -> &AtomicU64 {
        self.buf.atomic_u64(0)
    }

    /// Current value (acquire).
    pub fn get(&self) -> u64 {
        self.word().load(Ordering::Acquire)
    }

    /// Stores `value` (release: earlier CPU writes are visible to a kernel that sees it).
    pub fn set(&self, value: u64) {
        self.word().store(value, Ordering::Release)
    }
}

/// A CPU→GPU flag: the CPU (or an ImmCounter reaching its count) sets it, kernels poll it.
#[derive(Clone)]
pub struct GpuFlag(Arc<GpuWord>);

impl GpuFlag {
    /// Allocates a flag (value 0) visible to `device`.
    pub fn new(device: usize) -> Result<Self> {
        Ok(GpuFlag(Arc::new(GpuWord::new(device)?)))
    }

    /// The address kernels poll.
    pub fn device_ptr(&self) -> u64 {
        self.0.device_ptr()
    }

    /// The device it was allocated for.
    pub fn device(&self) -> usize {
        self.0.device()
    }

    /// Sets the flag.
    pub fn set(&self, value: u64) {
        self.0.set(value)
    }

    /// Reads the flag.
    pub fn get(&self) -> u64 {
        self.0.get()
    }
}

/// Called with (previous value, new value) when a watched word changes.
pub type WatcherCallback = Arc<dyn Fn(u64, u64) + Send + Sync + 'static>;

/// Where a watcher's callback runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WatcherRunsOn {
    /// The engine's callback thread (the watcher thread hands each change over): a slow
    /// callback delays nothing but other callbacks.
    #[default]
    CallbackThread,
    /// The watcher thread itself, right when it sees the change: no hand-off, the lowest
    /// latency; while it runs, the device's other watchers are not polled, so keep it short.
    WatcherThread,
}

struct WatchSlot {
    word: GpuWord,
    callback: WatcherCallback,
    runs_on: WatcherRunsOn,
    closed: AtomicBool,
}

struct WatcherShared {
    slots: Mutex<Vec<Arc<WatchSlot>>>,
    generation: AtomicU64,
    stop: AtomicBool,
}

/// One polling thread per device for all of an engine's UVM watchers on it.
pub(crate) struct WatcherThread {
    shared: Arc<WatcherShared>,
    handle: Mutex<Option<JoinHandle<()>>>,
}

impl WatcherThread {
    fn spawn(device: usize, cpu: Option<usize>, poll_mode: PollMode, callbacks: CallbackQueue) -> Result<Arc<Self>> {
        let shared = Arc::new(WatcherShared {
            slots: Mutex::new(Vec::new()),
            generation: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let handle = std::thread::Builder::new()
            .name(format!("fabric-uvm-{device}"))
            .spawn(move || {
                if let Some(cpu) = cpu {
                    if !core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
                        tracing::warn!("could not pin the UVM watcher thread to CPU {cpu}");
                    }
                }
                watch(s, poll_mode, callbacks)
            })
            .map_err(|e| FabricError::InvalidArgument(format!("cannot spawn the UVM watcher thread: {e}")))?;
        Ok(Arc::new(WatcherThread { shared, handle: Mutex::new(Some(handle)) }))
    }

    fn add(&self, slot: Arc<WatchSlot>) {
        self.shared.slots.lock().push(slot);
        self.shared.generation.fetch_add(1, Ordering::Release);
        if let Some(h) = self.handle.lock().as_ref() {
            h.thread().unpark();
        }
    }

    fn remove(&self, slot: &Arc<WatchSlot>) {
        self.shared.slots.lock().retain(|s| !Arc::ptr_eq(s, slot));
        self.shared.generation.fetch_add(1, Ordering::Release);
    }

    pub(crate) fn stop(&self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(h) = self.handle.lock().take() {
            h.thread().unpark();
            let _ = h.join();
        }
    }
}

fn watch(shared: Arc<WatcherShared>, poll_mode: PollMode, callbacks: CallbackQueue) {
    let mut generation = u64::MAX;
    let mut slots: Vec<(Arc<WatchSlot>, u64)> = Vec::new();
    let mut last_change = Instant::now();
    while !shared.stop.load(Ordering::Acquire) {
        let g = shared.generation.load(Ordering::Acquire);
        if g != generation {
            generation = g;
            let current = shared.slots.lock().clone();
            let mut next = Vec::with_capacity(current.len());
            for s in current {
                let last = slots.iter().find(|(o, _)| Arc::ptr_eq(o, &s)).map_or(0, |(_, v)| *v);
                next.push((s, last));
            }
            slots = next;
        }
        if slots.is_empty() {
            std::thread::park_timeout(Duration::from_millis(20));
            continue;
        }
        let mut changed = false;
        for (slot, last) in slots.iter_mut() {
            let now = slot.word.get();
            if now != *last && !slot.closed.load(Ordering::Relaxed) {
                let (old, cb) = (*last, slot.callback.clone());
                *last = now;
                changed = true;
                match slot.runs_on {
                    WatcherRunsOn::CallbackThread => callbacks.push(Box::new(move || cb(old, now))),
                    WatcherRunsOn::WatcherThread => {
                        // A panicking callback must not end the watching of the others.
                        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cb(old, now))).is_err() {
                            tracing::error!("a UVM watcher callback panicked (change {old} -> {now})");
                        }
                    }
                }
            }
        }
        if changed {
            last_change = Instant::now();
            continue;
        }
        match poll_mode {
            PollMode::Adaptive { spin, park } if last_change.elapsed() > spin => std::thread::park_timeout(park),
            _ => std::hint::spin_loop(),
        }
    }
}

/// A GPU-written 64-bit word (in mapped pinned host memory) that a CPU thread watches; every
/// change is reported as `callback(old, new)` on the engine's callback thread (changes between
/// two polls are coalesced: `new` is the latest value). Kernels, also inside CUDA graphs, write
/// [`UvmWatcher::device_ptr`]. Dropping the watcher stops watching.
pub struct UvmWatcher {
    slot: Arc<WatchSlot>,
    thread: Arc<WatcherThread>,
}

impl UvmWatcher {
    /// The address kernels write (8-byte aligned).
    pub fn device_ptr(&self) -> u64 {
        self.slot.word.device_ptr()
    }

    /// The device it was allocated for.
    pub fn device(&self) -> usize {
        self.slot.word.device()
    }

    /// The word's current value.
    pub fn value(&self) -> u64 {
        self.slot.word.get()
    }

    /// Stops watching (also done on drop).
    pub fn close(&self) {
        if !self.slot.closed.swap(true, Ordering::AcqRel) {
            self.thread.remove(&self.slot);
        }
    }
}

impl Drop for UvmWatcher {
    fn drop(&mut self) {
        self.close();
    }
}

/// The engine's watcher threads, one per device, started on first use.
pub(crate) struct Watchers {
    threads: Mutex<HashMap<usize, Arc<WatcherThread>>>,
    stopped: AtomicBool,
}

impl Watchers {
    pub fn new() -> Self {
        Watchers { threads: Mutex::new(HashMap::new()), stopped: AtomicBool::new(false) }
    }

    pub fn alloc(
        &self,
        device: usize,
        cpu: Option<usize>,
        poll_mode: PollMode,
        callbacks: CallbackQueue,
        callback: WatcherCallback,
        runs_on: WatcherRunsOn,
    ) -> Result<UvmWatcher> {
        if self.stopped.load(Ordering::Acquire) {
            return Err(FabricError::Stopped);
        }
        let word = GpuWord::new(device)?;
        let thread = {
            let mut threads = self.threads.lock();
            match threads.get(&device) {
                Some(t) => t.clone(),
                None => {
                    let t = WatcherThread::spawn(device, cpu, poll_mode, callbacks)?;
                    threads.insert(device, t.clone());
                    t
                }
            }
        };
        let slot = Arc::new(WatchSlot { word, callback, runs_on, closed: AtomicBool::new(false) });
        thread.add(slot.clone());
        Ok(UvmWatcher { slot, thread })
    }

    pub fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        let threads: Vec<_> = self.threads.lock().drain().map(|(_, t)| t).collect();
        for t in threads {
            t.stop();
        }
    }
}

/// A stream of one device with cuda-lib's signalling kernels loaded, for launching them from
/// Python (tests, benchmarks, glue): write a word, poll a flag. Statuses of flag polls land in
/// a small pinned array.
pub struct SignalStream {
    stream: cuda_lib::Stream,
    kernels: cuda_lib::Kernels,
    status: cuda_lib::PinnedHostBuffer,
}

/// Slots of [`SignalStream`]'s status array.
pub const SIGNAL_STATUS_SLOTS: usize = 1024;

impl SignalStream {
    /// A new stream on `device` with the kernels loaded.
    pub fn new(device: usize) -> Result<Self> {
        let ctx = context(device)?;
        let kernels = cuda_lib::Kernels::load(&ctx)?;
        let stream = cuda_lib::Stream::new(&ctx)?;
        let status = cuda_lib::PinnedHostBuffer::new(&ctx, 4 * SIGNAL_STATUS_SLOTS)?;
        for i in 0..SIGNAL_STATUS_SLOTS {
            status.atomic_u32(i).store(u32::MAX, Ordering::Relaxed);
        }
        Ok(SignalStream { stream, kernels, status })
    }

    /// Enqueues a release store of `value` at `addr`.
    ///
    /// # Safety
    /// `addr` must be an 8-byte aligned word writable by the device until the kernel ran.
    pub unsafe fn write_u64(&self, addr: u64, value: u64) -> Result<()> {
        // SAFETY: forwarded contract.
        Ok(unsafe { self.kernels.write_u64(&self.stream, addr, value) }?)
    }

    /// Enqueues a kernel that waits until the word at `flag` equals `expected` (or `timeout`
    /// passed), then stores 0 (seen) or 1 (timed out) in status slot `slot`.
    ///
    /// # Safety
    /// `flag` must be an 8-byte aligned word readable by the device until the kernel finished.
    pub unsafe fn flag_poll(&self, flag: u64, expected: u64, timeout: Duration, slot: usize) -> Result<()> {
        if slot >= SIGNAL_STATUS_SLOTS {
            return Err(FabricError::InvalidArgument(format!("status slot {slot} >= {SIGNAL_STATUS_SLOTS}")));
        }
        self.status.atomic_u32(slot).store(u32::MAX, Ordering::Release);
        let status = self.status.device_ptr() + 4 * slot as u64;
        // SAFETY: forwarded contract; the status word lives as long as `self`, whose drop
        // synchronizes the stream.
        Ok(unsafe { self.kernels.flag_poll(&self.stream, flag, expected, timeout, status) }?)
    }

    /// Status of a flag poll: None while pending, Some(true) seen, Some(false) timed out.
    pub fn status(&self, slot: usize) -> Option<bool> {
        match self.status.atomic_u32(slot.min(SIGNAL_STATUS_SLOTS - 1)).load(Ordering::Acquire) {
            0 => Some(true),
            1 => Some(false),
            _ => None,
        }
    }

    /// Waits (polling, bounded) until everything enqueued completed; false on timeout.
    pub fn wait(&self, timeout: Duration) -> Result<bool> {
        let deadline = crate::config::deadline_after(timeout);
        loop {
            if self.stream.is_idle()? {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    /// The raw `CUstream` as an integer (e.g. for `torch.cuda.ExternalStream`).
    pub fn raw(&self) -> u64 {
        self.stream.raw() as u64
    }
}

impl Drop for SignalStream {
    fn drop(&mut self) {
        // The status array must outlive kernels still writing it.
        let _ = self.stream.synchronize();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_memory_is_host_without_loading_cuda() {
        let v = [0u8; 64];
        let loaded_before = cuda_loaded();
        assert_eq!(detect_memory_kind(v.as_ptr() as u64), MemoryKind::Host);
        assert_eq!(cuda_loaded(), loaded_before, "detection must not load libcuda");
    }

    #[test]
    fn without_a_gpu_flags_and_watchers_report_cuda_unavailable() {
        if cuda_lib::Driver::is_available() {
            return; // a GPU host: the GPU tests cover it
        }
        assert!(matches!(GpuFlag::new(0), Err(FabricError::CudaUnavailable(_))));
        assert!(matches!(SignalStream::new(0), Err(FabricError::CudaUnavailable(_))));
        assert!(matches!(device_count(), Err(FabricError::CudaUnavailable(_))));
    }
}
