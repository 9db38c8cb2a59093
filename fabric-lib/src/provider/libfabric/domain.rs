//! One open libfabric domain: fabric, domain, completion queue, address vector and one RDM
//! endpoint, with the data-path calls the worker needs.
use std::ffi::c_void;
use std::ptr;
use std::rc::Rc;

use libfabric_sys as sys;
use rustc_hash::FxHashMap;

use super::context::OpContext;
use super::dmabuf::NicRegistration;
use super::error::libfabric_error;
use super::info::{resolve, DomainSpec, FabricInfo};
use super::mr::{Access, LocalMr, MrMemory};
use crate::config::GpuRegistration;
use crate::error::{FabricError, Result};

/// Completion entries read per `fi_cq_read` call.
pub const CQ_BATCH: usize = 32;

/// The libfabric objects of one domain, closed in reverse order of opening.
pub struct DomainFids {
    fabric: *mut sys::fid_fabric,
    pub(super) domain: *mut sys::fid_domain,
    cq: *mut sys::fid_cq,
    av: *mut sys::fid_av,
    pub(super) ep: *mut sys::fid_ep,
}

impl Drop for DomainFids {
    fn drop(&mut self) {
        // SAFETY: each non-null fid was opened by us and is closed once, endpoint first.
        unsafe {
            for fid in [
                self.ep as *mut sys::fid,
                self.av as *mut sys::fid,
                self.cq as *mut sys::fid,
                self.domain as *mut sys::fid,
                self.fabric as *mut sys::fid,
            ] {
                if !fid.is_null() {
                    let ret = sys::shim_fi_close(fid);
                    if ret != 0 {
                        tracing::warn!("fi_close returned {ret}");
                    }
                }
            }
        }
    }
}

/// A completion read from the CQ.
#[derive(Debug)]
pub enum Completion {
    /// A local operation (write, send, or a receive) finished.
    Done { context: *mut OpContext, len: usize },
    /// Remote CQ data arrived: a write with an immediate landed here (`context` is a consumed
    /// receive when the provider needs FI_RX_CQ_DATA, else undefined), or a message sent with
    /// CQ data filled the receive `context` with `len` bytes.
    RemoteImm { data: u64, context: *mut OpContext, len: usize },
    /// An operation failed.
    Failed { context: *mut OpContext, message: String },
}

/// Outcome of posting one operation.
#[derive(Debug)]
pub enum Posted {
    Ok,
    /// The provider's queue is full: progress completions and post again.
    Again,
}

/// One libfabric domain with its endpoint, owned by a single thread.
pub struct LibfabricDomain {
    pub(super) info: FabricInfo,
    pub(super) fids: Rc<DomainFids>,
    address: Vec<u8>,
    peers: FxHashMap<Vec<u8>, sys::fi_addr_t>,
    entries: Vec<sys::fi_cq_data_entry>,
}

/// A random memory key of `bytes` bytes (the provider's mr_key_size), never 0.
fn random_key(bytes: usize) -> Result<u64> {
    let raw = getrandom::u64().map_err(|e| FabricError::InvalidArgument(format!("no random source: {e}")))?;
    let key = if bytes >= 8 { raw } else { raw & ((1u64 << (8 * bytes)) - 1) };
    Ok(key.max(1))
}

fn check(call: &'static str, ret: i32) -> Result<()> {
    if ret == 0 {
        Ok(())
    } else {
        Err(libfabric_error(call, ret.into()))
    }
}

