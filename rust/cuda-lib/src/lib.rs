//! `cuda-lib`: the CUDA driver for fabric-lib, loaded at run time.
//!
//! Nothing here links against CUDA: `libcuda.so` is opened on first use (through cudarc's
//! dynamic loading), so programs and Python modules built on this crate start on machines
//! without a GPU and report [`CudaError::DriverUnavailable`], with what is missing and how to get
//! it, when CUDA is first needed.
//!
//! Three levels, after cudarc:
//! - raw: [`sys`] (cudarc's generated driver bindings);
//! - thin fallible: the crate-private `cu!` macro, which calls one `sys` function and turns its
//!   `CUresult` into `Result<(), CudaError>` naming the call;
//! - safe RAII types: [`Context`] (retained primary context), [`DeviceBuffer`] (cuMemAlloc),
//!   [`VmmAllocation`] (cuMemCreate/cuMemMap, POSIX-fd export/import, DMA-BUF),
//!   [`IpcMapping`] (legacy IPC handles), [`PinnedHostBuffer`] (mapped pinned host memory),
//!   [`Stream`], [`Event`], [`Graph`]/[`GraphExec`], [`Module`]/[`Function`] (launches on a
//!   [`Stream`] of this crate, or on a raw stream handle another library made), and [`Kernels`]
//!   (the embedded `kernels/*.cu`: paged copy, release-store "bump", flag poll).
//!
//! Raw device addresses are plain `u64`s (they come from torch, peers, descriptors); operations
//! that dereference them are `unsafe fn`s with their contract in `# Safety`.
//!
//! **Threads.** Every type is `Send + Sync`. Each operation makes its context current only for
//! its own duration and restores the caller's, so the thread's current device (as torch sees
//! it) does not change; [`Context::bind`] makes a context current for good (worker threads).
//!
//! **Cleanup.** Every resource holds an `Arc<Context>` and is released in `Drop` with its
//! context current; drops never panic: failures are logged (`tracing`) and otherwise ignored.
//!
//! **Kernels.** build.rs compiles `kernels/*.cu` with nvcc 13.0 into one fatbin (sm_90a, plus
//! sm_100a when nvcc supports it, plus compute_90 PTX). A build without nvcc succeeds; then
//! [`Kernels::load`] returns [`CudaError::KernelsUnavailable`]. Other crates embed their own
//! kernels the same way: `cuda_build::compile_kernels` in the build script, [`embed_kernels!`] in
//! the crate, [`Module`] to load them.
#[macro_use]
mod driver;
mod alloc;
mod context;
mod device;
mod dmabuf;
mod embed;
mod error;
mod event;
mod graph;
mod host;
mod ipc;
mod kernels;
mod module;
mod paged_copy;
mod stream;
mod vmm;

pub use alloc::DeviceBuffer;
pub use context::Context;
pub use cudarc::driver::sys;
pub use device::{driver_version, Device};
pub use dmabuf::{export_dmabuf, export_dmabuf_range, DmabufRange, DMABUF_ALIGNMENT};
pub use driver::{device_count, pointer_device, Driver};
#[doc(hidden)]
pub use embed::Aligned16;
pub use error::{CudaError, Result};
pub use event::Event;
pub use graph::{Graph, GraphExec};
pub use host::PinnedHostBuffer;
pub use ipc::{ipc_export, IpcExport, IpcMapping, IpcMemHandle};
pub use kernels::{kernel_archs, kernel_image, kernels_available, Kernels};
pub use module::{Function, LaunchConfig, Module};
pub use paged_copy::{PagedCopy, PagedCopyPlan, PAGED_COPY_DEFAULT_BLOCKS, PAGED_COPY_DEFAULT_THREADS};
pub use stream::{Stream, WaitValue};
pub use vmm::{vmm_granularity, VmmAllocation};
