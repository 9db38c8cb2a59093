//! Opening an engine from command-line options and registering the one buffer each side uses,
//! in host memory or on the engine's GPU.
use std::sync::Arc;

use clap::Args;
use fabric_lib::{
    EngineConfig, MrDescriptor, MrHandle, PollMode, ProviderSpec, RegisterOptions, TransferEngine, WriteCompletion,
};

use crate::error::{Context, Result};
use crate::gpu_list::Placement;

/// Engine options shared by the server and the client.
#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// libfabric provider (`tcp`, `udp;ofi_rxd`, `shm`, `efa`, ...); default: an RDMA provider
    /// if one exists, else `tcp`.
    #[arg(long)]
    pub provider: Option<String>,
    /// Domains (NICs or interfaces), comma-separated or repeated; single writes are sharded
    /// over all of them. Default: one domain (`lo` for software providers).
    #[arg(long = "domain", value_delimiter = ',')]
    pub domains: Vec<String>,
    /// Open N domains when `--domain` names none: N × `lo` for software providers, else the
    /// host's first N NICs from the topology.
    #[arg(long = "domains", value_name = "N")]
    pub domain_count: Option<usize>,
    /// Busy-poll the completion queue (the default: lowest latency, one core per worker).
    #[arg(long, conflicts_with = "adaptive")]
    pub busy: bool,
    /// Spin briefly, then park the worker between polls (saves CPU, adds latency).
    #[arg(long)]
    pub adaptive: bool,
    /// Pin the engine's worker thread to this CPU.
    #[arg(long)]
    pub worker_cpu: Option<usize>,
    /// Microseconds that threads waiting on the engine poll before they sleep (default: 50 where
    /// the process may use at least 4 CPUs, else 0).
    #[arg(long)]
    pub wait_spin_us: Option<u64>,
    /// When a write counts as done for its writer: `delivery` (in the receiver's memory),
    /// `transmit` (source reusable) or `auto` (delivery on tcp and sockets, else transmit).
    #[arg(long, default_value = "auto", value_parser = ["auto", "delivery", "transmit"])]
    pub write_completion: String,
    /// Carry writes and immediates to a peer of this host the same-host way (`process_vm_writev`
    /// and the peer's shared-memory inbox) instead of over the provider. Give it to both sides.
    #[arg(long)]
    pub same_host_host_memory: bool,
    /// Send transfers involving GPU memory over the provider even to a peer on this host (as
    /// two hosts would) instead of CUDA IPC: tests and benchmarks of the network path on one
    /// machine. Give it to both sides.
    #[arg(long)]
    pub force_network: bool,
}

/// The domain name of libfabric's `shm` provider (also its provider name).
const SHM_DOMAIN: &str = "shm";

impl EngineArgs {
    /// The domain names to open, from `--domain` or `--domains N`: for an engine on a GPU, the
    /// NICs nearest that GPU first, then the host's others.
    pub fn domain_names(&self, placement: Placement) -> Result<Vec<String>> {
        let Some(n) = self.domain_count.filter(|_| self.domains.is_empty()) else {
            return Ok(self.domains.clone());
        };
        use fabric_lib::provider::libfabric::{is_software, SOFTWARE_DEFAULT_DOMAIN};
        if self.provider.as_deref().is_none_or(is_software) {
            return Ok(vec![SOFTWARE_DEFAULT_DOMAIN.to_string(); n]);
        }
        if self.provider.as_deref() == Some(SHM_DOMAIN) {
            // shm's one domain is not a NIC: N endpoints on it.
            return Ok(vec![SHM_DOMAIN.to_string(); n]);
        }
        let topology = fabric_lib::topology::detect(std::path::Path::new("/"));
        let mut nics = match placement {
            Placement::Host => Vec::new(),
            Placement::Gpu(gpu) => {
                let bus_id = cuda_lib::Device::get(gpu as usize).and_then(|d| d.pci_bus_id()).unwrap_or_default();
                let near = topology.devices.iter().find(|t| {
                    t.pci.as_ref().is_some_and(|p| !bus_id.is_empty() && p.bus_id.eq_ignore_ascii_case(&bus_id))
                });
                near.map(|t| t.nics.clone()).unwrap_or_default()
            }
        };
        for nic in topology.device("host").map(|d| d.nics.clone()).unwrap_or_default() {
            if !nics.contains(&nic) {
                nics.push(nic);
            }
        }
        if nics.len() < n {
            crate::bail!("--domains {n}: the topology lists only {} NICs ({})", nics.len(), nics.join(", "));
        }
        Ok(nics[..n].to_vec())
    }

