//! Prepared scatters: a source region and a fixed list of destination regions, checked and
//! turned into worker targets once, for a caller that writes to the same peers on every call
//! (the all-to-all's CPU proxy posts one scatter per remote rank set, several per step).
//!
//! A call then checks only its slices' ranges and hands the worker one shared reference to the
//! target list: no route, peer check or endpoint copy per destination. Destinations that do not
//! all go over the provider (same-host or staged GPU memory) are kept as descriptors, and each
//! call takes the general [`TransferEngine::submit_scatter`] path with them.
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::routing::Route;
use super::{MrHandle, TransferEngine};
use crate::commands::{Target, TargetList, Transfer};
use crate::completion::{CompletionCounter, Notify, OnDone};
use crate::descriptor::{check_range, MrDescriptor};
use crate::error::{FabricError, Result};
use crate::requests::{ScatterSharding, ScatterSlice, ScatterTarget};

/// Destinations of scatters from one source region, checked once by
/// [`TransferEngine::prepare_scatter`]; see [`TransferEngine::submit_prepared_scatter`].
pub struct PreparedScatter {
    engine: u64,
    src: MrHandle,
    src_len: u64,
    /// The engine's count of released registrations when it was prepared.
    released_regions: u64,
    /// Each destination's length (the slices' range checks).
    dst_lens: Vec<u64>,
    path: PreparedPath,
}

enum PreparedPath {
    /// Every destination over the provider: the worker's targets, shared by every call.
    Network(Arc<[Target]>),
    /// Some destination takes another path: each call plans like `submit_scatter`.
    General(Vec<MrDescriptor>),
}

impl PreparedScatter {
    /// How many destinations it holds (slices name them by index).
    pub fn len(&self) -> usize {
        self.dst_lens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.dst_lens.is_empty()
    }

    /// Whether calls skip the per-destination planning (every destination over the provider).
    pub fn is_network(&self) -> bool {
        matches!(self.path, PreparedPath::Network(_))
    }
}

impl TransferEngine {
    /// Checks `dsts` as scatter destinations of `src` once (provider, domains, memory paths)
    /// for [`TransferEngine::submit_prepared_scatter`].
    pub fn prepare_scatter(&self, src: MrHandle, dsts: &[MrDescriptor]) -> Result<PreparedScatter> {
        if dsts.is_empty() {
            return Err(FabricError::InvalidArgument("a prepared scatter needs at least one destination".into()));
        }
        let released_regions = self.released_regions.load(Ordering::Acquire);
        let src_info = self.region_info(src)?;
        let mut targets = Vec::with_capacity(dsts.len());
        for dst in dsts {
            // The same route a scatter's target takes (host memory on both sides: the provider).
            match self.route_from(src_info, dst, false)? {
                Route::Network(target) => targets.push(target),
                Route::SameHost(_) | Route::Staged(_) => {
                    targets.clear();
                    break;
                }
            }
        }
        let path = if targets.len() == dsts.len() {
            PreparedPath::Network(targets.into())
        } else {
            PreparedPath::General(dsts.to_vec())
        };
        Ok(PreparedScatter {
            engine: self.id,
            src,
            src_len: src_info.len,
            released_regions,
            dst_lens: dsts.iter().map(|d| d.len).collect(),
            path,
        })
    }

    /// Writes each slice from the prepared source into its destination (at most one slice per
    /// destination); each named destination counts `imm` once, after its bytes landed, and
    /// the others hear nothing. Every slice is checked before anything is posted; `on_done` runs
    /// once. A request that times out fences every destination of the prepared set, as one
    /// scatter to all of them would.
    pub fn submit_prepared_scatter(
        &self,
        prepared: &PreparedScatter,
        slices: &[ScatterSlice],
        imm: Option<u32>,
        sharding: ScatterSharding,
        on_done: OnDone,
    ) -> Result<()> {
        self.prepared_scatter_notify(prepared, slices, imm, sharding, Notify::Callback(on_done))
    }

    /// [`TransferEngine::submit_prepared_scatter`] that reports to `counter`: the worker bumps
    /// it directly (no callback-thread hop, nothing allocated for the completion).
    pub fn submit_prepared_scatter_counted(
        &self,
        prepared: &PreparedScatter,
        slices: &[ScatterSlice],
        imm: Option<u32>,
        sharding: ScatterSharding,
        counter: &Arc<CompletionCounter>,
    ) -> Result<()> {
        self.prepared_scatter_notify(prepared, slices, imm, sharding, Notify::Counter(counter.clone()))
    }

    fn prepared_scatter_notify(
        &self,
        prepared: &PreparedScatter,
        slices: &[ScatterSlice],
        imm: Option<u32>,
        sharding: ScatterSharding,
        on_done: Notify,
    ) -> Result<()> {
        if prepared.engine != self.id {
            return Err(FabricError::InvalidArgument("the prepared scatter belongs to another engine".into()));
        }
        if slices.is_empty() {
            return Err(FabricError::InvalidArgument("scatter with no slices".into()));
        }
        // Which destinations the call names (at most one slice each): their receivers count `imm`.
        // Inline up to 64 destinations (the all-to-all's largest world): nothing to allocate.
        let mut named: smallvec::SmallVec<[bool; 64]> = smallvec::smallvec![false; prepared.len()];
        for s in slices {
            let Some(&dst_len) = prepared.dst_lens.get(s.dst) else {
                return Err(FabricError::InvalidArgument(format!(
                    "slice names destination {} of a prepared scatter of {}",
                    s.dst,
                    prepared.len()
                )));
            };
            if std::mem::replace(&mut named[s.dst], true) {
                return Err(FabricError::InvalidArgument(format!(
                    "two slices name destination {} (one slice per destination and call)",
                    s.dst
                )));
            }
            check_range("source", prepared.src_len, s.src_offset, s.len)?;
            check_range("destination", dst_len, s.dst_offset, s.len)?;
        }
        let targets = match &prepared.path {
            PreparedPath::Network(targets) => targets,
            PreparedPath::General(dsts) => {
                let targets: Vec<ScatterTarget<'_>> = slices
                    .iter()
                    .map(|s| ScatterTarget {
                        len: s.len,
                        src_offset: s.src_offset,
                        dst: &dsts[s.dst],
                        dst_offset: s.dst_offset,
                    })
                    .collect();
                // Not the hot path: a counter is reported through a callback here.
                return self.submit_scatter(None, prepared.src, &targets, imm, sharding, on_done.into_callback());
            }
        };
        // The source must still be registered (the worker checks it again when posting): certain
        // while no registration was released since the scatter was prepared.
        if self.released_regions.load(Ordering::Acquire) != prepared.released_regions {
            self.region_info(prepared.src)?;
        }
        let parts = slices.iter().map(|s| (s.dst, s.src_offset, s.len, s.dst_offset));
        let (shards, deferred) = self.plan_scatter_shards(parts, imm, sharding);
        self.submit_transfer(Transfer {
            region: prepared.src.0,
            targets: TargetList::Shared(targets.clone()),
            shards,
            deferred,
            on_done,
        })
    }
}
