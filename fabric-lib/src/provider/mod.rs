//! Transports. One domain is one NIC (or one same-host channel); only libfabric exists so far.
pub mod libfabric;
