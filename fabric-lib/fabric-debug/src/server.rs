//! The server side: registers a receive buffer per engine (one engine in host memory, or one
//! per GPU with its buffer on that GPU), then serves one client connection per engine: hands
//! the engine's address and descriptor to the client engine of the same index and follows its
//! control messages until it says `Done`.
use std::io::Write;
use std::net::TcpListener;
use std::time::{Duration, Instant};

use clap::Args;

use crate::bootstrap::{Channel, Control};
use crate::endpoint::{Endpoint, EngineArgs};
use crate::error::{Context, Error, Result};
use crate::gpu_list::{GpuList, Placement};
use crate::units::size_arg;

/// Where the server listens unless `--listen` says otherwise (the positional form listens on
/// every interface, for clients on other hosts).
pub const DEFAULT_LISTEN: &str = "127.0.0.1:18515";

/// `fabric-debug server` options.
#[derive(Args, Debug, Clone)]
pub struct ServerArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// GPUs whose memory holds the receive buffers, e.g. `0,1`: one engine per GPU, serving
    /// the client's engine of the same index (give the client the same number of GPUs).
    #[arg(long, value_name = "GPUS")]
    pub gpus: Option<GpuList>,
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// How the server serves (shared by `fabric-debug server` and the positional form's server).
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Bootstrap address to listen on (port 0: any free port; the bound address is printed).
    /// Default 127.0.0.1:18515; the positional form: 0.0.0.0:18515.
    #[arg(long)]
    pub listen: Option<String>,
    /// Receive buffer size (the largest write a client may make).
    #[arg(long, default_value = "64MiB", value_parser = size_arg)]
    pub buffer_size: u64,
    /// Seconds to wait for the clients (one connection per engine) to connect.
    #[arg(long, default_value_t = 600)]
    pub accept_timeout: u64,
    /// Seconds to wait for the client's next control message (covers the longest test phase).
    #[arg(long, default_value_t = 600)]
    pub idle_timeout: u64,
    /// Seconds to wait for the immediates a client announced before reporting a mismatch.
    #[arg(long, default_value_t = 30)]
    pub verify_timeout: u64,
    /// How the round-trip test's pongs are posted: `triggered` (armed on the worker, which posts
    /// each pong as it counts the ping) or `callback` (an expectation callback per ping, on the
    /// callback thread, posts it).
    #[arg(long, value_enum, default_value = "triggered")]
    pub echo: EchoKind,
    /// With the triggered echo: report on stderr, at the end, how long the server took from
    /// reading each ping to posting its pong (the engine's latency probe).
    #[arg(long)]
    pub echo_breakdown: bool,
}

/// See [`ServeArgs::echo`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EchoKind {
    Triggered,
    Callback,
}

/// Opens the engines, prints `READY HOST:PORT ...`, serves one client connection per engine
/// (all at once), then returns; fails if any session failed.
pub fn run(args: &ServerArgs, positional: bool) -> Result<()> {
    if let Some(list) = &args.gpus {
        crate::gpu_buffers::check_gpus(list)?;
    }
    let endpoints = open_endpoints(args, &Placement::for_run(args.gpus.as_ref()))?;
    let placements: Vec<Placement> = endpoints.iter().map(|e| e.placement).collect();
    let default_listen = if positional { "0.0.0.0:18515" } else { DEFAULT_LISTEN };
    let listen = args.serve.listen.as_deref().unwrap_or(default_listen);
    let listener = TcpListener::bind(listen).with_context(|| format!("listening on {listen}"))?;
    let bound = listener.local_addr().context("reading the listening address")?;
    let first = &endpoints[0].engine;
    let memory: Vec<String> = placements.iter().map(|p| p.name()).collect();
    println!(
        "READY {bound} provider={} domain={} memory={}",
        first.provider(),
        first.domain_names().join(","),
        memory.join(",")
    );
    if positional {
        let host = if bound.ip().is_unspecified() { crate::positional::hostname() } else { bound.ip().to_string() };
        let gpus = args.gpus.as_ref().map(ToString::to_string).unwrap_or_default();
        println!("connect with: fabric-debug {gpus} {} {host}:{}", first.num_domains(), bound.port());
    }
    std::io::stdout().flush().context("writing to stdout")?;
    serve_all(&listener, &endpoints, &args.serve)
}

