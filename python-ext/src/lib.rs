//! `fabric_lib._rust`: PyO3 bindings of fabric-lib. Only argument conversion, GIL release and
//! error mapping live here; the logic is in the `fabric-lib` crate.
use pyo3::prelude::*;

/// Small requests are allocated on the caller's thread and freed on the worker's: mimalloc frees
/// them without the system allocator's cross-thread cost.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod all_to_all;
mod callbacks;
mod completion;
mod config;
mod engine;
mod errors;
mod gpu;
mod logging;
mod values;

/// Lists the (provider, domain) pairs an engine can open on this machine.
#[pyfunction]
fn list_providers(py: Python<'_>) -> Vec<(String, String)> {
    py.detach(fabric_lib::list_providers)
}

/// The host topology (GPUs, NICs, NUMA nodes, physical cores) as JSON.
#[pyfunction]
fn detect_topology_json(py: Python<'_>) -> String {
    let topo = py.detach(|| fabric_lib::topology::detect(std::path::Path::new("/")));
    serde_json::to_string(&topo).expect("topology is plain data")
}

/// The GPU classes and functions (see `gpu.rs`).
fn gpu_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<gpu::PyUvmWatcher>()?;
    m.add_class::<gpu::PyGpuFlag>()?;
    m.add_class::<gpu::PySignalStream>()?;
    m.add_function(wrap_pyfunction!(gpu::cuda_device_count, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::cuda_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::memory_kind, m)?)?;
    Ok(())
}

#[pymodule]
fn _rust(m: &Bound<'_, PyModule>) -> PyResult<()> {
    logging::route_to_python(m.py());
    m.add_class::<engine::PyTransferEngine>()?;
    m.add_class::<completion::PyCompletion>()?;
    m.add_class::<values::PyEngineAddress>()?;
    m.add_class::<values::PyMrDescriptor>()?;
    m.add_function(wrap_pyfunction!(config::engine_defaults, m)?)?;
    m.add_function(wrap_pyfunction!(list_providers, m)?)?;
    m.add_function(wrap_pyfunction!(detect_topology_json, m)?)?;
    m.add("ENCODING_VERSION", fabric_lib::ENCODING_VERSION)?;
    all_to_all::register(m)?;
    gpu_module(m)?;
    Ok(())
}
