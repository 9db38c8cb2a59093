//! Ranks of the all-to-all on the CPU: one thread per rank plays the kernels' part (publishes
//! counts, packs records and rows into host buffers, raises the proxy block's words, waits for
//! the proxy's flags) while the rank's proxy runs on a real engine, and every byte that arrives
//! is checked against what its source packed: private quota, overflow offsets, combine
//! segments, exactly-once flags. Shared by the protocol tests and the proxy-cost benchmark.
#![allow(dead_code)] // each user takes part of it
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use fabric_lib::{EngineConfig, FabricError, MemoryKind, MrDescriptor, PollMode, ProviderSpec, TransferEngine};
use p2p_all_to_all::proxy::{
    CombineSample, DispatchSample, LocalRegions, PeerRegions, PlacementFence, Proxy, ProxyConfig, ProxyRunner,
};
use p2p_all_to_all::proxy_block::BlockLayout;
use p2p_all_to_all::remote::{
    combine_segment_at_expert, combine_segment_at_source, overflow_offset, Counts, RemoteLayout, Topology,
};

pub const EXPERTS_PER_RANK: usize = 2;
pub const TOPK: usize = 3;
pub const MAX_TOKENS: usize = 24;
pub const WAIT: Duration = Duration::from_secs(20);

/// 8-byte aligned host memory of `bytes` bytes.
struct HostBuf(Vec<u64>);

impl HostBuf {
    fn new(bytes: usize) -> Self {
        HostBuf(vec![0; bytes.div_ceil(8)])
    }
    fn ptr(&mut self) -> *mut u8 {
        self.0.as_mut_ptr().cast()
    }
    fn len(&self) -> usize {
        self.0.len() * 8
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: the Vec's memory, viewed as bytes.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast(), self.len()) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast(), self.len()) }
    }
    fn u64(&self, off: usize) -> &AtomicU64 {
        // SAFETY: 8-aligned offsets inside the buffer.
        unsafe { &*(self.0.as_ptr().cast::<u8>().add(off) as *const AtomicU64) }
    }
    fn u32(&self, off: usize) -> &AtomicU32 {
        // SAFETY: 4-aligned offsets inside the buffer.
        unsafe { &*(self.0.as_ptr().cast::<u8>().add(off) as *const AtomicU32) }
    }
}

/// Every rank's routing of call `n`: records per destination and rows per expert.
fn routing(seed: u64, n: u64, world: usize, skew: bool) -> Counts {
    let experts = world * EXPERTS_PER_RANK;
    let mut c = Counts::new(world, experts);
    let mut x = seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut next = |m: u64| {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (x >> 33) % m
    };
    for s in 0..world {
        // Rank 1 sends nothing on every third call (an empty rank).
        let tokens = if s == 1 && n % 3 == 0 { 0 } else { next(MAX_TOKENS as u64 + 1) as usize };
        for _ in 0..tokens {
            let mut dests = 0u64;
            for slot in 0..TOPK {
                let e = if skew { slot % experts } else { next(experts as u64 + 1) as usize };
                if e == experts {
                    continue; // no expert
                }
                c.hist[s][e] += 1;
                dests |= 1 << (e / EXPERTS_PER_RANK);
            }
            for d in 0..world {
                c.tok[s][d] += ((dests >> d) & 1) as u32;
            }
        }
    }
    c
}

/// The bytes a source packs: word 0..4 = (call, source, destination, index), then a filler.
fn fill(buf: &mut [u8], call: u64, src: usize, dst: usize, index: usize) {
    let words = [call as u32, src as u32, dst as u32, index as u32];
    for (i, b) in buf.iter_mut().enumerate() {
        *b = if i < 16 { words[i / 4].to_le_bytes()[i % 4] } else { (i as u8) ^ (index as u8) ^ (src as u8) };
    }
}

