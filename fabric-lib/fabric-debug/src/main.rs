//! `fabric-debug`: a two-process benchmark and smoke test for fabric-lib.
//!
//! ```text
//! fabric-debug server [--provider P] [--domain D] [--listen 127.0.0.1:PORT] [--busy|--adaptive]
//! fabric-debug client --connect HOST:PORT [--provider P] [--sizes 4K,1M,...] [--window N] [--json]
//! fabric-debug --gpus [--gpu-provider P,...] [--gpu-json]
//! ```
//!
//! The two sides meet over a plain TCP bootstrap connection ([`bootstrap`]): the server sends
//! its engine address and the descriptor of a registered receive buffer, the client answers
//! with its own. The client then measures, against the server's buffer:
//!
//! - single-write throughput per size, `window` writes in flight ([`throughput`]);
//! - the rate of small writes with immediates, verified by the server counting them;
//! - immediate round-trip latency, p50/p99 ([`latency`]);
//! - paged-write sweeps, page sizes × page counts, per domain and in total ([`paged`]);
//! - single-read throughput per size, `window` reads in flight ([`reads`]; the server's buffer
//!   is registered readable for it).
//!
//! `--gpus` reports the GPUs, their PCI addresses and nearest NICs, and how each provider
//! registers their memory ([`gpus`]).
//!
//! Each measurement is the median of several timed repetitions after a warm-up. Output is a
//! table, or one JSON object with `--json` ([`report`]). Bad input and failures end the process
//! with a message and a nonzero exit status, never a panic.
mod bootstrap;
mod client;
mod endpoint;
mod error;
mod gpus;
mod latency;
mod paged;
mod progress;
mod reads;
mod report;
mod run_info;
mod server;
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
#[command(subcommand_required = false, arg_required_else_help = true)]
struct Cli {
    #[command(flatten)]
    gpus: gpus::GpusArgs,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Register a receive buffer and serve one client session.
    Server(server::ServerArgs),
    /// Connect to a server and run the tests.
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
        if cli.command.is_some() {
            eprintln!("fabric-debug: --gpus is a report of its own; run it without server/client");
            return ExitCode::FAILURE;
        }
        let report = gpus::collect(&cli.gpus);
        if cli.gpus.json {
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
        return ExitCode::SUCCESS;
    }
    let Some(command) = &cli.command else {
        eprintln!("fabric-debug: name a command (server, client) or --gpus; --help lists them");
        return ExitCode::FAILURE;
    };
    let outcome = match command {
        Command::Server(args) => server::run(args),
        Command::Client(args) => client::run(args).and_then(|r| emit(args.json, &r, || r.table())),
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
