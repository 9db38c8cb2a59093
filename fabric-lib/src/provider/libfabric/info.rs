//! Choosing a provider and domain: builds the hints and picks one `fi_info`.
use std::ffi::{CStr, CString};
use std::ptr;

use libfabric_sys as sys;

use crate::error::{FabricError, Result};

/// RDMA providers tried, in order, when none is named.
const HARDWARE_PROVIDERS: [&str; 2] = ["efa", "verbs;ofi_rxm"];
/// Interface used by software providers when none is named: loopback.
pub const SOFTWARE_DEFAULT_DOMAIN: &str = "lo";

/// Which provider and domains (NICs) a device's engine should open.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProviderSpec {
    /// Provider name as `fi_info -l` prints it (`tcp`, `udp;ofi_rxd`, `shm`, `efa`, ...);
    /// `None` picks an RDMA provider when one exists, else `tcp` on loopback.
    pub provider: Option<String>,
    /// Domain names (NICs or interfaces, e.g. `lo`, `rdmap0s6-rdm`), one domain each; empty
    /// opens one default domain (loopback for software providers).
    pub domains: Vec<String>,
}

/// One domain to open: a provider and an optional domain name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DomainSpec {
    pub provider: Option<String>,
    pub domain: Option<String>,
}

impl ProviderSpec {
    /// A spec for `provider` with the given domains.
    pub fn new(provider: Option<&str>, domains: &[&str]) -> Self {
        ProviderSpec {
            provider: provider.map(str::to_string),
            domains: domains.iter().map(|d| d.to_string()).collect(),
        }
    }

    /// The domains to open, in order (at least one).
    pub fn specs(&self) -> Vec<DomainSpec> {
        if self.domains.is_empty() {
            return vec![DomainSpec { provider: self.provider.clone(), domain: None }];
        }
        self.domains.iter().map(|d| DomainSpec { provider: self.provider.clone(), domain: Some(d.clone()) }).collect()
    }
}

/// An owned `fi_info` (one entry, freed on drop).
pub struct FabricInfo(*mut sys::fi_info);

impl Drop for FabricInfo {
    fn drop(&mut self) {
        // SAFETY: self.0 came from fi_dupinfo and is freed exactly once here.
        unsafe { sys::fi_freeinfo(self.0) }
    }
}

impl FabricInfo {
    pub fn raw(&self) -> *mut sys::fi_info {
        self.0
    }

    fn get(&self) -> &sys::fi_info {
        // SAFETY: non-null (checked at construction) and owned by self.
        unsafe { &*self.0 }
    }

    /// The provider's name, e.g. `tcp;ofi_rxm`.
    pub fn provider_name(&self) -> String {
        // SAFETY: fabric_attr of a returned fi_info is non-null; prov_name is NUL-terminated.
        unsafe { cstr_or_empty((*self.get().fabric_attr).prov_name) }
    }

    /// The domain's name (the NIC or interface).
    pub fn domain_name(&self) -> String {
        // SAFETY: as above, domain_attr is non-null for returned entries.
        unsafe { cstr_or_empty((*self.get().domain_attr).name) }
    }

    pub fn mr_mode(&self) -> u64 {
        // SAFETY: domain_attr is non-null for returned entries.
        unsafe { (*self.get().domain_attr).mr_mode as u64 }
    }

    /// The API version the fabric is opened with (what libfabric reads our structures as).
    pub fn api_version(&self) -> u32 {
        // SAFETY: fabric_attr is non-null for returned entries.
        unsafe { (*self.get().fabric_attr).api_version }
    }

    pub fn mode(&self) -> u64 {
        self.get().mode
    }

    /// Gives the shm provider a unique endpoint name. Its default, `<pid>:<domain>:<ep>`, names a
    /// file in /dev/shm that a killed process leaves behind, so a later process that reuses the
    /// pid fails `fi_enable` with EBUSY.
    pub fn set_unique_shm_name(&mut self) {
        if !self.provider_name().starts_with("shm") {
            return;
        }
        remove_stale_shm_regions();
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = CString::new(format!("fabric-lib-{}-{nanos:x}-{n}", std::process::id())).expect("no NUL");
        // SAFETY: self.0 is a valid fi_info we own; the previous src_addr (if any) was allocated
        // by libfabric with malloc and is replaced by a strdup'ed string that fi_freeinfo frees.
        unsafe {
            let info = &mut *self.0;
            extern "C" {
                fn free(p: *mut std::ffi::c_void);
            }
            free(info.src_addr);
            info.src_addrlen = name.as_bytes_with_nul().len();
            info.src_addr = libc_strdup(&name) as *mut std::ffi::c_void;
        }
    }