impl LibfabricDomain {
    /// Opens the domain named by `spec` and enables one endpoint on it; `hmem` asks for
    /// device-memory support (FI_HMEM) where the provider offers it (`None`: RDMA providers only).
    pub fn open(spec: &DomainSpec, hmem: Option<bool>) -> Result<Self> {
        let mut info = resolve(spec, hmem)?;
        info.set_unique_shm_name();
        let mut fids = DomainFids {
            fabric: ptr::null_mut(),
            domain: ptr::null_mut(),
            cq: ptr::null_mut(),
            av: ptr::null_mut(),
            ep: ptr::null_mut(),
        };
        // SAFETY: each call gets attributes from a valid fi_info and out-pointers we own; on any
        // failure `fids` closes whatever was opened so far.
        unsafe {
            let raw = info.raw();
            check("fi_fabric", sys::shim_fi_fabric((*raw).fabric_attr, &mut fids.fabric, ptr::null_mut()))?;
            check("fi_domain", sys::shim_fi_domain(fids.fabric, raw, &mut fids.domain, ptr::null_mut()))?;
            let mut cq_attr = sys::fi_cq_attr {
                size: info.tx_size() + info.rx_size(),
                format: sys::FI_CQ_FORMAT_DATA,
                wait_obj: sys::FI_WAIT_NONE,
                ..Default::default()
            };
            check("fi_cq_open", sys::shim_fi_cq_open(fids.domain, &mut cq_attr, &mut fids.cq, ptr::null_mut()))?;
            let mut av_attr = sys::fi_av_attr { type_: sys::FI_AV_TABLE, ..Default::default() };
            check("fi_av_open", sys::shim_fi_av_open(fids.domain, &mut av_attr, &mut fids.av, ptr::null_mut()))?;
            check("fi_endpoint", sys::shim_fi_endpoint(fids.domain, raw, &mut fids.ep, ptr::null_mut()))?;
            check(
                "fi_ep_bind(cq)",
                sys::shim_fi_ep_bind(fids.ep, &mut (*fids.cq).fid, (sys::FI_TRANSMIT | sys::FI_RECV) as u64),
            )?;
            check("fi_ep_bind(av)", sys::shim_fi_ep_bind(fids.ep, &mut (*fids.av).fid, 0))?;
            check("fi_enable", sys::shim_fi_enable(fids.ep))?;
        }
        let mut name = vec![0u8; 256];
        let mut len = name.len();
        // SAFETY: ep is enabled; name has `len` writable bytes and fi_getname updates len.
        let ret = unsafe { sys::shim_fi_getname(&mut (*fids.ep).fid, name.as_mut_ptr() as *mut c_void, &mut len) };
        check("fi_getname", ret)?;
        name.truncate(len);
        tracing::debug!(provider = %info.provider_name(), domain = %info.domain_name(), "opened libfabric domain");
        Ok(LibfabricDomain {
            info,
            fids: Rc::new(fids),
            address: name,
            peers: FxHashMap::default(),
            entries: vec![sys::fi_cq_data_entry::default(); CQ_BATCH],
        })
    }

    /// This endpoint's address (`fi_getname`).
    pub fn address(&self) -> &[u8] {
        &self.address
    }

    /// Provider name, e.g. `tcp;ofi_rxm`.
    pub fn provider_name(&self) -> String {
        self.info.provider_name()
    }

    /// Domain name, e.g. `lo`.
    pub fn domain_name(&self) -> String {
        self.info.domain_name()
    }

    /// Whether this domain registers and moves CUDA memory itself (FI_HMEM).
    pub fn has_hmem(&self) -> bool {
        self.info.has_hmem()
    }

    /// Whether receives are consumed by remote writes carrying CQ data (FI_RX_CQ_DATA mode).
    pub fn imm_consumes_recv(&self) -> bool {
        self.info.mode() & sys::FI_RX_CQ_DATA != 0
    }

    /// Whether remote CQ data has 8 bytes: room for an epoch tag above the immediate.
    pub fn wide_cq_data(&self) -> bool {
        self.info.cq_data_size() >= 8
    }

    /// Largest single message the endpoint accepts.
    pub fn max_msg_size(&self) -> usize {
        self.info.max_msg_size()
    }

    /// Registers memory on this domain, honouring the provider's mr_mode. Where we choose the
    /// key, it is a random 64-bit number: a peer can reach only regions whose descriptor it was
    /// given, never a neighbour by guessing (sequential keys let a key changed by one hit
    /// another region), and a descriptor kept across a restart or sent to the wrong engine
    /// matches nothing.
    pub fn register(&mut self, ptr: *mut u8, len: usize, access: Access) -> Result<LocalMr> {
        self.register_on(ptr, len, access, MrMemory::Host)
    }

