//! Single and paged reads: pull bytes of a peer's region into a local one. Checked in full on the
//! caller's thread (both ranges, the peer's read permission, the provider's read capability)
//! before anything is posted; the request completes once the bytes are in the local region.
//!
//! A peer region is readable only when its owner registered it with `remote_read`: the
//! descriptor says so (checked here, a typed error before anything is posted) and its provider
//! keys carry FI_REMOTE_READ only then (what the owner's provider enforces against a forged
//! descriptor).
use std::sync::Arc;

use super::pages::{check_page_lists, check_page_range};
use super::routing::Route;
use super::{MrHandle, RegionInfo, TransferEngine};
use crate::commands::{Command, Shards, Target, TargetList, Transfer};
use crate::completion::{CompletionCounter, Notify, OnDone};
use crate::descriptor::{check_range, MrDescriptor};
use crate::error::{FabricError, Result};
use crate::provider::same_host::{Pages, SameHostCopy};
use crate::requests::{PagedReadRequest, ReadRequest};
use crate::sharding::{Pieces, Shard};

impl TransferEngine {
    /// Reads `req.len` bytes of a peer region into a local one; `on_done` runs on the callback
    /// thread once the bytes are in the local region (or a part failed). Bad input is rejected
    /// here and nothing is posted.
    pub fn submit_read(&self, req: &ReadRequest<'_>, on_done: OnDone) -> Result<()> {
        self.submit_read_notify(req, Notify::Callback(on_done))
    }

    /// [`TransferEngine::submit_read`] that reports to `counter` instead of a callback: the
    /// worker bumps it directly (no callback-thread hop), the fast path for many small reads.
    pub fn submit_read_counted(&self, req: &ReadRequest<'_>, counter: &Arc<CompletionCounter>) -> Result<()> {
        self.submit_read_notify(req, Notify::Counter(counter.clone()))
    }

    fn submit_read_notify(&self, req: &ReadRequest<'_>, on_done: Notify) -> Result<()> {
        let local = self.read_checks(req.dst, req.src)?;
        check_range("destination", local.len, req.dst_offset, req.len)?;
        check_range("source", req.src.len, req.src_offset, req.len)?;
        self.check_domain(req.domains)?;
        let target = match self.read_route(req.dst, req.src)? {
            Route::Network(t) => t,
            Route::Staged(_) => unreachable!("read_route never returns a staged route"),
            Route::SameHost(peer) => {
                let copy =
                    SameHostCopy::Contiguous { src_offset: req.src_offset, dst_offset: req.dst_offset, len: req.len };
                return self.command(Command::SameHostRead(Box::new(crate::commands::SameHostRead {
                    region: req.dst.0,
                    peer,
                    copy,
                    on_done,
                })));
            }
        };
        let pieces = if req.len == 0 { Pieces::new() } else { self.domain_pieces(req.len, req.domains) };
        let shards = pieces
            .into_iter()
            .map(|(domain, off, len)| Shard {
                peer: 0,
                domain: domain as u16,
                // A read's shard: `src_offset` is local (where the bytes land), `dst_offset` remote.
                src_offset: req.dst_offset + off,
                len,
                dst_offset: req.src_offset + off,
                imm: None,
            })
            .collect();
        self.submit_read_shards(req.dst, target, shards, on_done)
    }

    /// Reads pages of a peer region into pages of a local region (see [`PagedReadRequest`]);
    /// every page index is checked against both regions before anything is posted.
    pub fn submit_paged_reads(&self, req: &PagedReadRequest<'_>, on_done: OnDone) -> Result<()> {
        let local = self.read_checks(req.dst, req.src)?;
        check_page_lists("read", req.page_len, req.src_pages, req.dst_pages)?;
        if req.src_pages.len() > u32::MAX as usize {
            return Err(FabricError::InvalidArgument("too many pages for one paged read".into()));
        }
        check_page_range("source", req.src_pages, req.src_stride, req.src_offset, req.page_len, req.src.len)?;
        check_page_range("destination", req.dst_pages, req.dst_stride, req.dst_offset, req.page_len, local.len)?;
        let on_done = Notify::Callback(on_done);
        let target = match self.read_route(req.dst, req.src)? {
            Route::Network(t) => t,
            Route::Staged(_) => unreachable!("read_route never returns a staged route"),
            Route::SameHost(peer) => {
                // Same layout as a paged write, with the peer as the source side.
                let copy = SameHostCopy::Paged(Pages {
                    page_len: req.page_len,
                    src_pages: req.src_pages.to_vec(),
                    src_stride: req.src_stride,
                    src_offset: req.src_offset,
                    dst_pages: req.dst_pages.to_vec(),
                    dst_stride: req.dst_stride,
                    dst_offset: req.dst_offset,
                });
                return self.command(Command::SameHostRead(Box::new(crate::commands::SameHostRead {
                    region: req.dst.0,
                    peer,
                    copy,
                    on_done,
                })));
            }
        };
        let n = self.num_domains();
        let start = self.rotate(req.src_pages.len());
        let shards = req
            .src_pages
            .iter()
            .zip(req.dst_pages)
            .enumerate()
            .map(|(i, (&s, &d))| Shard {
                peer: 0,
                domain: ((start + i) % n) as u16,
                src_offset: u64::from(d) * req.dst_stride + req.dst_offset,
                len: req.page_len,
                dst_offset: u64::from(s) * req.src_stride + req.src_offset,
                imm: None,
            })
            .collect();
        self.submit_read_shards(req.dst, target, shards, on_done)
    }

    /// What every read checks first: the local region exists, the peer region is readable and
    /// belongs to a compatible engine, and this provider can read at all.
    fn read_checks(&self, dst: MrHandle, src: &MrDescriptor) -> Result<RegionInfo> {
        let local = self.region_info(dst)?;
        self.check_peer(&src.owner)?;
        src.check_readable()?;
        Ok(local)
    }

    /// The path of a read: the same-host channel when GPU memory is on either side and the
    /// owner shares this host (unless `force_network`), the provider otherwise.
    fn read_route(&self, dst: MrHandle, src: &MrDescriptor) -> Result<Route> {
        // The routing rules are those of writes, with the peer as the source side (host to host
        // over the provider whatever `same_host_host_memory` says); reads are never staged: GPU
        // memory the NIC cannot reach is read on the same host only.
        let route = match self.route_via(dst, src, false)? {
            Route::Staged(_) => {
                let local = self.region_info(dst)?;
                if !local.network || !src.network_reachable() {
                    return Err(FabricError::ProviderUnavailable(format!(
                        "a read of GPU memory the NIC cannot reach takes the network here, and provider '{}' \
                         has no FI_HMEM; reads are not staged through host memory (writes are): have the \
                         owner write it, or use a provider with FI_HMEM (docs/gpu.md)",
                        self.provider()
                    )));
                }
                Route::Network(self.region_target(src)?)
            }
            route => route,
        };
        if matches!(route, Route::Network(_)) && !self.rma_read {
            return Err(FabricError::ProviderUnavailable(format!(
                "provider '{}' cannot do RMA reads here (no FI_READ / FI_REMOTE_READ); use writes, or \
                 a provider that reads (tcp, udp;ofi_rxd, shm, efa, verbs;ofi_rxm)",
                self.provider()
            )));
        }
        Ok(route)
    }

    fn submit_read_shards(&self, dst: MrHandle, target: Target, shards: Shards, on_done: Notify) -> Result<()> {
        self.command(Command::Read(Transfer {
            region: dst.0,
            targets: TargetList::Own(smallvec::smallvec![target]),
            shards,
            deferred: Vec::new(),
            on_done,
        }))
    }
}
