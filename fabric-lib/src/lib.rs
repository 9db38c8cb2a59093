//! fabric-lib: a TransferEngine for point-to-point RDMA in LLM systems.
//!
//! One-sided WRITE and WRITEIMM (write + 32-bit immediate) and small two-sided messages over any
//! libfabric RDM provider (`efa`, `verbs;ofi_rxm`, and the software `tcp`, `udp;ofi_rxd`, `shm`).
//! No ordering is assumed between any two operations: receivers learn completion by counting
//! immediates ([`ImmCounterTable`]).
//!
//! Threads: per device, one worker that solely owns its domain (no locks on the data path); one
//! callback thread per engine on which every user callback runs. Resources (registrations,
//! endpoints, threads) are released by [`TransferEngine::stop`] or on drop.
pub mod address;
pub mod callback;
mod commands;
pub mod completion;
pub mod config;
pub mod descriptor;
mod domain_state;
mod encoding;
pub mod engine;
mod epoch;
pub mod error;
pub mod gpu;
mod host_memory;
pub mod imm_counter;
mod joined;
pub mod latency_probe;
mod msg_buffers;
mod peers;
pub mod provider;
mod requests;
pub mod sharding;
mod spin;
pub mod staging;
pub mod topology;
mod worker;

pub use address::{DomainAddress, EngineAddress, InboxAddress};
pub use commands::RecvCallback;
pub use completion::CompletionCounter;
pub use completion::OnDone;
pub use config::{EngineConfig, GpuRegistration, PollMode, WriteCompletion};
pub use descriptor::{CudaIpc, DomainKey, MemoryKind, MrDescriptor};
pub use encoding::ENCODING_VERSION;
pub use engine::{
    DomainStats, MrHandle, PreparedScatter, RegisterOptions, TaskId, TransferEngine, Trigger, WorkerTask,
};
pub use epoch::Readmission;
pub use error::{FabricError, Result};
pub use gpu::{GpuFlag, SignalStream, UvmWatcher, WatcherCallback, WatcherRunsOn};
pub use imm_counter::{GenericImmCallback, ImmCounterTable, OnReached};
pub use latency_probe::{monotonic_ns, LatencyProbe, PostRecord, Stage};
pub use provider::libfabric::{list_providers, DomainSpec, NicRegistration, ProviderSpec};
pub use requests::{
    PagedReadRequest, PagedWriteRequest, PeerGroup, ReadRequest, ScatterSharding, ScatterSlice, ScatterTarget,
    WriteRequest,
};
pub use sharding::DomainChoice;
