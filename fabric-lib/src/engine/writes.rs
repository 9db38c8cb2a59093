//! Single and paged writes: validated in full and planned on the caller's thread (nothing is
//! posted if any part is out of range), then handed to the worker as one request.
//!
//! Immediate contract: a request delivers its immediate **exactly once to each target peer**,
//! however the engine cut it across domains (see [`crate::sharding`]).
use std::sync::Arc;

use super::pages::{check_page_lists, check_page_range};
use super::routing::{Route, StagedRoute};
use super::{MrHandle, TransferEngine};
use crate::commands::{Command, SameHostTransfer, Shards, StagedTransfer, TargetList, Transfer, SCRATCH_REGION};
use crate::completion::{CompletionCounter, Notify, OnDone};
use crate::descriptor::{check_range, MrDescriptor};
use crate::error::{FabricError, Result};
use crate::provider::same_host::{Pages, SameHostCopy, SameHostDst};
use crate::requests::{PagedWriteRequest, WriteRequest};
use crate::sharding::{page_runs, place_imm, split_bytes, DomainChoice, Pieces, Shard};

/// The longest write that pages adjacent on both sides are merged into on one domain.
const MAX_PAGE_RUN: u64 = 16 << 20;

impl TransferEngine {
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
        self.command(self.plan_write(req, on_done)?)
    }

    /// Refuses a pinned domain this engine does not have.
    pub(super) fn check_domain(&self, choice: DomainChoice) -> Result<()> {
        let n = self.num_domains();
        match choice {
            DomainChoice::Pinned(d) if d >= n => {
                Err(FabricError::InvalidArgument(format!("domain {d} out of range: this engine has {n}")))
            }
            _ => Ok(()),
        }
    }

    /// The (domain, offset, length) pieces of one contiguous transfer of `len` bytes (a checked
    /// `choice`): the pinned domain, or shards over the engine's domains.
    pub(super) fn domain_pieces(&self, len: u64, choice: DomainChoice) -> Pieces {
        match choice {
            DomainChoice::Pinned(d) => smallvec::smallvec![(d, 0, len)],
            DomainChoice::Shard(k) => {
                split_bytes(len, self.num_domains(), k, self.rotate(1), self.config().shard_min_bytes)
            }
        }
    }

    /// Checks and plans a write into the command that carries it (posted now, or armed).
    pub(super) fn plan_write(&self, req: &WriteRequest<'_>, on_done: Notify) -> Result<Command> {
        check_range("source", self.region_len(req.src)?, req.src_offset, req.len)?;
        let route = self.route(req.src, req.dst)?;
        req.dst.check_range(req.dst_offset, req.len)?;
        self.check_domain(req.domains)?;
        let target = match route {
            Route::Network(t) => t,
            Route::SameHost(local) => {
                let copy =
                    SameHostCopy::Contiguous { src_offset: req.src_offset, dst_offset: req.dst_offset, len: req.len };
                return self.plan_same_host(req.src, req.dst, local, copy, req.imm, on_done);
            }
            Route::Staged(staged) => {
                let pieces = vec![(req.src_offset, req.dst_offset, req.len)];
                return self.plan_staged(req.src, req.dst, staged, pieces, req.imm, on_done);
            }
        };
        let mut shards: Shards = self
            .domain_pieces(req.len, req.domains)
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
        let deferred = place_imm(&mut shards, req.imm);
        Ok(Command::Transfer(Transfer {
            region: req.src.0,
            targets: TargetList::Own(smallvec::smallvec![target]),
            shards,
            deferred,
            on_done,
        }))
    }

    /// Posts a paged write (see [`PagedWriteRequest`]); every page index is checked against both
    /// regions before anything is posted.
    pub fn submit_paged_writes(&self, req: &PagedWriteRequest<'_>, on_done: OnDone) -> Result<()> {
        let src_len = self.region_len(req.src)?;
        let route = self.route(req.src, req.dst)?;
        check_page_lists("write", req.page_len, req.src_pages, req.dst_pages)?;
        check_page_range("source", req.src_pages, req.src_stride, req.src_offset, req.page_len, src_len)?;
        check_page_range("destination", req.dst_pages, req.dst_stride, req.dst_offset, req.page_len, req.dst.len)?;
        let target = match route {
            Route::Network(t) => t,
            Route::SameHost(local) => {
                if req.src_pages.len() > u32::MAX as usize {
                    return Err(FabricError::InvalidArgument("too many pages for one paged write".into()));
                }
                let copy = SameHostCopy::Paged(Pages {
                    page_len: req.page_len,
                    src_pages: req.src_pages.to_vec(),
                    src_stride: req.src_stride,
                    src_offset: req.src_offset,
                    dst_pages: req.dst_pages.to_vec(),
                    dst_stride: req.dst_stride,
                    dst_offset: req.dst_offset,
                });
                let on_done = Notify::Callback(on_done);
                return self.command(self.plan_same_host(req.src, req.dst, local, copy, req.imm, on_done)?);
            }
            Route::Staged(staged) => {
                let pieces = req
                    .src_pages
                    .iter()
                    .zip(req.dst_pages)
                    .map(|(&s, &d)| {
                        let src = u64::from(s) * req.src_stride + req.src_offset;
                        (src, u64::from(d) * req.dst_stride + req.dst_offset, req.page_len)
                    })
                    .collect();
                let on_done = Notify::Callback(on_done);
                return self.command(self.plan_staged(req.src, req.dst, staged, pieces, req.imm, on_done)?);
            }
        };
        let n = self.num_domains();
        let pages = req.src_pages.iter().zip(req.dst_pages).map(|(&s, &d)| {
            (u64::from(s) * req.src_stride + req.src_offset, u64::from(d) * req.dst_stride + req.dst_offset)
        });
        // With several domains, runs stay small enough to spread over them.
        let max_run = if n > 1 { self.config().shard_min_bytes } else { MAX_PAGE_RUN }.max(req.page_len);
        let runs = page_runs(pages, req.page_len, max_run);
        let start = self.rotate(runs.len());
        let mut shards: Shards = runs
            .into_iter()
            .enumerate()
            .map(|(i, (src_offset, dst_offset, len))| Shard {
                peer: 0,
                domain: ((start + i) % n) as u16,
                src_offset,
                len,
                dst_offset,
                imm: None,
            })
            .collect();
        let deferred = place_imm(&mut shards, req.imm);
        self.submit_transfer(Transfer {
            region: req.src.0,
            targets: TargetList::Own(smallvec::smallvec![target]),
            shards,
            deferred,
            on_done: Notify::Callback(on_done),
        })
    }

    pub(super) fn plan_same_host(
        &self,
        src: MrHandle,
        dst: &MrDescriptor,
        local: SameHostDst,
        copy: SameHostCopy,
        imm: Option<u32>,
        on_done: Notify,
    ) -> Result<Command> {
        let imm = match imm {
            Some(imm) => Some(self.same_host_imm_target(imm, &dst.owner)?),
            None => None,
        };
        Ok(Command::SameHost(Box::new(SameHostTransfer { region: src.0, write: Some((local, copy)), imm, on_done })))
    }

    /// Plans a staged write (see `staging`): `pieces` are (source offset, destination offset,
    /// length).
    pub(super) fn plan_staged(
        &self,
        src: MrHandle,
        dst: &MrDescriptor,
        route: StagedRoute,
        pieces: Vec<(u64, u64, u64)>,
        imm: Option<u32>,
        on_done: Notify,
    ) -> Result<Command> {
        if pieces.iter().all(|p| p.2 == 0) {
            // No bytes to stage: the immediate alone goes to the owner's immediate slot.
            let targets = smallvec::smallvec![self.engine_target(&dst.owner)?];
            let mut shards = match imm {
                Some(_) => {
                    let domain = (self.rotate(1) % self.num_domains()) as u16;
                    smallvec::smallvec![Shard { peer: 0, domain, src_offset: 0, len: 0, dst_offset: 0, imm: None }]
                }
                None => Shards::new(),
            };
            let deferred = place_imm(&mut shards, imm);
            return Ok(Command::Transfer(Transfer {
                region: SCRATCH_REGION,
                targets: targets.into(),
                shards,
                deferred,
                on_done,
            }));
        }
        let StagedRoute { bounce, target, dest } = route;
        Ok(Command::Staged(StagedTransfer { region: src.0, bounce, target, dest, pieces, imm, on_done }))
    }
}
