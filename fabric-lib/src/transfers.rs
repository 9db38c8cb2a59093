//! The one-sided operations of [`TransferEngine`]: single, paged and scatter writes, immediates
//! and barriers. Each is validated in full and planned on the caller's thread (nothing is posted
//! if any part is out of range), then handed to the worker as one request.
//!
//! Immediate contract: a request delivers its immediate **exactly once to each target peer**,
//! however the engine cut it across domains (see [`crate::sharding`]).
use std::sync::atomic::Ordering;

use std::sync::Arc;

use crate::address::EngineAddress;
use crate::completion::{CompletionCounter, Notify};
use crate::descriptor::{check_range, MemoryKind, MrDescriptor};
use crate::engine::{MrHandle, TransferEngine};
use crate::error::{FabricError, Result};
use crate::provider::local::{LocalCopy, LocalDst};
use crate::sharding::{plan_imms, split_bytes, DomainChoice, Shard};
use crate::worker::{LocalTransfer, Target};
use crate::worker::{OnDone, Transfer, SCRATCH_REGION};

/// One single write: `len` bytes from a local region to a peer's region, optionally with an
/// immediate that the peer counts once the bytes are in place.
#[derive(Clone, Copy, Debug)]
pub struct WriteRequest<'a> {
    pub src: MrHandle,
    pub src_offset: u64,
    pub len: u64,
    pub dst: &'a MrDescriptor,
    pub dst_offset: u64,
    pub imm: Option<u32>,
    /// How the bytes are spread over the device's domains.
    pub domains: DomainChoice,
}

/// Fixed-size pages gathered from a local region and scattered into a peer region:
/// page `i` moves `page_len` bytes from `src_pages[i] * src_stride + src_offset` to
/// `dst_pages[i] * dst_stride + dst_offset`. Pages are spread over every domain.
#[derive(Clone, Copy, Debug)]
pub struct PagedWriteRequest<'a> {
    pub page_len: u64,
    pub src: MrHandle,
    pub src_pages: &'a [u32],
    pub src_stride: u64,
    pub src_offset: u64,
    pub dst: &'a MrDescriptor,
    pub dst_pages: &'a [u32],
    pub dst_stride: u64,
    pub dst_offset: u64,
    pub imm: Option<u32>,
}

/// One destination of a scatter.
#[derive(Clone, Copy, Debug)]
pub struct ScatterTarget<'a> {
    pub len: u64,
    pub src_offset: u64,
    pub dst: &'a MrDescriptor,
    pub dst_offset: u64,
}

/// How a scatter is spread over domains.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScatterSharding {
    /// Each target whole on one domain, targets rotating over the domains.
    ByPeer,
    /// Each target's bytes sharded over all domains like a single write.
    ByBytes,
}

/// A handle returned by [`TransferEngine::add_peer_group`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PeerGroup(pub u64);

/// How a request from a local region to a descriptor is carried.
enum Route {
    /// Over the libfabric domains.
    Network(Target),
    /// Same host, GPU memory on either side: CUDA IPC + copy engines / copy kernel.
    Local(LocalDst),
}

impl TransferEngine {
    /// Picks the path: same-host CUDA when either side is GPU memory and the owner shares this
    /// host (another process or this one), the network otherwise (host memory only).
    fn route(&self, src: MrHandle, dst: &MrDescriptor) -> Result<Route> {
        let src_kind = self.region_info(src)?.kind;
        let gpu = src_kind != MemoryKind::Host || dst.kind != MemoryKind::Host;
        if !gpu {
            return self.region_target(dst).map(Route::Network);
        }
        if !dst.owner.is_same_host() {
            if src_kind != MemoryKind::Host {
                return Err(self.gpu_network_error("source", src_kind));
            }
            if !dst.network_reachable() {
                return Err(self.gpu_network_error("destination", dst.kind));
            }
            return self.region_target(dst).map(Route::Network);
        }
        self.check_peer(&dst.owner)?;
        Ok(Route::Local(LocalDst {
            kind: dst.kind,
            base: dst.base,
            len: dst.len,
            pid: dst.owner.pid,
            process: dst.owner.process,
            same_process: dst.owner.is_same_process(),
            cuda: dst.cuda.clone(),
        }))
    }

