//! Transports. One domain is one NIC; `local` is the same-host channel (CUDA IPC + copy engines).
pub mod libfabric;
pub(crate) mod local;
