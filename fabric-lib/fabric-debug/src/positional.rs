//! The positional form `fabric-debug GPUS NICS_PER_GPU [SERVER_ADDRESS]`: without an address
//! it is a server with one engine per GPU, NICS_PER_GPU domains each, listening on every
//! interface; with one it is the client of such a server. Either takes the options of
//! `fabric-debug server` / `client` (engine, serving and test options).
use clap::Args;

use crate::client::ClientArgs;
use crate::endpoint::EngineArgs;
use crate::error::Result;
use crate::gpu_list::GpuList;
use crate::server::{ServeArgs, ServerArgs};
use crate::test_args::TestArgs;

/// The positional form's arguments and options (see the module docs).
#[derive(Args, Debug, Clone)]
pub struct PositionalArgs {
    /// GPUs to run on, e.g. `0,1` (CUDA ordinals): one engine per GPU, its buffers on that GPU.
    #[arg(value_name = "GPUS", conflicts_with = "gpus", value_parser = gpus_arg)]
    pub gpu_list: Option<GpuList>,
    /// NICs (libfabric domains) per GPU engine.
    #[arg(value_name = "NICS_PER_GPU", value_parser = nics_arg)]
    pub nics_per_gpu: Option<usize>,
    /// The server's bootstrap address (`HOST:PORT`, printed by the server): run the client.
    #[arg(value_name = "SERVER_ADDRESS", value_parser = address_arg)]
    pub server_address: Option<String>,
    #[command(flatten, next_help_heading = "Engine options of the positional form")]
    pub engine: EngineArgs,
    #[command(flatten, next_help_heading = "Server options of the positional form")]
    pub serve: ServeArgs,
    #[command(flatten, next_help_heading = "Client options of the positional form")]
    pub tests: TestArgs,
}

/// What the positional form runs.
#[derive(Debug)]
pub enum Run {
    Server(ServerArgs),
    Client(ClientArgs),
}

/// A GPU list; a command name here means it came after an option, where clap no longer takes
/// commands (`fabric-debug --gpus server`), so say that instead of "not a GPU index".
fn gpus_arg(text: &str) -> std::result::Result<GpuList, String> {
    if ["server", "client", "watcher", "help"].contains(&text) {
        return Err(format!(
            "'{text}' is a command: name it first, before any option (fabric-debug {text} ...); \
             --gpus without a value is the GPU report, a command of its own"
        ));
    }
    text.parse()
}

fn address_arg(text: &str) -> std::result::Result<String, String> {
    match text.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(text.to_string()),
        _ => Err(format!("SERVER_ADDRESS must be HOST:PORT, as the server printed it, not '{text}'")),
    }
}

fn nics_arg(text: &str) -> std::result::Result<usize, String> {
    match text.trim().parse::<usize>() {
        Ok(n) if (1..=64).contains(&n) => Ok(n),
        _ => Err(format!("NICS_PER_GPU must be a number of NICs (domains) per GPU in 1..=64, not '{text}'")),
    }
}

impl PositionalArgs {
    /// The server or client the arguments describe; None when no GPU list was given.
    pub fn run(&self) -> Result<Option<Run>> {
        let Some(gpus) = &self.gpu_list else { return Ok(None) };
        let Some(nics) = self.nics_per_gpu else {
            crate::bail!("the positional form is GPUS NICS_PER_GPU [SERVER_ADDRESS]: NICS_PER_GPU is missing");
        };
        if !self.engine.domains.is_empty() || self.engine.domain_count.is_some() {
            crate::bail!("NICS_PER_GPU sets the domains; leave out --domain and --domains in the positional form");
        }
        let engine = EngineArgs { domain_count: Some(nics), ..self.engine.clone() };
        let gpus = Some(gpus.clone());
        Ok(Some(match &self.server_address {
            None => Run::Server(ServerArgs { engine, gpus, serve: self.serve.clone() }),
            Some(address) => {
                if self.serve.listen.is_some() {
                    crate::bail!("--listen is the server's; the client connects to SERVER_ADDRESS");
                }
                Run::Client(ClientArgs { engine, gpus, connect: address.clone(), tests: self.tests.clone() })
            }
        }))
    }
}

/// This machine's name, for the address the positional server prints (it listens on every
/// interface; clients on other hosts connect by name).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "127.0.0.1".into())
}
