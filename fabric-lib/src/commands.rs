//! The vocabulary between the engine (which validates and plans on the caller's thread) and its
//! worker (which posts and completes): the commands on the worker's queue and what they carry.
use std::sync::Arc;

use crossbeam_channel::Sender;

use crate::address::InboxAddress;
use crate::completion::Notify;
use crate::config::GpuRegistration;
use crate::descriptor::MemoryKind;
use crate::error::{FabricError, Result};
use crate::provider::libfabric::NicRegistration;
use crate::provider::same_host::{SameHostCopy, SameHostDst};
use crate::sharding::{DeferredImm, Shard};

/// Receives every two-sided message.
pub type RecvCallback = Arc<dyn Fn(Vec<u8>) + Send + Sync + 'static>;

/// Region id of the worker's scratch buffers (source of zero-byte immediate writes).
pub(crate) const SCRATCH_REGION: u64 = 0;

/// A peer region (or a peer engine's immediate slot) as the worker needs it: the peer (its id in
/// the engine's `PeerTable`) and per domain (key, remote base).
pub(crate) struct Target {
    pub peer: u32,
    /// Inline for up to two domains: one is built for every request (every scatter target).
    pub keys: smallvec::SmallVec<[(u64, u64); 2]>,
}

/// A request's peers: inline for one (a single or paged write, an immediate).
pub(crate) type Targets = smallvec::SmallVec<[Target; 1]>;

/// A request's peers as the worker gets them: its own, or the shared list of a prepared
/// scatter (built once; a call moves one reference, not a target per peer).
pub(crate) enum TargetList {
    Own(Targets),
    Shared(Arc<[Target]>),
}

impl Default for TargetList {
    fn default() -> Self {
        TargetList::Own(Targets::new())
    }
}

impl From<Targets> for TargetList {
    fn from(targets: Targets) -> Self {
        TargetList::Own(targets)
    }
}

impl std::ops::Deref for TargetList {
    type Target = [Target];

    fn deref(&self) -> &[Target] {
        match self {
            TargetList::Own(t) => t,
            TargetList::Shared(t) => t,
        }
    }
}

/// A request's writes: inline for two (a small write, or one sharded over two domains).
pub(crate) type Shards = smallvec::SmallVec<[Shard; 2]>;

/// A validated, planned request of one or more writes (or reads). Small requests carry no heap
/// allocation of their own: they are planned on the caller's thread and freed on the worker's.
pub(crate) struct Transfer {
    pub region: u64,
    pub targets: TargetList,
    pub shards: Shards,
    pub deferred: Vec<DeferredImm>,
    pub on_done: Notify,
}

/// A validated same-host write (see `provider::same_host`), or a same-host immediate alone.
pub(crate) struct SameHostTransfer {
    pub region: u64,
    /// What to copy where (`None`: an immediate-only request).
    pub write: Option<(SameHostDst, SameHostCopy)>,
    /// Delivered once the data is visible (the copy's event completed, `process_vm_writev`
    /// returned): through the peer's inbox, or over the provider.
    pub imm: Option<SameHostImm>,
    pub on_done: Notify,
}

/// Where a staged request's chunks go (see `staging`).
pub(crate) enum StagedDest {
    /// Host memory the NIC reaches: chunks are written to their final place, and the immediate
    /// follows the last one as a zero-byte write (as for any network write).
    Region,
    /// Memory the NIC cannot reach: chunks go into the owner's landing area (the target's
    /// keys are the landing area's), whose worker copies them into place and counts the
    /// immediate itself.
    Landing { chunk_bytes: u64, dst_base: u64, peer_max_message: u64 },
}

/// A validated write whose source or destination is staged through host memory.
pub(crate) struct StagedTransfer {
    pub region: u64,
    /// The source needs a bounce copy (GPU memory the NIC cannot reach).
    pub bounce: bool,
    pub target: Target,
    pub dest: StagedDest,
    /// (source offset, destination offset, length) pieces: one for a single write, one per page.
    pub pieces: Vec<(u64, u64, u64)>,
    pub imm: Option<u32>,
    pub on_done: Notify,
}

/// What a landing area looks like to peers: per domain (key, remote base), slots, chunk size.
pub(crate) type LandingKeys = (Vec<(u64, u64)>, u32, u64);
/// The immediate of a same-host request and where it goes.
pub(crate) struct SameHostImm {
    pub imm: u32,
    /// The destination engine's immediate slots (the provider path, and the fence).
    pub target: Target,
    /// The destination engine's pid, process id and inbox (`None`: it has no inbox).
    pub inbox: Option<(u32, u64, InboxAddress)>,
}

/// A validated same-host read where either side is GPU memory: `peer` is the source region,
/// `region` the local destination; `copy`'s source side is the peer's.
pub(crate) struct SameHostRead {
    pub region: u64,
    pub peer: SameHostDst,
    pub copy: SameHostCopy,
    pub on_done: Notify,
}

