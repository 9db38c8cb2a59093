//! Transports. One domain is one NIC; `same_host` carries writes that involve GPU memory between
//! processes of one host (CUDA IPC + copy engines, `process_vm_writev`, a shared-memory inbox for
//! immediates), with the semantics of the network path.
pub mod libfabric;
pub(crate) mod same_host;