/// Opens one engine per placement, each with its receive buffer there.
pub(crate) fn open_endpoints(args: &ServerArgs, placements: &[Placement]) -> Result<Vec<Endpoint>> {
    let mut endpoints = Vec::new();
    for &placement in placements {
        // Readable: clients measure reads from it (the read test).
        let ep = Endpoint::open(&args.engine, placement, args.serve.buffer_size as usize, true)
            .with_context(|| format!("engine on {}", placement.name()))?;
        eprintln!(
            "fabric-debug server: engine {} on {}: receive buffer registered as {}, domains {}",
            endpoints.len(),
            placement.name(),
            ep.registration()?,
            ep.engine.domain_names().join(",")
        );
        endpoints.push(ep);
    }
    Ok(endpoints)
}

/// Accepts one connection per engine (each names its engine first) and serves them at once.
pub(crate) fn serve_all(listener: &TcpListener, endpoints: &[Endpoint], args: &ServeArgs) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(args.accept_timeout);
    let idle = Duration::from_secs(args.idle_timeout);
    let mut taken = vec![false; endpoints.len()];
    let (outcome, mut failures) = std::thread::scope(|s| {
        let mut sessions = Vec::new();
        let mut failures = Vec::new();
        while taken.contains(&false) {
            let left = deadline.saturating_duration_since(Instant::now());
            let attached = Channel::accept(listener, left, idle).and_then(|mut ch| {
                let engine = attach(&mut ch, &mut taken)?;
                Ok((ch, engine))
            });
            match attached {
                Ok((ch, Some(engine))) => {
                    sessions.push(s.spawn(move || crate::session::serve(&endpoints[engine], ch, args)))
                }
                // A stray or duplicate connection: refused, the others keep coming.
                Ok((_, None)) => {}
                Err(e) => {
                    failures.push(e.0);
                    break;
                }
            }
        }
        let outcome: Vec<Result<()>> = sessions
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error("a session panicked".into()))))
            .collect();
        (outcome, failures)
    });
    failures.extend(outcome.into_iter().filter_map(|r| r.err()).map(|e| e.0));
    if !failures.is_empty() {
        crate::bail!("{}", failures.join("; "));
    }
    Ok(())
}

/// Reads a connection's `Attach` and claims the engine it names. A different engine count is
/// an error (the two sides were started differently); an engine that does not exist or is
/// already served is refused (the client is told) and None returned.
fn attach(ch: &mut Channel, taken: &mut [bool]) -> Result<Option<usize>> {
    let (engine, engines) = match ch.recv()? {
        Control::Attach { engine, engines } => (engine, engines),
        other => {
            eprintln!("fabric-debug server: {}: expected the client's attach, got {other:?}", ch.peer());
            return Ok(None);
        }
    };
    if engines != taken.len() {
        let message =
            format!("the server runs {} engine(s), the client {engines}: list as many GPUs on both sides", taken.len());
        ch.send(&Control::Reply { ok: false, message: message.clone() })?;
        crate::bail!("{message}");
    }
    let refusal = if engine >= taken.len() {
        format!("engine {engine} does not exist (the server runs {})", taken.len())
    } else if taken[engine] {
        format!("engine {engine} already has a client")
    } else {
        taken[engine] = true;
        return Ok(Some(engine));
    };
    eprintln!("fabric-debug server: {}: {refusal}", ch.peer());
    ch.send(&Control::Reply { ok: false, message: refusal })?;
    Ok(None)
}