/// A validated request (a `Transfer`, `SameHost` or `Send` command) that the worker posts
/// itself once `count` arrivals of immediate `imm` were counted (see `worker::triggers`).
pub(crate) struct ArmCommand {
    pub imm: u32,
    pub count: u64,
    /// Fails the request with a timeout if the count is not reached by then.
    pub timeout: Option<std::time::Duration>,
    pub request: Box<Command>,
}

/// A two-sided message, validated by the engine.
pub(crate) struct SendCommand {
    /// The peer's id in the engine's `PeerTable`.
    pub peer: u32,
    pub data: Vec<u8>,
    pub on_done: Notify,
}

/// What a registration reports: per domain (key, remote base), and how GPU memory reached the NIC.
pub(crate) type Registered = (Vec<(u64, u64)>, Option<NicRegistration>);

pub(crate) enum Command {
    /// `network: false` records the region for same-host use only (GPU memory the NIC cannot
    /// reach); `network: true` registers it on every domain (GPU memory needs FI_HMEM).
    Register {
        region: u64,
        ptr: usize,
        len: usize,
        kind: MemoryKind,
        network: bool,
        /// Peers may read it (FI_REMOTE_READ on its keys); the owner opted in.
        remote_read: bool,
        /// How GPU memory is registered with the NIC (FI_HMEM domains).
        gpu_registration: GpuRegistration,
        /// Per domain (key, remote base), and how GPU memory was registered (None: host memory,
        /// or not registered with the NIC).
        reply: Sender<Result<Registered>>,
    },
    Unregister {
        region: u64,
        reply: Sender<Result<()>>,
    },
    Transfer(Transfer),
    /// A read: the shards pull from the target into `region` (see `engine::reads`).
    Read(Transfer),
    /// Boxed, like `SameHostRead`: the rare large variants would make every command that size,
    /// and each crosses from the caller's core to the worker's.
    SameHost(Box<SameHostTransfer>),
    Staged(StagedTransfer),
    /// Opens (once) the landing area for staged writes into this engine, pinned through
    /// `device`'s context (None: plain host memory), and replies its keys.
    Landing {
        device: Option<u32>,
        reply: Sender<Result<LandingKeys>>,
    },
    SameHostRead(Box<SameHostRead>),
    Send(SendCommand),
    Arm(ArmCommand),
    SetRecvCallback(Option<RecvCallback>),
    /// Lifts the fence on a peer (its endpoints, one per domain) after the epoch handshake
    /// (`epoch`); replies what the peer counted in the epoch that ended.
    Readmit {
        peer: Vec<Vec<u8>>,
        max_message_size: u64,
        reply: Sender<Result<crate::epoch::Readmission>>,
    },
    /// Polls `task` every round from now on (see `engine::tasks`).
    AttachTask {
        id: crate::engine::TaskId,
        task: Box<dyn crate::engine::WorkerTask>,
    },
    /// Drops the task, then replies.
    DetachTask {
        id: crate::engine::TaskId,
        reply: Sender<Result<()>>,
    },
    Stop,
}

impl Command {
    /// A request that moves data (what the latency probe's `Dequeued` and post log count).
    pub(crate) fn is_request(&self) -> bool {
        matches!(
            self,
            Command::Transfer(_)
                | Command::Read(_)
                | Command::SameHost(_)
                | Command::Staged(_)
                | Command::SameHostRead(_)
                | Command::Send(_)
        )
    }

    /// Answers a command that will never run: replies with [`FabricError::Stopped`] and returns
    /// the request's completion, for the caller to report (the worker through its callback
    /// thread, the engine on its own thread once the worker is gone).
    pub(crate) fn into_stopped(self) -> Option<Notify> {
        match self {
            Command::Transfer(Transfer { on_done, .. })
            | Command::Read(Transfer { on_done, .. })
            | Command::Staged(StagedTransfer { on_done, .. })
            | Command::Send(SendCommand { on_done, .. }) => return Some(on_done),
            Command::SameHost(t) => return Some(t.on_done),
            Command::SameHostRead(t) => return Some(t.on_done),
            Command::Register { reply, .. } => {
                let _ = reply.send(Err(FabricError::Stopped));
            }
            Command::Unregister { reply, .. } => {
                let _ = reply.send(Err(FabricError::Stopped));
            }
            Command::Readmit { reply, .. } => {
                let _ = reply.send(Err(FabricError::Stopped));
            }
            Command::Landing { reply, .. } => {
                let _ = reply.send(Err(FabricError::Stopped));
            }
            Command::DetachTask { reply, .. } => {
                let _ = reply.send(Err(FabricError::Stopped));
            }
            Command::AttachTask { .. } => {}
            Command::Arm(armed) => return armed.request.into_stopped(),
            Command::SetRecvCallback(_) | Command::Stop => {}
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_fits_a_transfer_and_no_more() {
        // What crosses to the worker per request: keep the largest variant the common one.
        assert_eq!(std::mem::size_of::<Command>(), std::mem::size_of::<Transfer>() + 8);
        assert!(std::mem::size_of::<Command>() <= 224, "{}", std::mem::size_of::<Command>());
    }
}