    /// Registers CUDA memory of `device` (FI_HMEM domains only): the provider moves it without
    /// staging through host memory. `mode` picks DMA-BUF or the CUDA interface (see
    /// [`GpuRegistration`]); returns which one registered it. `access`: as for host memory.
    pub fn register_cuda(
        &mut self,
        ptr: *mut u8,
        len: usize,
        device: u32,
        mode: GpuRegistration,
        access: Access,
    ) -> Result<(LocalMr, NicRegistration)> {
        if !self.has_hmem() {
            return Err(FabricError::ProviderUnavailable(format!(
                "provider '{}' was opened without FI_HMEM: it cannot register GPU memory",
                self.provider_name()
            )));
        }
        let attempts = super::dmabuf::attempts(mode, self.info.api_version(), &self.provider_name())?;
        let mut failures = Vec::new();
        for how in attempts {
            let registered = match how {
                NicRegistration::CudaIface => self.register_on(ptr, len, access, MrMemory::Cuda(device)),
                NicRegistration::Dmabuf => self.register_dmabuf(ptr, len, device, access),
            };
            match registered {
                Ok(mr) => {
                    tracing::debug!(
                        provider = %self.provider_name(),
                        domain = %self.domain_name(),
                        "GPU memory {ptr:p}+{len} of cuda:{device} registered through {how}"
                    );
                    return Ok((mr, how));
                }
                Err(e) => {
                    tracing::info!("registering GPU memory {ptr:p}+{len} through {how} failed: {e}");
                    failures.push(format!("{how}: {e}"));
                }
            }
        }
        Err(FabricError::ProviderUnavailable(format!(
            "provider '{}' refused GPU memory {ptr:p}+{len} of cuda:{device} ({})",
            self.provider_name(),
            failures.join("; ")
        )))
    }

    /// DMA-BUF registration: exports the range with the CUDA driver, then `FI_MR_DMABUF`.
    fn register_dmabuf(&mut self, ptr: *mut u8, len: usize, device: u32, access: Access) -> Result<LocalMr> {
        let ctx = cuda_lib::Context::new(device as usize)?;
        let range = cuda_lib::export_dmabuf_range(&ctx, ptr as u64, len)
            .map_err(|e| FabricError::Cuda(format!("exporting GPU memory {ptr:p}+{len} as DMA-BUF: {e}")))?;
        let mut mr = self.register_on(ptr, len, access, MrMemory::Dmabuf(Some(device), &range))?;
        mr.dmabuf = Some(range);
        Ok(mr)
    }

    pub(super) fn register_on(
        &mut self,
        ptr: *mut u8,
        len: usize,
        access: Access,
        memory: MrMemory<'_>,
    ) -> Result<LocalMr> {
        let mr_mode = self.info.mr_mode();
        let provider_keys = mr_mode & sys::FI_MR_PROV_KEY as u64 != 0;
        let key_bytes = self.info.mr_key_size().clamp(1, 8);
        for _ in 0..4 {
            let key = if provider_keys { 0 } else { random_key(key_bytes)? };
            match LocalMr::register(&self.fids, ptr, len, access, key, mr_mode, memory) {
                // That random key is taken: draw another.
                Err(FabricError::Libfabric { code, .. }) if code == sys::FI_ENOKEY as i32 && !provider_keys => {}
                other => return other,
            }
        }
        Err(FabricError::Libfabric {
            call: "fi_mr_regattr",
            code: sys::FI_ENOKEY as i32,
            message: "no free random memory key after 4 draws".into(),
        })
    }

    /// Maps a peer's endpoint address to an `fi_addr_t`, inserting it on first use.
    pub fn resolve_peer(&mut self, address: &[u8]) -> Result<sys::fi_addr_t> {
        if let Some(a) = self.peers.get(address) {
            return Ok(*a);
        }
        super::check_endpoint(self.info.addr_format(), &self.address, address)?;
        let mut fi_addr: sys::fi_addr_t = 0;
        // SAFETY: av is open; address holds one raw endpoint name of this provider's format.
        let ret = unsafe {
            sys::shim_fi_av_insert(self.fids.av, address.as_ptr() as *const c_void, 1, &mut fi_addr, 0, ptr::null_mut())
        };
        if ret != 1 {
            return Err(FabricError::InvalidDescriptor(format!(
                "fi_av_insert rejected the peer address ({} bytes, returned {ret})",
                address.len()
            )));
        }
        self.peers.insert(address.to_vec(), fi_addr);
        Ok(fi_addr)
    }

