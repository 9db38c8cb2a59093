//! `fabric-debug --gpus`: the GPUs this process sees, their PCI addresses and nearest NICs, and
//! whether each provider can register their memory with the NIC (FI_HMEM; DMA-BUF or the CUDA
//! interface). Works without CUDA: it then says there is no GPU and still lists the providers.
use std::path::Path;
use std::time::Duration;

use clap::Args;
use fabric_lib::provider::libfabric::{list_providers, runtime_version, version_string, DMABUF_API_VERSION};
use fabric_lib::{EngineConfig, MemoryKind, PollMode, ProviderSpec, TransferEngine};
use serde::Serialize;

/// Options of the GPU report.
#[derive(Args, Debug, Clone)]
pub struct GpusArgs {
    /// Alone: list GPUs, their PCI bus ids and nearest NICs, and whether each provider can
    /// register their memory (FI_HMEM, DMA-BUF); "no GPU" on machines without CUDA. (GPU
    /// buffers: `server --gpus 0,1`, `client --gpus 0,1`, or the positional form.)
    #[arg(long)]
    pub gpus: bool,
    /// Providers to check with `--gpus`, comma-separated or repeated (default: every provider
    /// libfabric lists here).
    #[arg(long = "gpu-provider", value_delimiter = ',', requires = "gpus")]
    pub providers: Vec<String>,
    /// Print the GPU report as one JSON object.
    #[arg(long = "gpu-json", requires = "gpus")]
    pub gpu_json: bool,
}

/// One provider, opened asking for FI_HMEM.
#[derive(Serialize, Debug, Clone)]
pub struct ProviderCheck {
    pub provider: String,
    /// The provider moves device memory itself (FI_HMEM); false also when it failed to open.
    pub fi_hmem: bool,
    /// libfabric API version the domain was opened with: DMA-BUF needs 1.20.
    pub dmabuf_api: bool,
    /// Why the provider did not open (None when it did).
    pub error: Option<String>,
}

/// How one provider registered a test buffer of one GPU.
#[derive(Serialize, Debug, Clone)]
pub struct Registration {
    pub provider: String,
    /// `dmabuf`, `cuda` (by address, iface FI_HMEM_CUDA), or `no` (same-host peers only).
    pub registration: String,
    /// Why not, where it is `no`.
    pub reason: Option<String>,
}

/// One visible GPU.
#[derive(Serialize, Debug, Clone)]
pub struct Gpu {
    pub ordinal: usize,
    pub name: String,
    pub pci_bus_id: String,
    /// The device can export its memory as DMA-BUF (driver and kernel support).
    pub dmabuf_export: bool,
    /// NICs behind the same PCIe switch (or root complex, socket), from sysfs.
    pub nearest_nics: Vec<String>,
    pub registrations: Vec<Registration>,
}

/// The whole report.
#[derive(Serialize, Debug, Clone)]
pub struct GpuReport {
    /// The libfabric loaded at run time, "major.minor".
    pub libfabric_version: String,
    /// CUDA version the driver supports, "major.minor" (None without a driver).
    pub cuda_driver: Option<String>,
    /// Why there is no GPU (None when there are GPUs).
    pub no_gpu: Option<String>,
    pub gpus: Vec<Gpu>,
    pub providers: Vec<ProviderCheck>,
}

const TEST_BUFFER: usize = 2 << 20;

fn open(provider: &str) -> fabric_lib::Result<TransferEngine> {
    TransferEngine::new(EngineConfig {
        provider: ProviderSpec { provider: Some(provider.to_string()), domains: Vec::new() },
        poll_mode: PollMode::ADAPTIVE,
        gpu_network: Some(true),
        command_timeout: Duration::from_secs(10),
        ..Default::default()
    })
}

/// Registers a fresh 2 MiB buffer of `device` and reports how it reached the NIC.
fn register_on(engine: &TransferEngine, device: usize) -> Registration {
    let provider = engine.provider().to_string();
    let outcome = (|| -> fabric_lib::Result<Option<fabric_lib::NicRegistration>> {
        let ctx = cuda_lib::Context::new(device)?;
        let buffer = cuda_lib::DeviceBuffer::new(&ctx, TEST_BUFFER)?;
        // SAFETY: the buffer stays allocated until after the registration is released below.
        let (handle, _) =
            unsafe { engine.register_memory(buffer.ptr() as *mut u8, buffer.len(), MemoryKind::Cuda(device as u32)) }?;
        let how = engine.region_nic_registration(handle);
        engine.unregister_memory(handle)?;
        how
    })();
    match outcome {
        Ok(Some(how)) => Registration { provider, registration: how.name().into(), reason: None },
        Ok(None) if !engine.gpu_network() => {
            Registration { provider, registration: "no".into(), reason: Some("no FI_HMEM".into()) }
        }
        Ok(None) => Registration {
            provider,
            registration: "no".into(),
            reason: Some("the provider refused it (libfabric built without CUDA?)".into()),
        },
        Err(e) => Registration { provider, registration: "no".into(), reason: Some(e.to_string()) },
    }
}