fn check(buf: &[u8], call: u64, src: usize, dst: usize, index: usize, what: &str) {
    let mut want = vec![0u8; buf.len()];
    fill(&mut want, call, src, dst, index);
    assert!(buf == want.as_slice(), "{what}: call {call} {src}->{dst} #{index}: got words {:?}", &buf[..16]);
}

/// A rank's engine; `busy`: its worker polls without ever sleeping (a core of its own).
pub fn engine(provider: &str, busy: bool, worker_cpu: Option<usize>) -> Option<TransferEngine> {
    let config = EngineConfig {
        provider: ProviderSpec::new(Some(provider), &[]),
        poll_mode: if busy { PollMode::Busy } else { PollMode::ADAPTIVE },
        worker_cpu,
        transfer_timeout: Duration::from_secs(5),
        ..Default::default()
    };
    match TransferEngine::new(config) {
        Ok(e) => Some(e),
        Err(FabricError::ProviderUnavailable(_)) => None,
        Err(e) => panic!("opening {provider}: {e}"),
    }
}

fn wait_word(word: &AtomicU64, want: u64, wait: Duration, what: &str) -> Result<u64, String> {
    let start = Instant::now();
    loop {
        let v = word.load(Ordering::Acquire);
        if v >> 32 >= want {
            return Ok(v);
        }
        if start.elapsed() > wait {
            return Err(format!("timed out waiting for {what} (call {want}, word {v:#x})"));
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

#[derive(Default)]
pub struct Scenario {
    pub provider: &'static str,
    pub world: usize,
    pub nvlink: usize,
    pub private_tokens: usize,
    pub calls: u64,
    pub skew: bool,
    /// This rank stops (drops its proxy and engine) before this call.
    pub dies: Option<(usize, u64)>,
    /// Install a placement fence that holds every flag back one pass (`SlowFence`).
    pub fence: bool,
    /// Private writes as one scatter (else one write per remote rank).
    pub scatter: bool,
    /// CPU of each rank's proxy thread (by rank), if pinned: the engine's worker, unless
    /// `own_thread`.
    pub proxy_cpus: Option<Vec<usize>>,
    /// The proxy on a thread of its own (`ProxyRunner::OwnThread`) rather than on the engine's
    /// worker.
    pub own_thread: bool,
    /// How long an idle proxy thread of its own spins before it sleeps between polls (default
    /// 1 ms: the tests leave the CPUs to the other ranks).
    pub proxy_idle_spin: Option<Duration>,
    /// Engine workers poll busily (else adaptively: they sleep after 200 µs idle, and a
    /// request to a sleeping worker wakes it first).
    pub busy_workers: bool,
    /// `ProxyConfig::eager_targets`.
    pub eager_targets: usize,
    /// Rank 0's stand-in kernels, proxy and engine worker each pinned to their own CPU (these
    /// three, in that order; the proxy's is unused where the worker runs it), ahead of
    /// `proxy_cpus`: a rank measured on cores nobody else uses. Its worker polls busily.
    pub measured_cpus: Option<[usize; 3]>,
    /// Log every command's first post in each rank's engine (`LatencyProbe::enable_post_log`).
    pub post_log: bool,
}

/// A placement fence whose every mark passes only the second time it is asked about: each flag
/// behind it stays down for at least one more pass of the proxy.
#[derive(Default)]
pub struct SlowFence {
    marks: AtomicU64,
    asked: Mutex<std::collections::HashSet<u64>>,
}

impl PlacementFence for SlowFence {
    fn mark(&self) -> Result<u64, String> {
        Ok(self.marks.fetch_add(1, Ordering::Relaxed))
    }

    fn passed(&self, ticket: u64) -> Result<bool, String> {
        Ok(!self.asked.lock().unwrap().insert(ticket))
    }
}

/// When this rank's stand-in kernels raised the proxy block's words, per call.
#[derive(Debug, Clone, Copy)]
pub struct Raised {
    /// Counts published (`dseq`).
    pub dseq: Instant,
    /// Records packed (`ddone`).
    pub ddone: Instant,
    /// Rows packed (`cdone`).
    pub cdone: Instant,
}

/// What a rank that finished every call saw.
#[derive(Debug)]
pub struct RankOutcome {
    pub calls: u64,
    pub dispatch: Vec<DispatchSample>,
    pub combine: Vec<CombineSample>,
    pub raised: Vec<Raised>,
    /// The engine's post log (with `Scenario::post_log`).
    pub post_log: Vec<fabric_lib::PostRecord>,
}

impl Scenario {
    /// How long the kernels' part waits for a flag: short where a peer dies on purpose.
    fn wait(&self) -> Duration {
        if self.dies.is_some() {
            Duration::from_secs(3)
        } else {
            WAIT
        }
    }
}

/// Every rank's outcome: Ok(calls done and what was measured) or the error that ended it.
pub fn run(sc: Scenario) -> Option<Vec<Result<RankOutcome, String>>> {
    // Skip where this libfabric lacks the provider.
    drop(engine(sc.provider, sc.busy_workers, None)?);
    let topo = Topology::new(sc.world, sc.nvlink).unwrap();
    let lay = RemoteLayout::new(sc.world, sc.world * EXPERTS_PER_RANK, TOPK, MAX_TOKENS, sc.private_tokens, 64, 32);
    let regions: Arc<Mutex<Vec<Option<PeerRegions>>>> = Arc::new(Mutex::new(vec![None; sc.world]));
    let barrier = Arc::new(Barrier::new(sc.world));
    let sc = Arc::new(sc);
    let threads: Vec<_> = (0..sc.world)
        .map(|me| {
            let (regions, barrier, sc) = (regions.clone(), barrier.clone(), sc.clone());
            std::thread::spawn(move || rank(me, &sc, topo, lay, &regions, &barrier))
        })
        .collect();
    Some(threads.into_iter().map(|t| t.join().unwrap()).collect())
}

fn rank(
    me: usize,
    sc: &Scenario,
    topo: Topology,
    lay: RemoteLayout,
    regions: &Mutex<Vec<Option<PeerRegions>>>,
    barrier: &Barrier,
) -> Result<RankOutcome, String> {
    let blk = BlockLayout::new(&lay);
    let mut block = HostBuf::new(blk.bytes);
    let mut dsend = HostBuf::new(lay.dsend_bytes());
    let mut drecv = HostBuf::new(lay.drecv_bytes());
    let mut csend = HostBuf::new(lay.csend_bytes());
    let mut crecv = HostBuf::new(lay.crecv_bytes());
    let measured = sc.measured_cpus.filter(|_| me == 0);
    if let Some([kernels, _, _]) = measured {
        assert!(core_affinity::set_for_current(core_affinity::CoreId { id: kernels }), "pinning to CPU {kernels}");
    }
    // The measured rank's worker has a core of its own: it polls busily, as a deployment's would.
    let busy = sc.busy_workers || measured.is_some();
    let proxy_cpu = measured.map(|c| c[1]).or_else(|| sc.proxy_cpus.as_ref().map(|c| c[me]));
    let worker_cpu = match (measured, sc.own_thread) {
        (Some(c), _) => Some(c[2]),
        (None, false) => proxy_cpu,
        (None, true) => None,
    };
    let engine = Arc::new(engine(sc.provider, busy, worker_cpu).unwrap());
    let reg = |b: &mut HostBuf| {
        // SAFETY: every buffer outlives the engine (the proxy, which holds it, is dropped first).
        unsafe { engine.register_memory(b.ptr(), b.len(), MemoryKind::Host) }.unwrap()
    };
    let (block_h, block_d) = reg(&mut block);
    let (dsend_h, _) = reg(&mut dsend);
    let (_, drecv_d) = reg(&mut drecv);
    let (csend_h, _) = reg(&mut csend);
    let (_, crecv_d) = reg(&mut crecv);
    let desc = |d: &MrDescriptor| MrDescriptor::from_bytes(&d.to_bytes()).unwrap();
    regions.lock().unwrap()[me] =
        Some(PeerRegions { block: desc(&block_d), drecv: desc(&drecv_d), crecv: desc(&crecv_d) });
    barrier.wait();
    let peers: Vec<PeerRegions> = regions.lock().unwrap().iter().map(|r| r.clone().unwrap()).collect();
    let fence = Arc::new(SlowFence::default());
    let placement_fence = sc.fence.then(|| fence.clone() as Arc<dyn PlacementFence>);
    let cfg = ProxyConfig {
        rank: me,
        topo,
        layout: lay,
        runner: if sc.own_thread {
            ProxyRunner::OwnThread { cpu: proxy_cpu, idle_spin: sc.proxy_idle_spin.unwrap_or(Duration::from_millis(1)) }
        } else {
            ProxyRunner::EngineWorker
        },
        scatter_data: sc.scatter,
        placement_fence,
        eager_targets: sc.eager_targets,
    };
    let local = LocalRegions { block_ptr: block.ptr(), block: block_h, dsend: dsend_h, csend: csend_h };
    if sc.post_log {
        // Room for every command of every call: a count message, two data requests, overflow
        // writes and two combine requests per remote rank at most. Started here: the proxy's
        // requests are then the log's commands 0, 1, ... (`FirstWrite::request`).
        engine.latency_probe().enable_post_log(sc.calls as usize * (4 + 2 * sc.world));
    }
    let mut proxy = Some(Proxy::start(engine.clone(), cfg, local, peers).unwrap());
    drop(engine);
    let q = lay.private_tokens;
    let remote: Vec<usize> = (0..sc.world).filter(|&r| topo.is_remote(me, r)).collect();
    let mut raised = Vec::with_capacity(sc.calls as usize);
    let result = (|| {
        for n in 1..=sc.calls {
            if sc.dies == Some((me, n)) {
                proxy.take(); // stops the proxy; its engine goes with it
                return Ok(RankOutcome {
                    calls: n - 1,
                    dispatch: vec![],
                    combine: vec![],
                    raised: std::mem::take(&mut raised),
                    post_log: vec![],
                });
            }
            let p = (n & 1) as usize;
            let c = routing(n * 31, n, sc.world, sc.skew);
            // Dispatch send: counts first, then records, then "packed".
            for d in 0..sc.world {
                block.u32(blk.pub_tok_at(p, d)).store(c.tok[me][d], Ordering::Relaxed);
            }
            for e in 0..lay.num_experts {
                block.u32(blk.pub_hist_at(p, e)).store(c.hist[me][e], Ordering::Relaxed);
            }
            let dseq = Instant::now();
            block.u64(blk.dseq).store(n, Ordering::Release);
            for &d in &remote {
                for j in 0..c.tok[me][d] as usize {
                    let off = lay.dsend_offset(p, d, j);
                    fill(&mut dsend.bytes_mut()[off..off + lay.rrec_bytes], n, me, d, j);
                }
            }
            let ddone = Instant::now();
            block.u64(blk.ddone).store(n, Ordering::Release);
            // Dispatch receive: each remote source's flag, then every record where it belongs.
            for &s in &remote {
                let v =
                    wait_word(block.u64(blk.rflag_at(p, s)), n, sc.wait(), &format!("rank {me}: records from {s}"))?;
                assert_eq!(v >> 32, n, "flags are exact per call");
                let records = (v & 0xffff_ffff) as usize;
                assert_eq!(records, c.tok[s][me] as usize, "rank {me}: records from {s}");
                let ovf = block.u64(blk.rovf_at(p, s)).load(Ordering::Relaxed) as usize;
                assert_eq!(ovf, overflow_offset(&c, &topo, q, s, me));
                for j in 0..records {
                    let off =
                        if j < q { lay.private_offset(p, s, j) } else { lay.overflow_byte_offset(p, ovf + j - q) };
                    check(&drecv.bytes()[off..off + lay.rrec_bytes], n, s, me, j, "dispatch record");
                }
            }
            // Combine send: every remote source's rows, then "packed" (naming the dispatch).
            let cp = p; // one combine per dispatch here: the same parity
            for &s in &remote {
                let seg = combine_segment_at_expert(&c, &topo, s, me);
                for r in 0..c.rows(s, me) {
                    let off = lay.csend_offset(cp, seg + r);
                    fill(&mut csend.bytes_mut()[off..off + lay.row_bytes], n, me, s, r);
                }
            }
            let cdone = Instant::now();
            block.u64(blk.cdone).store((n << 32) | n, Ordering::Release);
            raised.push(Raised { dseq, ddone, cdone });
            for &d in &remote {
                wait_word(block.u64(blk.crflag_at(d)), n, sc.wait(), &format!("rank {me}: combine rows from {d}"))?;
                let seg = combine_segment_at_source(&c, &topo, me, d);
                for r in 0..c.rows(me, d) {
                    let off = lay.crecv_offset(cp, seg + r);
                    check(&crecv.bytes()[off..off + lay.row_bytes], n, d, me, r, "combine row");
                }
            }
            if let Some(e) = proxy.as_ref().and_then(|p| p.error()) {
                return Err(format!("proxy error: {e}"));
            }
        }
        let proxy = proxy.as_ref().unwrap();
        // The proxy counts a call done (and keeps its sample) just after raising its last flag:
        // give it that moment.
        let start = Instant::now();
        while proxy.calls_done() != (sc.calls, sc.calls) && start.elapsed() < WAIT {
            std::thread::sleep(Duration::from_millis(1));
        }
        // Exactly once: nothing left over (a duplicate would be counted and never taken).
        let e = proxy.engine();
        for &s in &remote {
            for kind in [p2p_all_to_all::remote::ImmKind::DispatchData, p2p_all_to_all::remote::ImmKind::Combine] {
                for n in 1..=sc.calls {
                    let v = p2p_all_to_all::remote::imm(kind, n as u32, s);
                    assert_eq!(e.imm_count(v), 0, "rank {me}: stray immediates from {s} ({kind:?}, call {n})");
                }
            }
        }
        let (samples, combines) = proxy.take_samples();
        assert_eq!(samples.len() as u64, sc.calls);
        assert_eq!(combines.len() as u64, sc.calls);
        for s in &samples {
            assert!(s.data_writes as usize <= 2 * remote.len(), "{s:?}");
            assert_eq!(s.count_writes as usize, sc.world - 1);
        }
        assert!(combines.iter().all(|c| c.writes as usize == remote.len()));
        assert_eq!(proxy.calls_done(), (sc.calls, sc.calls));
        if sc.fence {
            // At least once per combine from every remote rank, and per source with records.
            // Every call's dispatch and combine flags wait for a mark of their own.
            assert!(fence.marks.load(Ordering::Relaxed) >= 2 * sc.calls);
        }
        let post_log = e.latency_probe().take_post_log();
        Ok(RankOutcome {
            calls: sc.calls,
            dispatch: samples,
            combine: combines,
            raised: std::mem::take(&mut raised),
            post_log,
        })
    })();
    drop(proxy); // stop the proxy (and the engine) before the buffers go
    result
}

/// Asserts that every rank finished `calls` calls.
pub fn all_ok(results: Option<Vec<Result<RankOutcome, String>>>, calls: u64) {
    let Some(results) = results else { return };
    for (r, res) in results.iter().enumerate() {
        assert_eq!(res.as_ref().map(|o| o.calls), Ok(calls), "rank {r}");
    }
}
