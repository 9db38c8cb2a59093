//! `fabric-debug watcher`: how long a GPU store takes to reach a Rust reaction through a UVM
//! watcher, with the callback on the watcher thread itself and on the engine's callback thread,
//! against the floor of a CPU spinning on a GPU-written word (no watcher at all).
//!
//! Each round trip: the CPU sets a GPU flag, a kernel waiting on it stores the value to the
//! watched word, the reaction stamps the time. Half the spin round trip (CPU -> GPU) is taken
//! off to estimate the GPU store -> reaction latency.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use fabric_lib::{EngineConfig, GpuFlag, PollMode, SignalStream, TransferEngine, WatcherRunsOn};
use serde::Serialize;

use crate::error::{Context, Result};

/// `fabric-debug watcher` options.
#[derive(Args, Debug)]
pub struct WatcherArgs {
    /// CUDA device.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Round trips per mode (the first tenth, at most 50, are warm-up).
    #[arg(long, default_value_t = 2000)]
    pub iterations: usize,
    /// CPU to pin the watcher thread to.
    #[arg(long)]
    pub watcher_cpu: Option<usize>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Latencies of one mode, microseconds.
#[derive(Serialize, Debug)]
pub struct ModeResult {
    pub mode: &'static str,
    pub rtt_p50_us: f64,
    pub rtt_p99_us: f64,
    /// Round trip minus half the spin round trip: GPU store -> reaction.
    pub latency_p50_us: f64,
    pub latency_p99_us: f64,
}

/// The report.
#[derive(Serialize, Debug)]
pub struct WatcherReport {
    pub benchmark: &'static str,
    pub device: usize,
    pub iterations: usize,
    pub modes: Vec<ModeResult>,
}

/// Where a round trip ends: the GPU-written word itself, or a watcher's Rust reaction.
enum Target {
    Spin(GpuFlag),
    Watcher(fabric_lib::UvmWatcher),
}

/// Runs the three modes.
pub fn run(args: &WatcherArgs) -> Result<WatcherReport> {
    let engine = TransferEngine::new(EngineConfig {
        poll_mode: PollMode::Busy,
        uvm_watcher_cpu: args.watcher_cpu,
        ..Default::default()
    })
    .context("opening an engine")?;
    let stream = SignalStream::new(args.device).context("loading the signalling kernels")?;
    let flag = engine.alloc_gpu_flag(args.device).context("allocating a GPU flag")?;
    let base = Instant::now();
    let seen = Arc::new((AtomicU64::new(0), AtomicU64::new(0))); // (value, ns since base)
    let reaction = |seen: Arc<(AtomicU64, AtomicU64)>| -> fabric_lib::WatcherCallback {
        Arc::new(move |_old, new| {
            seen.1.store(base.elapsed().as_nanos() as u64, Ordering::Relaxed);
            seen.0.store(new, Ordering::Release);
        })
    };
    let mut modes = Vec::new();
    let mut value = 0u64;
    let mut spin_p50 = 0.0;
    for mode in ["spin", "rust, watcher thread", "rust, callback thread"] {
        let target = match mode {
            "spin" => Target::Spin(engine.alloc_gpu_flag(args.device).context("allocating a word")?),
            m => Target::Watcher(
                engine
                    .alloc_uvm_watcher_on(
                        args.device,
                        reaction(seen.clone()),
                        if m.contains("watcher thread") {
                            WatcherRunsOn::WatcherThread
                        } else {
                            WatcherRunsOn::CallbackThread
                        },
                    )
                    .context("allocating a UVM watcher")?,
            ),
        };
        let ptr = match &target {
            Target::Spin(f) => f.device_ptr(),
            Target::Watcher(w) => w.device_ptr(),
        };
        let mut rtts = Vec::with_capacity(args.iterations);
        let chunk = 200;
        let mut done = 0;
        while done < args.iterations {
            let n = chunk.min(args.iterations - done);
            for i in 0..n {
                let v = value + i as u64 + 1;
                // SAFETY: both words are mapped pinned host memory owned by objects that live
                // until the stream was waited for below.
                unsafe {
                    stream
                        .flag_poll(flag.device_ptr(), v, Duration::from_secs(10), (v as usize) % 1024)
                        .context("launching a flag poll")?;
                    stream.write_u64(ptr, v).context("launching a store")?;
                }
            }
            std::thread::sleep(Duration::from_millis(2));
            for i in 0..n {
                let v = value + i as u64 + 1;
                let t0 = base.elapsed().as_nanos() as u64;
                flag.set(v);
                let deadline = Instant::now() + Duration::from_secs(10);
                let end = loop {
                    match &target {
                        Target::Spin(f) if f.get() == v => break base.elapsed().as_nanos() as u64,
                        Target::Watcher(_) if seen.0.load(Ordering::Acquire) == v => {
                            break seen.1.load(Ordering::Relaxed)
                        }
                        _ if Instant::now() > deadline => {
                            crate::bail!("{mode}: value {v} never came back (is the GPU busy?)")
                        }
                        _ => std::hint::spin_loop(),
                    }
                };
                rtts.push(end.saturating_sub(t0) as f64 / 1e3);
            }
            if !stream.wait(Duration::from_secs(30)).context("waiting for the stream")? {
                crate::bail!("{mode}: the signalling stream did not finish");
            }
            value += n as u64;
            done += n;
        }
        let warm = (args.iterations / 10).min(50);
        let mut rtts = rtts.split_off(warm.min(rtts.len()));
        rtts.sort_by(f64::total_cmp);
        let pct = |q: f64| rtts[((q * rtts.len() as f64) as usize).min(rtts.len() - 1)];
        let (p50, p99) = (pct(0.5), pct(0.99));
        if mode == "spin" {
            spin_p50 = p50;
        }
        modes.push(ModeResult {
            mode,
            rtt_p50_us: p50,
            rtt_p99_us: p99,
            latency_p50_us: p50 - spin_p50 / 2.0,
            latency_p99_us: p99 - spin_p50 / 2.0,
        });
    }
    engine.stop();
    Ok(WatcherReport { benchmark: "uvm_watcher", device: args.device, iterations: args.iterations, modes })
}

impl WatcherReport {
    /// A human-readable table.
    pub fn table(&self) -> String {
        let mut out = format!(
            "UVM watcher, device {}, {} round trips per mode (CPU sets a flag -> kernel stores -> reaction)\n",
            self.device, self.iterations
        );
        out.push_str(&format!(
            "{:<24} {:>10} {:>10} {:>14} {:>14}\n",
            "mode", "rtt p50", "rtt p99", "latency p50", "latency p99"
        ));
        for m in &self.modes {
            out.push_str(&format!(
                "{:<24} {:>8.2}us {:>8.2}us {:>12.2}us {:>12.2}us\n",
                m.mode, m.rtt_p50_us, m.rtt_p99_us, m.latency_p50_us, m.latency_p99_us
            ));
        }
        out.push_str("latency = round trip - half the spin round trip (the CPU -> GPU leg)\n");
        out
    }
}
