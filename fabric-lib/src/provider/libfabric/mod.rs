//! libfabric FI_EP_RDM domains: provider selection, endpoint set-up, memory registration and the
//! data-path calls. Everything here runs on the owning worker thread (FI_THREAD_DOMAIN).
mod context;
mod dmabuf;
mod domain;
mod endpoint;
mod error;
mod info;
mod mr;
mod read;

pub use context::{OpContext, OpKind};
pub use dmabuf::{runtime_version, version_string, NicRegistration, DMABUF_API_VERSION};
pub use domain::{Completion, LibfabricDomain, Posted, CQ_BATCH};
pub use endpoint::check_endpoint;
pub use error::{libfabric_error, strerror};
pub use info::{is_software, list_providers, DomainSpec, ProviderSpec, SOFTWARE_DEFAULT_DOMAIN};
pub use mr::{Access, LocalMr};