    /// The `fi_addr_t` of a peer already in the address vector. Entries are never removed:
    /// providers keep state per address (connections, retransmit queues) that operations still
    /// in flight use, and libfabric 1.17 crashed when an entry went away under them.
    pub fn known_peer(&self, address: &[u8]) -> Option<sys::fi_addr_t> {
        self.peers.get(address).copied()
    }

    pub(super) fn posted(call: &'static str, ret: isize) -> Result<Posted> {
        match ret {
            0 => Ok(Posted::Ok),
            r if r == -(sys::FI_EAGAIN as isize) => Ok(Posted::Again),
            r => Err(libfabric_error(call, r as i64)),
        }
    }

    /// Posts one RMA write (with remote CQ data when `imm` is set: the immediate, and the
    /// epoch tag where the provider has 8 bytes of it). With `delivery_complete`, its
    /// completion means the bytes are visible in the target's memory (FI_DELIVERY_COMPLETE).
    ///
    /// # Safety
    /// `local` must stay valid and registered (with `desc`) until the completion of `context`
    /// is read; `context` must stay at its address until then.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn post_write(
        &mut self,
        local: *const u8,
        len: usize,
        desc: *mut c_void,
        dest: sys::fi_addr_t,
        remote_addr: u64,
        key: u64,
        imm: Option<u64>,
        delivery_complete: bool,
        context: *mut OpContext,
    ) -> Result<Posted> {
        let ep = self.fids.ep;
        let ctx = context as *mut c_void;
        let buf = local as *const c_void;
        if delivery_complete {
            let iov = sys::iovec { iov_base: local as *mut c_void, iov_len: len };
            let rma = sys::fi_rma_iov { addr: remote_addr, len, key };
            let mut desc = desc;
            let msg = sys::fi_msg_rma {
                msg_iov: &iov,
                desc: &mut desc,
                iov_count: 1,
                addr: dest,
                rma_iov: &rma,
                rma_iov_count: 1,
                context: ctx,
                data: imm.unwrap_or(0),
            };
            let mut flags = (sys::FI_DELIVERY_COMPLETE | sys::FI_COMPLETION) as u64;
            if imm.is_some() {
                flags |= sys::FI_REMOTE_CQ_DATA as u64;
            }
            // SAFETY: msg and the iovs it points to live across the call (the provider copies
            // them); buffers and context per the caller's contract.
            return Self::posted("fi_writemsg", unsafe { sys::shim_fi_writemsg(ep, &msg, flags) });
        }
        // SAFETY: forwarded from the caller's contract; ep is enabled.
        let ret = unsafe {
            match imm {
                Some(data) => sys::shim_fi_writedata(ep, buf, len, desc, data, dest, remote_addr, key, ctx),
                None => sys::shim_fi_write(ep, buf, len, desc, dest, remote_addr, key, ctx),
            }
        };
        Self::posted("fi_writedata", ret)
    }

    /// Posts one two-sided send.
    ///
    /// # Safety
    /// As for [`LibfabricDomain::post_write`].
    /// With `delivery_complete`, the completion means the receiver took the message
    /// (FI_DELIVERY_COMPLETE): a send into a connection the receiver reset fails instead of
    /// "succeeding" into the void. `data` is sent as remote CQ data (control messages).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn post_send(
        &mut self,
        local: *const u8,
        len: usize,
        desc: *mut c_void,
        dest: sys::fi_addr_t,
        delivery_complete: bool,
        data: Option<u64>,
        context: *mut OpContext,
    ) -> Result<Posted> {
        if delivery_complete || data.is_some() {
            let iov = sys::iovec { iov_base: local as *mut c_void, iov_len: len };
            let mut desc = desc;
            let msg = sys::fi_msg {
                msg_iov: &iov,
                desc: &mut desc,
                iov_count: 1,
                addr: dest,
                context: context as *mut c_void,
                data: data.unwrap_or(0),
            };
            let mut flags = sys::FI_COMPLETION as u64;
            if delivery_complete {
                flags |= sys::FI_DELIVERY_COMPLETE as u64;
            }
            if data.is_some() {
                flags |= sys::FI_REMOTE_CQ_DATA as u64;
            }
            // SAFETY: msg and the iov it points to live across the call (the provider copies
            // them); buffer and context per the caller's contract.
            return Self::posted("fi_sendmsg", unsafe { sys::shim_fi_sendmsg(self.fids.ep, &msg, flags) });
        }
        // SAFETY: forwarded from the caller's contract.
        let ret =
            unsafe { sys::shim_fi_send(self.fids.ep, local as *const c_void, len, desc, dest, context as *mut c_void) };
        Self::posted("fi_send", ret)
    }

    /// Posts one receive buffer for messages from any peer.
    ///
    /// # Safety
    /// As for [`LibfabricDomain::post_write`], with `buf` writable.
    pub unsafe fn post_recv(
        &mut self,
        buf: *mut u8,
        len: usize,
        desc: *mut c_void,
        context: *mut OpContext,
    ) -> Result<Posted> {
        // SAFETY: forwarded from the caller's contract.
        let ret = unsafe {
            sys::shim_fi_recv(
                self.fids.ep,
                buf as *mut c_void,
                len,
                desc,
                libfabric_sys::FI_ADDR_UNSPEC_VALUE,
                context as *mut c_void,
            )
        };
        Self::posted("fi_recv", ret)
    }

    /// Reads up to [`CQ_BATCH`] completions (this is also what drives manual progress).
    pub fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize> {
        // SAFETY: entries has CQ_BATCH slots of the FI_CQ_FORMAT_DATA layout the CQ was opened with.
        let ret = unsafe { sys::shim_fi_cq_read(self.fids.cq, self.entries.as_mut_ptr() as *mut c_void, CQ_BATCH) };
        if ret > 0 {
            for e in &self.entries[..ret as usize] {
                let context = e.op_context as *mut OpContext;
                if e.flags & sys::FI_REMOTE_CQ_DATA as u64 != 0 {
                    out.push(Completion::RemoteImm { data: e.data, context, len: e.len });
                } else {
                    out.push(Completion::Done { context, len: e.len });
                }
            }
            return Ok(ret as usize);
        }
        if ret == -(sys::FI_EAGAIN as isize) {
            return Ok(0);
        }
        if ret == -(sys::FI_EAVAIL as isize) {
            // Domains opened with API >= 1.20 get the newer, longer entry (src_addr added): room
            // for it behind the 1.17 layout the bindings know.
            #[repr(C)]
            #[derive(Default)]
            struct ErrEntry {
                entry: sys::fi_cq_err_entry,
                newer_fields: [u64; 8],
            }
            let mut padded = ErrEntry::default();
            // SAFETY: an error entry is available; `padded` is a valid out-struct with room for
            // every layout up to libfabric 2.x's.
            let r = unsafe { sys::shim_fi_cq_readerr(self.fids.cq, &mut padded.entry, 0) };
            let err = padded.entry;
            if r < 0 {
                return Err(libfabric_error("fi_cq_readerr", r as i64));
            }
            let mut buf = [0 as std::os::raw::c_char; 256];
            // SAFETY: cq is open; err came from it; buf has 256 bytes.
            let text = unsafe {
                let p =
                    sys::shim_fi_cq_strerror(self.fids.cq, err.prov_errno, err.err_data, buf.as_mut_ptr(), buf.len());
                if p.is_null() {
                    String::new()
                } else {
                    std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
                }
            };
            let message = format!("{} (provider: {text})", super::strerror(err.err));
            out.push(Completion::Failed { context: err.op_context as *mut OpContext, message });
            return Ok(1);
        }
        Err(libfabric_error("fi_cq_read", ret as i64))
    }
}
