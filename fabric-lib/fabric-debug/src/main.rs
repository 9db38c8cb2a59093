//! `fabric-debug`: a two-process benchmark and smoke test for fabric-lib.
//!
//! ```text
//! fabric-debug server [--gpus 0,1] [--provider P] [--domain D | --domains N] [--listen 127.0.0.1:PORT] [--force-network]
//! fabric-debug client [--gpus 0,1] --connect HOST:PORT [--provider P] [--sizes 4K,1M,...] [--window N] [--json]
//! fabric-debug GPUS NICS_PER_GPU [SERVER_ADDRESS] [options of server / client]
//! fabric-debug --gpus [--gpu-provider P,...] [--gpu-json]
//! ```
//!
//! The two sides meet over a plain TCP bootstrap connection ([`bootstrap`]), one per engine
//! pair: the client names the server engine it pairs with, the server sends that engine's
//! address and the descriptor of its registered receive buffer, the client answers with its
//! own. The client then measures, against the server's buffer:
//!
//! - single-write throughput per size, `window` writes in flight ([`throughput`]);
//! - the rate of small writes with immediates, verified by the server counting them;
//! - immediate round-trip latency, p50/p99 ([`latency`]);
//! - paged-write sweeps, page sizes × page counts, per domain and in total ([`paged`]);
//! - single-read throughput per size, `window` reads in flight ([`reads`]; the server's buffer
//!   is registered readable for it).
//!
//! **GPU buffers.** `server --gpus 0,1` / `client --gpus 0,1` run one engine per listed GPU, the
//! server's receive buffer and the client's send buffer on that GPU; engine `i` of the client
//! pairs with engine `i` of the server (GPU i ↔ GPU i), all pairs at once ([`gpu_buffers`]). The
//! engine registers GPU memory as the provider allows: with the NIC where it has FI_HMEM
//! (DMA-BUF, else the CUDA interface: `shm` of a CUDA-enabled libfabric, efa, verbs), staged
//! through host memory where it has not (tcp, udp;ofi_rxd, sockets). Two processes on one host
//! use CUDA IPC unless `--force-network` (both sides) sends GPU transfers over the provider.
//! The report says per GPU how each buffer was registered and which path writes took
//! (`network`, `staged`, `same-host`), with results per GPU and in total ([`gpu_report`]).
//! Reads are never staged: on a staged path the read test is skipped and the report says so.
//!
//! **Positional form** ([`positional`]): `fabric-debug 0,1 2` is a server with engines on GPUs 0
//! and 1, 2 NICs (domains) each, listening on 0.0.0.0:18515 (or `--listen`); it prints `READY`
//! and the command to connect with. `fabric-debug 0,1 2 HOST:PORT` is its client. The first
//! positional must be a GPU list (`0`, `0,1`), never a command name, so the two forms cannot be
//! confused; options are those of `server` and `client`.
//!
//! **`--gpus` alone** is the GPU report: the GPUs, their PCI addresses and nearest NICs, and how
//! each provider registers their memory ([`gpus`]). Given a value it belongs to `server` or
//! `client` (`server --gpus 0,1`); the positional form takes its GPU list without the flag.
//! GPU runs on a machine without CUDA, or naming a GPU that does not exist, fail with a message.
//!
//! Each measurement is the median of several timed repetitions after a warm-up. Output is a
//! table, or one JSON object with `--json` ([`report`]). Bad input and failures end the process
//! with a message and a nonzero exit status, never a panic.

/// Small requests are allocated on the caller's thread and freed on the worker's: mimalloc frees
/// them without the system allocator's cross-thread cost.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod bootstrap;
#[cfg(test)]
mod cli_tests;
mod client;
mod endpoint;
mod error;
mod gpu_buffers;
mod gpu_list;
mod gpu_report;
mod gpus;
mod latency;
mod paged;
#[cfg(test)]
mod pairing_tests;
mod positional;
mod progress;
mod reads;
mod report;
mod run_info;
mod server;
mod session;
mod test_args;
mod throughput;
mod tracker;
mod units;
mod watcher;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Command line of the tool.
#[derive(Parser, Debug)]
#[command(name = "fabric-debug", version, about = "Benchmark and smoke-test fabric-lib between two processes")]
#[command(subcommand_required = false, arg_required_else_help = true, args_conflicts_with_subcommands = true)]
#[command(override_usage = "fabric-debug server|client [OPTIONS]\n       \
    fabric-debug GPUS NICS_PER_GPU [SERVER_ADDRESS] [OPTIONS]\n       \
    fabric-debug --gpus [--gpu-provider P,...] [--gpu-json]")]
struct Cli {
    #[command(flatten)]
    gpus: gpus::GpusArgs,
    #[command(flatten)]
    positional: positional::PositionalArgs,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Register a receive buffer (one per GPU with --gpus) and serve one client session.
    Server(server::ServerArgs),
    /// Connect to a server and run the tests (one engine per GPU with --gpus).
    Client(client::ClientArgs),
    /// GPU store -> Rust reaction latency through a UVM watcher (needs a GPU).
    Watcher(watcher::WatcherArgs),
}

/// Prints a report as JSON or as its table.
fn emit<R: serde::Serialize>(json: bool, report: &R, table: impl FnOnce() -> String) -> error::Result<()> {
    if json {
        let text = serde_json::to_string(report).map_err(|e| error::Error(format!("encoding JSON: {e}")))?;
        println!("{text}");
    } else {
        print!("{}", table());
    }
    Ok(())
}

fn main() -> ExitCode {
    // FABRIC_LIB_LOG as in the Python package (default warn); colour only on a terminal.
    let filter = tracing_subscriber::EnvFilter::try_from_env("FABRIC_LIB_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .try_init();
    let cli = Cli::parse();
    if cli.gpus.gpus {
        return gpu_listing(&cli.gpus);
    }
    let command = match cli.positional.run() {
        Ok(Some(positional::Run::Server(args))) => Command::Server(args),
        Ok(Some(positional::Run::Client(args))) => Command::Client(args),
        Ok(None) => {
            match cli.command {
                Some(command) => command,
                None => {
                    eprintln!("fabric-debug: name a command (server, client), GPUS NICS_PER_GPU, or --gpus; --help lists them");
                    return ExitCode::FAILURE;
                }
            }
        }
        Err(e) => {
            eprintln!("fabric-debug: error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let positional = cli.positional.gpu_list.is_some();
    let outcome = match &command {
        Command::Server(args) => server::run(args, positional),
        Command::Client(args) => client::run(args).and_then(|r| emit(args.tests.json, &r, || r.table())),
        Command::Watcher(args) => watcher::run(args).and_then(|r| emit(args.json, &r, || r.table())),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let side = match command {
                Command::Server(_) => "server",
                Command::Client(_) => "client",
                Command::Watcher(_) => "watcher",
            };
            eprintln!("fabric-debug {side}: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `fabric-debug --gpus`: the GPU report (a report of its own; clap refuses it with a command).
fn gpu_listing(args: &gpus::GpusArgs) -> ExitCode {
    let report = gpus::collect(args);
    if args.gpu_json {
        match serde_json::to_string(&report) {
            Ok(text) => println!("{text}"),
            Err(e) => {
                eprintln!("fabric-debug --gpus: error: encoding JSON: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        print!("{}", report.table());
    }
    ExitCode::SUCCESS
}