/// Collects the report: opens each provider once and registers one buffer per GPU on it.
pub fn collect(args: &GpusArgs) -> GpuReport {
    let mut providers = args.providers.clone();
    if providers.is_empty() {
        for (provider, _) in list_providers() {
            if !providers.contains(&provider) {
                providers.push(provider);
            }
        }
    }
    let (devices, no_gpu) = match cuda_lib::Device::all() {
        Ok(d) if d.is_empty() => (d, Some("no GPU: the CUDA driver sees no device".to_string())),
        Ok(d) => (d, None),
        Err(e) => (Vec::new(), Some(format!("no GPU: {e}"))),
    };
    let topology = fabric_lib::topology::detect(Path::new("/"));
    let mut gpus: Vec<Gpu> = devices
        .iter()
        .map(|d| {
            let pci_bus_id = d.pci_bus_id().unwrap_or_else(|e| format!("unknown ({e})"));
            let nearest_nics = topology
                .devices
                .iter()
                .find(|t| t.pci.as_ref().is_some_and(|p| p.bus_id.eq_ignore_ascii_case(&pci_bus_id)))
                .map(|t| t.nics.clone())
                .unwrap_or_default();
            Gpu {
                ordinal: d.ordinal(),
                name: d.name().unwrap_or_default(),
                pci_bus_id,
                dmabuf_export: d.supports_dmabuf().unwrap_or(false),
                nearest_nics,
                registrations: Vec::new(),
            }
        })
        .collect();
    let mut checks = Vec::new();
    for provider in providers {
        match open(&provider) {
            Ok(engine) => {
                for gpu in &mut gpus {
                    gpu.registrations.push(register_on(&engine, gpu.ordinal));
                }
                checks.push(ProviderCheck {
                    provider: engine.provider().to_string(),
                    fi_hmem: engine.gpu_network(),
                    dmabuf_api: engine.gpu_network() && runtime_version() >= DMABUF_API_VERSION,
                    error: None,
                });
                engine.stop();
            }
            Err(e) => {
                checks.push(ProviderCheck { provider, fi_hmem: false, dmabuf_api: false, error: Some(e.to_string()) })
            }
        }
    }
    GpuReport {
        libfabric_version: version_string(runtime_version()),
        cuda_driver: cuda_lib::driver_version().ok().map(|(major, minor)| format!("{major}.{minor}")),
        no_gpu,
        gpus,
        providers: checks,
    }
}

fn yes_no(v: bool) -> &'static str {
    if v {
        "yes"
    } else {
        "no"
    }
}

impl GpuReport {
    /// The report as aligned text.
    pub fn table(&self) -> String {
        let mut out = format!(
            "libfabric {}, CUDA driver {}\n",
            self.libfabric_version,
            self.cuda_driver.as_deref().unwrap_or("none")
        );
        out += "\nprovider            FI_HMEM  DMA-BUF API\n";
        for p in &self.providers {
            match &p.error {
                None => out += &format!("{:<19} {:<8} {}\n", p.provider, yes_no(p.fi_hmem), yes_no(p.dmabuf_api)),
                Some(e) => out += &format!("{:<19} did not open: {e}\n", p.provider),
            }
        }
        if let Some(reason) = &self.no_gpu {
            out += &format!("\n{reason}\n");
            return out;
        }
        for g in &self.gpus {
            out += &format!(
                "\ncuda:{} {} (PCI {}), DMA-BUF export: {}, nearest NICs: {}\n",
                g.ordinal,
                g.name,
                g.pci_bus_id,
                yes_no(g.dmabuf_export),
                if g.nearest_nics.is_empty() { "none found".to_string() } else { g.nearest_nics.join(", ") }
            );
            for r in &g.registrations {
                let why = r.reason.as_deref().map(|w| format!(" ({w})")).unwrap_or_default();
                out += &format!("  {:<19} registers GPU memory: {}{why}\n", r.provider, r.registration);
            }
        }
        out
    }
}