    fn submit_local(
        &self,
        src: MrHandle,
        dst: &MrDescriptor,
        local: LocalDst,
        copy: LocalCopy,
        imm: Option<u32>,
        on_done: Notify,
    ) -> Result<()> {
        let imm = match imm {
            Some(imm) => Some((imm, self.engine_target(&dst.owner)?)),
            None => None,
        };
        self.command(crate::worker::Command::Local(LocalTransfer { region: src.0, dst: local, copy, imm, on_done }))
    }

    fn rotate(&self, by: usize) -> usize {
        self.next_domain.fetch_add(by.max(1), Ordering::Relaxed)
    }

    /// Posts one write; `on_done` runs on the callback thread once every part completed (or
    /// one failed). Bad input is rejected here and nothing is posted.
    pub fn submit_write(&self, req: &WriteRequest<'_>, on_done: OnDone) -> Result<()> {
        self.submit_write_notify(req, Notify::Callback(on_done))
    }

    /// [`TransferEngine::submit_write`] that reports to `counter` instead of a callback: the
    /// worker bumps it directly (no callback-thread hop), the fast path for many small writes.
    pub fn submit_write_counted(&self, req: &WriteRequest<'_>, counter: &Arc<CompletionCounter>) -> Result<()> {
        self.submit_write_notify(req, Notify::Counter(counter.clone()))
    }

    fn submit_write_notify(&self, req: &WriteRequest<'_>, on_done: Notify) -> Result<()> {
        check_range("source", self.region_len(req.src)?, req.src_offset, req.len)?;
        let route = self.route(req.src, req.dst)?;
        req.dst.check_range(req.dst_offset, req.len)?;
        let n = self.num_domains();
        if let DomainChoice::Pinned(d) = req.domains {
            if d >= n {
                return Err(FabricError::InvalidArgument(format!("domain {d} out of range: this engine has {n}")));
            }
        }
        let target = match route {
            Route::Network(t) => t,
            Route::Local(local) => {
                let copy =
                    LocalCopy::Contiguous { src_offset: req.src_offset, dst_offset: req.dst_offset, len: req.len };
                return self.submit_local(req.src, req.dst, local, copy, req.imm, on_done);
            }
        };
        let pieces = match req.domains {
            DomainChoice::Pinned(d) if d >= n => {
                return Err(FabricError::InvalidArgument(format!("domain {d} out of range: this engine has {n}")))
            }
            DomainChoice::Pinned(d) => vec![(d, 0, req.len)],
            DomainChoice::Shard(k) => split_bytes(req.len, n, k, self.rotate(1), self.config().shard_min_bytes),
        };
        let mut shards: Vec<Shard> = pieces
            .into_iter()
            .map(|(domain, off, len)| Shard {
                peer: 0,
                domain: domain as u16,
                src_offset: req.src_offset + off,
                len,
                dst_offset: req.dst_offset + off,
                imm: None,
            })
            .collect();
        let deferred = plan_imms(&mut shards, &[req.imm]);
        self.submit_transfer(Transfer { region: req.src.0, targets: vec![target], shards, deferred, on_done })
    }