    /// Whether the endpoint registers and moves device memory (FI_HMEM).
    pub fn has_hmem(&self) -> bool {
        self.get().caps & sys::FI_HMEM != 0
    }

    /// Bytes of a memory key (keys we choose must fit).
    pub fn mr_key_size(&self) -> usize {
        // SAFETY: domain_attr is set in every fi_info that fi_getinfo returns.
        unsafe { (*self.get().domain_attr).mr_key_size }
    }

    /// The endpoint address format (FI_SOCKADDR_IN, FI_ADDR_STR, ...).
    pub fn addr_format(&self) -> u32 {
        self.get().addr_format
    }

    pub fn cq_data_size(&self) -> usize {
        // SAFETY: domain_attr is non-null for returned entries.
        unsafe { (*self.get().domain_attr).cq_data_size }
    }

    pub fn max_msg_size(&self) -> usize {
        // SAFETY: ep_attr is non-null for returned entries.
        unsafe { (*self.get().ep_attr).max_msg_size }
    }

    pub fn tx_size(&self) -> usize {
        // SAFETY: tx_attr is non-null for returned entries.
        unsafe { (*self.get().tx_attr).size }
    }

    pub fn rx_size(&self) -> usize {
        // SAFETY: rx_attr is non-null for returned entries.
        unsafe { (*self.get().rx_attr).size }
    }
}