    /// The poll mode the flags select.
    pub fn poll_mode(&self) -> PollMode {
        if self.adaptive {
            PollMode::ADAPTIVE
        } else {
            PollMode::Busy
        }
    }

    /// The write completion the flag selects.
    pub fn write_completion(&self) -> WriteCompletion {
        match self.write_completion.as_str() {
            "delivery" => WriteCompletion::Delivery,
            "transmit" => WriteCompletion::Transmit,
            _ => WriteCompletion::Auto,
        }
    }

    /// A short name of the poll mode, for reports.
    pub fn poll_mode_name(&self) -> &'static str {
        if self.adaptive {
            "adaptive"
        } else {
            "busy"
        }
    }
}

/// An engine plus one registered buffer. The buffer is leaked on purpose: it must outlive the
/// engine, and the engine may still be referenced by callbacks when this value is dropped.
pub struct Endpoint {
    pub engine: Arc<TransferEngine>,
    pub handle: MrHandle,
    pub descriptor: MrDescriptor,
    pub len: u64,
    pub placement: Placement,
}

impl Endpoint {
    /// Opens the engine the options describe and registers a `len`-byte buffer where
    /// `placement` says (filled, so no page faults land inside a measurement); `remote_read`:
    /// peers may read it. An engine on a GPU asks for FI_HMEM, so providers that have it
    /// register GPU memory with the NIC; the others stage it (the engine decides).
    pub fn open(args: &EngineArgs, placement: Placement, len: usize, remote_read: bool) -> Result<Self> {
        let config = EngineConfig {
            provider: ProviderSpec { provider: args.provider.clone(), domains: args.domain_names(placement)? },
            poll_mode: args.poll_mode(),
            worker_cpu: args.worker_cpu,
            write_completion: args.write_completion(),
            same_host_host_memory: args.same_host_host_memory,
            gpu_network: (placement != Placement::Host).then_some(true),
            force_network: args.force_network,
            wait_spin: args.wait_spin_us.map(std::time::Duration::from_micros),
            ..Default::default()
        };
        let wanted = args.provider.as_deref().unwrap_or("<auto>");
        let engine = TransferEngine::new(config).with_context(|| format!("opening provider '{wanted}'"))?;
        let buffer = crate::gpu_buffers::allocate(placement, len)?;
        let options = RegisterOptions { remote_read };
        // SAFETY: the buffer is leaked, so it stays allocated for the rest of the process and
        // therefore until the engine has unregistered it (or stopped).
        let (handle, descriptor) = unsafe { engine.register_memory_with(buffer.ptr, buffer.len, buffer.kind, options) }
            .with_context(|| format!("registering a {len}-byte buffer in {} memory", placement.name()))?;
        Ok(Endpoint { engine: Arc::new(engine), handle, descriptor, len: len as u64, placement })
    }

    /// How this endpoint's buffer is registered (see [`crate::gpu_buffers::registration_name`]).
    pub fn registration(&self) -> Result<String> {
        crate::gpu_buffers::registration_name(&self.engine, self.handle, &self.descriptor)
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.engine.stop();
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        engine: EngineArgs,
    }

    fn names(args: &[&str]) -> Vec<String> {
        let cli = Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied())).expect("parses");
        cli.engine.domain_names(Placement::Host).expect("resolves")
    }

    #[test]
    fn domains_count_opens_the_providers_own_domain_where_it_has_no_nics() {
        assert_eq!(names(&["--provider", "shm", "--domains", "2"]), ["shm", "shm"]);
        assert_eq!(names(&["--provider", "tcp", "--domains", "2"]), ["lo", "lo"]);
        assert_eq!(names(&["--provider", "shm", "--domain", "shm"]), ["shm"]);
    }
}