    /// Posts a paged write (see [`PagedWriteRequest`]); every page index is checked against both
    /// regions before anything is posted.
    pub fn submit_paged_writes(&self, req: &PagedWriteRequest<'_>, on_done: OnDone) -> Result<()> {
        let src_len = self.region_len(req.src)?;
        let route = self.route(req.src, req.dst)?;
        if req.src_pages.len() != req.dst_pages.len() {
            return Err(FabricError::InvalidArgument(format!(
                "{} source pages but {} destination pages",
                req.src_pages.len(),
                req.dst_pages.len()
            )));
        }
        if req.src_pages.is_empty() {
            return Err(FabricError::InvalidArgument("paged write with an empty page list".into()));
        }
        if req.page_len == 0 {
            return Err(FabricError::InvalidArgument("page length must be positive".into()));
        }
        let page_range = |side: &str, pages: &[u32], stride: u64, offset: u64, region_len: u64| -> Result<()> {
            let (i, max) = pages.iter().enumerate().max_by_key(|(_, p)| **p).expect("non-empty");
            let start = u64::from(*max)
                .checked_mul(stride)
                .and_then(|s| s.checked_add(offset))
                .ok_or_else(|| FabricError::InvalidArgument(format!("{side} page {max} overflows")))?;
            check_range(side, region_len, start, req.page_len)
                .map_err(|e| FabricError::InvalidArgument(format!("{side} page index {max} (position {i}): {e}")))
        };
        page_range("source", req.src_pages, req.src_stride, req.src_offset, src_len)?;
        page_range("destination", req.dst_pages, req.dst_stride, req.dst_offset, req.dst.len)?;
        let target = match route {
            Route::Network(t) => t,
            Route::Local(local) => {
                if req.src_pages.len() > u32::MAX as usize {
                    return Err(FabricError::InvalidArgument("too many pages for one paged write".into()));
                }
                let copy = LocalCopy::Paged {
                    page_len: req.page_len,
                    src_pages: req.src_pages.to_vec(),
                    src_stride: req.src_stride,
                    src_offset: req.src_offset,
                    dst_pages: req.dst_pages.to_vec(),
                    dst_stride: req.dst_stride,
                    dst_offset: req.dst_offset,
                };
                return self.submit_local(req.src, req.dst, local, copy, req.imm, Notify::Callback(on_done));
            }
        };
        let n = self.num_domains();
        let start = self.rotate(req.src_pages.len());
        let mut shards: Vec<Shard> = req
            .src_pages
            .iter()
            .zip(req.dst_pages)
            .enumerate()
            .map(|(i, (&s, &d))| Shard {
                peer: 0,
                domain: ((start + i) % n) as u16,
                src_offset: u64::from(s) * req.src_stride + req.src_offset,
                len: req.page_len,
                dst_offset: u64::from(d) * req.dst_stride + req.dst_offset,
                imm: None,
            })
            .collect();
        let deferred = plan_imms(&mut shards, &[req.imm]);
        self.submit_transfer(Transfer {
            region: req.src.0,
            targets: vec![target],
            shards,
            deferred,
            on_done: Notify::Callback(on_done),
        })
    }

    /// Sends only an immediate (a zero-byte write into `dst`'s region; for a GPU region without
    /// network keys, into its owner engine's immediate slot: the receiver counts it the same).
    pub fn submit_imm(&self, imm: u32, dst: &MrDescriptor, on_done: OnDone) -> Result<()> {
        if !dst.network_reachable() {
            return self.submit_imm_to(imm, &dst.owner, on_done);
        }
        let target = self.region_target(dst)?;
        self.submit_imm_to_targets(imm, vec![target], on_done)
    }

    /// Sends only an immediate to an engine (its immediate slot); no region needed.
    pub fn submit_imm_to(&self, imm: u32, peer: &EngineAddress, on_done: OnDone) -> Result<()> {
        let target = self.engine_target(peer)?;
        self.submit_imm_to_targets(imm, vec![target], on_done)
    }

    fn submit_imm_to_targets(&self, imm: u32, targets: Vec<crate::worker::Target>, on_done: OnDone) -> Result<()> {
        let n = self.num_domains();
        let start = self.rotate(targets.len());
        let mut shards: Vec<Shard> = (0..targets.len())
            .map(|p| Shard {
                peer: p as u32,
                domain: ((start + p) % n) as u16,
                src_offset: 0,
                len: 0,
                dst_offset: 0,
                imm: None,
            })
            .collect();
        let deferred = plan_imms(&mut shards, &vec![Some(imm); targets.len()]);
        self.submit_transfer(Transfer {
            region: SCRATCH_REGION,
            targets,
            shards,
            deferred,
            on_done: Notify::Callback(on_done),
        })
    }