/// # Safety
/// `p` must be null or point to a NUL-terminated string.
unsafe fn cstr_or_empty(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: guaranteed by the caller.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// Removes the /dev/shm regions of shm endpoints whose process is gone (a killed process cannot
/// unlink its own; each holds 16 MiB of tmpfs). Only names this library created are touched.
fn remove_stale_shm_regions() {
    let Ok(entries) = std::fs::read_dir("/dev/shm") else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("fabric-lib-")).and_then(|n| n.split('-').next())
        else {
            continue;
        };
        if pid.parse::<u32>().is_ok() && !std::path::Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Requested API version: 1.17, the oldest we test with; FI_HMEM queries ask for 1.20 where the
/// running libfabric has it, as DMA-BUF registration needs (see `dmabuf`).
fn api_version(hmem: bool) -> u32 {
    let base = sys::fi_version(1, 17);
    if hmem && super::dmabuf::runtime_version() >= super::dmabuf::DMABUF_API_VERSION {
        super::dmabuf::DMABUF_API_VERSION
    } else {
        base
    }
}

/// Runs `fi_getinfo` for RDM endpoints with RMA + MSG + remote CQ data, optionally for one
/// provider; returns every match as (provider, domain, info).
fn query(provider: Option<&str>, hmem: bool) -> Result<Vec<FabricInfo>> {
    // SAFETY: fi_allocinfo returns a zeroed fi_info with allocated sub-attributes (or null).
    let hints = unsafe { sys::shim_fi_allocinfo() };
    if hints.is_null() {
        return Err(FabricError::ProviderUnavailable("fi_allocinfo returned null".into()));
    }
    let mut list: *mut sys::fi_info = ptr::null_mut();
    // SAFETY: hints and its attribute structs were allocated by fi_allocinfo; strings we store
    // are strdup'ed so fi_freeinfo can free them.
    let ret = unsafe {
        let h = &mut *hints;
        h.caps = (sys::FI_MSG | sys::FI_RMA) as u64;
        if hmem {
            h.caps |= sys::FI_HMEM;
        }
        h.mode = sys::FI_CONTEXT | sys::FI_CONTEXT2 | sys::FI_RX_CQ_DATA;
        (*h.ep_attr).type_ = sys::FI_EP_RDM;
        let d = &mut *h.domain_attr;
        d.mr_mode = (sys::FI_MR_LOCAL
            | sys::FI_MR_VIRT_ADDR
            | sys::FI_MR_ALLOCATED
            | sys::FI_MR_PROV_KEY
            | sys::FI_MR_ENDPOINT
            | sys::FI_MR_HMEM) as i32;
        d.threading = sys::FI_THREAD_DOMAIN;
        if let Some(name) = provider {
            let c = CString::new(name).map_err(|_| FabricError::InvalidArgument("provider name has a NUL".into()))?;
            (*h.fabric_attr).prov_name = libc_strdup(&c);
        }
        let ret = sys::fi_getinfo(api_version(hmem), ptr::null(), ptr::null(), 0, hints, &mut list);
        sys::fi_freeinfo(hints);
        ret
    };
    if ret != 0 || list.is_null() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    let mut cur = list;
    while !cur.is_null() {
        // SAFETY: cur walks the list returned by fi_getinfo; fi_dupinfo copies one entry (its
        // `next` is not followed by the copy).
        unsafe {
            let next = (*cur).next;
            (*cur).next = ptr::null_mut();
            let dup = sys::fi_dupinfo(cur);
            (*cur).next = next;
            if !dup.is_null() {
                out.push(FabricInfo(dup));
            }
            cur = next;
        }
    }
    // SAFETY: list came from fi_getinfo and is freed once; the copies are independent.
    unsafe { sys::fi_freeinfo(list) };
    Ok(out.into_iter().filter(|i| i.cq_data_size() >= 4).collect())
}

/// `strdup` with the C allocator, as libfabric frees attribute strings with `free`.
///
/// # Safety
/// The returned pointer must be freed with `free` (fi_freeinfo does).
unsafe fn libc_strdup(s: &CString) -> *mut std::os::raw::c_char {
    extern "C" {
        fn strdup(s: *const std::os::raw::c_char) -> *mut std::os::raw::c_char;
    }
    // SAFETY: s is NUL-terminated.
    unsafe { strdup(s.as_ptr()) }
}

/// Lists the (provider, domain) pairs usable by an engine on this machine.
pub fn list_providers() -> Vec<(String, String)> {
    let mut seen = std::collections::BTreeSet::new();
    query(None, false)
        .unwrap_or_default()
        .iter()
        .map(|i| (i.provider_name(), i.domain_name()))
        .filter(|pair| seen.insert(pair.clone()))
        .collect()
}

/// Whether `provider` is a software provider (tcp, udp, sockets) that runs over IP interfaces.
pub fn is_software(provider: &str) -> bool {
    ["tcp", "udp", "sockets"].iter().any(|p| provider.starts_with(p))
}

/// Resolves a [`ProviderSpec`] to exactly one `fi_info`.
pub fn resolve(spec: &DomainSpec, hmem: Option<bool>) -> Result<FabricInfo> {
    let provider = match &spec.provider {
        Some(p) => p.clone(),
        None => {
            let found = query(None, false)?;
            HARDWARE_PROVIDERS
                .iter()
                .find(|hw| found.iter().any(|i| i.provider_name() == **hw))
                .map(|s| s.to_string())
                .unwrap_or_else(|| "tcp".to_string())
        }
    };
    // Device memory (FI_HMEM) where the provider offers it, else plain host memory.
    let hmem = hmem.unwrap_or_else(|| HARDWARE_PROVIDERS.contains(&provider.as_str()));
    let with_hmem = if hmem { query(Some(&provider), true)? } else { Vec::new() };
    let candidates = if with_hmem.is_empty() { query(Some(&provider), false)? } else { with_hmem };
    if candidates.is_empty() {
        let available: Vec<String> = list_providers()
            .into_iter()
            .map(|(p, _)| p)
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        return Err(FabricError::ProviderUnavailable(format!(
            "no libfabric provider '{provider}' offers RDM endpoints with RMA, messages and remote CQ data here (available: {})",
            if available.is_empty() { "none".to_string() } else { available.join(", ") }
        )));
    }
    let wanted_domain =
        spec.domain.clone().or_else(|| is_software(&provider).then(|| SOFTWARE_DEFAULT_DOMAIN.to_string()));
    let domains: Vec<String> = candidates.iter().map(|i| i.domain_name()).collect();
    let pick = match &wanted_domain {
        Some(d) => candidates.into_iter().find(|i| &i.domain_name() == d),
        None => candidates.into_iter().next(),
    };
    pick.ok_or_else(|| {
        FabricError::ProviderUnavailable(format!(
            "provider '{provider}' has no domain '{}' (domains: {})",
            wanted_domain.unwrap_or_default(),
            domains.join(", ")
        ))
    })
}
