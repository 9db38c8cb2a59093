//! GPU objects of the Python API: UVM watchers, GPU flags, a signalling stream, CUDA queries.
use std::time::Duration;

use fabric_lib::{gpu, GpuFlag, SignalStream, UvmWatcher};
use pyo3::prelude::*;

use crate::errors::{to_pyerr, IntoPyResult};

/// A GPU-written word watched by a CPU thread (see `TransferEngine.alloc_uvm_watcher`).
#[pyclass(name = "UvmWatcher", module = "fabric_lib._rust", frozen)]
pub struct PyUvmWatcher(pub UvmWatcher);

#[pymethods]
impl PyUvmWatcher {
    /// Device address of the 64-bit word kernels write.
    #[getter]
    fn ptr(&self) -> u64 {
        self.0.device_ptr()
    }

    #[getter]
    fn device(&self) -> usize {
        self.0.device()
    }

    /// The word's current value.
    #[getter]
    fn value(&self) -> u64 {
        self.0.value()
    }

    /// Stops watching (idempotent).
    fn close(&self) {
        self.0.close()
    }

    fn __repr__(&self) -> String {
        format!("UvmWatcher(device={}, ptr=0x{:x}, value={})", self.0.device(), self.0.device_ptr(), self.0.value())
    }
}

/// A CPU-set word kernels poll (see `TransferEngine.alloc_gpu_flag`).
#[pyclass(name = "GpuFlag", module = "fabric_lib._rust", frozen)]
#[derive(Clone)]
pub struct PyGpuFlag(pub GpuFlag);

#[pymethods]
impl PyGpuFlag {
    /// Device address of the 64-bit flag word.
    #[getter]
    fn ptr(&self) -> u64 {
        self.0.device_ptr()
    }

    #[getter]
    fn device(&self) -> usize {
        self.0.device()
    }

    /// Stores `value` (release ordering).
    fn set(&self, value: u64) {
        self.0.set(value)
    }

    /// Reads the flag.
    fn get(&self) -> u64 {
        self.0.get()
    }

    fn __repr__(&self) -> String {
        format!("GpuFlag(device={}, ptr=0x{:x}, value={})", self.0.device(), self.0.device_ptr(), self.0.get())
    }
}

/// A CUDA stream with cuda-lib's signalling kernels (write_u64, flag_poll) loaded.
#[pyclass(name = "SignalStream", module = "fabric_lib._rust", frozen)]
pub struct PySignalStream(SignalStream);

#[pymethods]
impl PySignalStream {
    #[new]
    #[pyo3(signature = (device=0))]
    fn new(py: Python<'_>, device: usize) -> PyResult<Self> {
        py.detach(|| SignalStream::new(device)).py(py).map(Self)
    }

    /// Enqueues a release store of `value` at device address `addr` (8-byte aligned; the caller
    /// keeps the memory alive until the stream passed it).
    fn write_u64(&self, py: Python<'_>, addr: u64, value: u64) -> PyResult<()> {
        // SAFETY: documented contract of this raw-pointer API (addresses come from watchers,
        // flags or registered tensors that the caller keeps alive).
        unsafe { self.0.write_u64(addr, value) }.py(py)
    }

    /// Enqueues a kernel that waits until the word at `flag` equals `expected` or `timeout`
    /// seconds passed; `status(slot)` then says which.
    #[pyo3(signature = (flag, expected, timeout, slot=0))]
    fn flag_poll(&self, py: Python<'_>, flag: u64, expected: u64, timeout: f64, slot: usize) -> PyResult<()> {
        if !(timeout.is_finite() && timeout >= 0.0) {
            return Err(bad_timeout(py));
        }
        // SAFETY: as for write_u64.
        unsafe { self.0.flag_poll(flag, expected, Duration::from_secs_f64(timeout), slot) }.py(py)
    }

    /// None while the poll in `slot` runs, True if it saw the value, False if it timed out.
    fn status(&self, slot: usize) -> Option<bool> {
        self.0.status(slot)
    }

    /// Waits until the stream is idle; False if `timeout` seconds passed first.
    fn synchronize(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        if !(timeout.is_finite() && timeout >= 0.0) {
            return Err(bad_timeout(py));
        }
        py.detach(|| self.0.wait(Duration::from_secs_f64(timeout))).py(py)
    }

    /// The raw CUstream handle (for torch.cuda.ExternalStream).
    #[getter]
    fn handle(&self) -> u64 {
        self.0.raw()
    }
}

/// Number of visible CUDA devices; raises CudaUnavailableError saying what is missing.
#[pyfunction]
pub fn cuda_device_count(py: Python<'_>) -> PyResult<usize> {
    py.detach(gpu::device_count).py(py)
}

/// Whether this build embeds the CUDA kernels, and for which architectures.
#[pyfunction]
pub fn cuda_kernels() -> (bool, String) {
    (cuda_lib_available(), gpu::kernel_archs().to_string())
}

fn cuda_lib_available() -> bool {
    gpu::kernels_available()
}

/// "host" or "cuda:N" for a raw address, without loading CUDA when it is not loaded already.
#[pyfunction]
pub fn memory_kind(ptr: u64) -> String {
    match gpu::detect_memory_kind(ptr) {
        fabric_lib::MemoryKind::Host => "host".into(),
        fabric_lib::MemoryKind::Cuda(d) => format!("cuda:{d}"),
    }
}

/// The error for a timeout that is negative, infinite or NaN.
fn bad_timeout(py: Python<'_>) -> PyErr {
    let message = "timeout must be a finite, non-negative number of seconds".to_string();
    to_pyerr(py, fabric_lib::FabricError::InvalidArgument(message))
}