    /// Registers a set of peer engines for scatters and barriers.
    pub fn add_peer_group(&self, peers: &[EngineAddress]) -> Result<PeerGroup> {
        if peers.is_empty() {
            return Err(FabricError::InvalidArgument("a peer group needs at least one peer".into()));
        }
        for p in peers {
            self.check_peer(p)?;
        }
        let id = self.next_group.fetch_add(1, Ordering::Relaxed);
        self.peer_groups.write().insert(id, peers.to_vec());
        Ok(PeerGroup(id))
    }

    fn group(&self, group: PeerGroup) -> Result<Vec<EngineAddress>> {
        self.peer_groups
            .read()
            .get(&group.0)
            .cloned()
            .ok_or_else(|| FabricError::InvalidArgument(format!("peer group {} does not exist", group.0)))
    }

    /// Writes a different slice of one local region to each target; each target's receiver
    /// counts `imm` once. With a `group`, every target must belong to it.
    pub fn submit_scatter(
        &self,
        group: Option<PeerGroup>,
        src: MrHandle,
        targets: &[ScatterTarget<'_>],
        imm: Option<u32>,
        sharding: ScatterSharding,
        on_done: OnDone,
    ) -> Result<()> {
        if targets.is_empty() {
            return Err(FabricError::InvalidArgument("scatter with no targets".into()));
        }
        let src_len = self.region_len(src)?;
        if self.region_kind(src)? != MemoryKind::Host || targets.iter().any(|t| t.dst.kind != MemoryKind::Host) {
            return Err(FabricError::InvalidArgument(
                "submit_scatter does not support GPU memory yet; use one submit_write per target".into(),
            ));
        }
        let members = group.map(|g| self.group(g)).transpose()?;
        let n = self.num_domains();
        let start = self.rotate(targets.len());
        let mut resolved = Vec::with_capacity(targets.len());
        let mut shards = Vec::with_capacity(targets.len());
        for (p, t) in targets.iter().enumerate() {
            check_range("source", src_len, t.src_offset, t.len)?;
            t.dst.check_range(t.dst_offset, t.len)?;
            if let Some(members) = &members {
                if !members.contains(&t.dst.owner) {
                    return Err(FabricError::InvalidArgument(format!(
                        "scatter target {p} is not a member of the peer group"
                    )));
                }
            }
            resolved.push(self.region_target(t.dst)?);
            let pieces = match sharding {
                ScatterSharding::ByPeer => vec![((start + p) % n, 0, t.len)],
                ScatterSharding::ByBytes => split_bytes(t.len, n, n, start + p, self.config().shard_min_bytes),
            };
            shards.extend(pieces.into_iter().map(|(domain, off, len)| Shard {
                peer: p as u32,
                domain: domain as u16,
                src_offset: t.src_offset + off,
                len,
                dst_offset: t.dst_offset + off,
                imm: None,
            }));
        }
        let deferred = plan_imms(&mut shards, &vec![imm; targets.len()]);
        self.submit_transfer(Transfer {
            region: src.0,
            targets: resolved,
            shards,
            deferred,
            on_done: Notify::Callback(on_done),
        })
    }

    /// Sends `imm` to every member of `group` (each member counts it once).
    pub fn submit_barrier(&self, imm: u32, group: PeerGroup, on_done: OnDone) -> Result<()> {
        let members = self.group(group)?;
        let targets = members.iter().map(|m| self.engine_target(m)).collect::<Result<Vec<_>>>()?;
        self.submit_imm_to_targets(imm, targets, on_done)
    }
}
