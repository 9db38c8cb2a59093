//! Per-peer epochs against a receiver process stopped (SIGSTOP) for longer than the writer's
//! transfer timeout: 100 requests time out, the writer re-admits the receiver and resends
//! exactly the requests the receiver's report lacks, and every immediate is counted once.
//! Late deliveries of the ended epoch must be dropped by the receiver, not counted.
//!
//! The receiver is this test binary run again as `epoch_receiver_process` (ignored in normal
//! runs), driven over its stdin/stdout.
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use fabric_lib::{
    DomainChoice, EngineAddress, EngineConfig, FabricError, MemoryKind, MrDescriptor, PollMode, ProviderSpec,
    TransferEngine, WriteCompletion, WriteRequest,
};

const RECEIVER_ENV: &str = "FABRIC_LIB_EPOCH_RECEIVER";
const REQUESTS: u32 = 100;
const FIRST_IMM: u32 = 1000;
const BOUND: Duration = Duration::from_secs(30);
/// Both sides' buffer: the largest write.
const BUFFER: u64 = 1 << 20;

fn engine(provider: &str, domains: &[&str], transfer_timeout: Duration) -> TransferEngine {
    let config = EngineConfig {
        provider: ProviderSpec::new(Some(provider), domains),
        poll_mode: PollMode::ADAPTIVE,
        transfer_timeout,
        // A write is done once it landed, so writes to a stopped receiver time out on every
        // provider (shm's transmit completion would report them done while the receiver sleeps).
        write_completion: WriteCompletion::Delivery,
        ..Default::default()
    };
    TransferEngine::new(config).unwrap_or_else(|e| panic!("opening {provider}: {e}"))
}

/// The receiver: prints its address and a descriptor, then answers `count IMM` and `stale`.
#[test]
#[ignore = "the receiver process of the epoch tests, which start it themselves"]
fn epoch_receiver_process() {
    let Ok(spec) = std::env::var(RECEIVER_ENV) else { return };
    let mut words = spec.split(',');
    let provider = words.next().expect("a provider");
    let domains: Vec<&str> = words.collect();
    let e = engine(provider, &domains, Duration::from_secs(10));
    let mut buf = vec![0u8; BUFFER as usize];
    // SAFETY: `buf` outlives the engine (dropped at the end of this function, after `e`).
    let (_, desc) = unsafe { e.register_memory(buf.as_mut_ptr(), buf.len(), MemoryKind::Host) }.unwrap();
    println!("address {}", e.main_address().to_hex());
    println!("descriptor {}", hex::encode(desc.to_bytes()));
    std::io::stdout().flush().unwrap();
    for line in std::io::stdin().lines() {
        let line = line.unwrap();
        let answer = match line.split_whitespace().collect::<Vec<_>>()[..] {
            ["count", imm] => e.imm_count(imm.parse().unwrap()),
            ["stale"] => e.stale_immediates(),
            _ => break,
        };
        println!("answer {answer}");
        std::io::stdout().flush().unwrap();
    }
    drop(e);
    drop(buf);
}

/// The test's handle on the receiver process.
struct Receiver {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    address: EngineAddress,
    descriptor: MrDescriptor,
}

impl Receiver {
    fn start(provider: &str, domains: &[&str]) -> Self {
        let spec = std::iter::once(provider).chain(domains.iter().copied()).collect::<Vec<_>>().join(",");
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "epoch_receiver_process", "--nocapture", "--test-threads=1"])
            .env(RECEIVER_ENV, spec)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting the receiver process");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(|l| l.ok()) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let next = |prefix: &str| loop {
            let line = lines.recv_timeout(BOUND).expect("the receiver answers");
            // The test harness may print its own words ahead of ours on the line.
            if let Some(at) = line.find(prefix) {
                break line[at + prefix.len()..].trim().to_string();
            }
        };
        let address = EngineAddress::from_hex(&next("address ")).unwrap();
        let descriptor = MrDescriptor::from_bytes(&hex::decode(next("descriptor ")).unwrap()).unwrap();
        Receiver { child, stdin, lines, address, descriptor }
    }

    fn ask(&mut self, question: &str) -> u64 {
        writeln!(self.stdin, "{question}").unwrap();
        self.stdin.flush().unwrap();
        loop {
            let line = self.lines.recv_timeout(BOUND).expect("the receiver answers");
            if let Some(at) = line.find("answer ") {
                return line[at + "answer ".len()..].trim().parse().unwrap();
            }
        }
    }

    fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, signal) }, 0);
    }

    /// Stops the receiver and waits until the kernel reports it stopped (signals are
    /// delivered asynchronously).
    fn stop(&self) {
        self.signal(libc::SIGSTOP);
        let stat = format!("/proc/{}/stat", self.child.id());
        let deadline = Instant::now() + BOUND;
        // The state follows the parenthesised command name: "pid (comm) T ...".
        while !std::fs::read_to_string(&stat).unwrap().rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('T'))
        {
            assert!(Instant::now() < deadline, "the receiver never stopped");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Polls until every imm of `expected` has reached its count (bounded).
    fn wait_counts(&mut self, expected: &HashMap<u32, u64>) {
        let deadline = Instant::now() + BOUND;
        for (&imm, &n) in expected {
            while self.ask(&format!("count {imm}")) < n {
                assert!(Instant::now() < deadline, "immediate {imm} never reached {n}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.signal(libc::SIGCONT);
        let _ = writeln!(self.stdin, "quit");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn write(
    e: &TransferEngine,
    src: fabric_lib::MrHandle,
    dst: &MrDescriptor,
    imm: u32,
    domain: usize,
    len: u64,
) -> mpsc::Receiver<fabric_lib::Result<()>> {
    let (tx, rx) = mpsc::channel();
    let req = WriteRequest {
        src,
        src_offset: 0,
        len,
        dst,
        dst_offset: u64::from(imm) % (BUFFER / len) * len,
        imm: Some(imm),
        domains: DomainChoice::Pinned(domain),
    };
    e.submit_write(&req, Box::new(move |r| tx.send(r).unwrap())).unwrap();
    rx
}

/// Returns how many deliveries the receiver refused as stale. `len` is the size of each of the
/// timed-out writes.
fn timed_out_requests_count_once(provider: &str, domains: &[&str], domain: usize, len: u64) -> u64 {
    let mut receiver = Receiver::start(provider, domains);
    let transfer_timeout = Duration::from_secs(2);
    let writer = Arc::new(engine(provider, domains, transfer_timeout));
    let mut src = vec![7u8; BUFFER as usize];
    // SAFETY: `src` outlives the writer (dropped at the end of the function, after it).
    let (h, _) = unsafe { writer.register_memory(src.as_mut_ptr(), src.len(), MemoryKind::Host) }.unwrap();
    let dst = receiver.descriptor.clone();
    // Connect every domain first, so the handshake (domain 0) does not wait for a connection.
    let warm_up = writer.num_domains() as u64;
    for d in 0..writer.num_domains() {
        write(&writer, h, &dst, 1, d, 4096).recv_timeout(BOUND).unwrap().expect("the receiver is reachable");
    }

    receiver.stop();
    let pending: Vec<_> = (0..REQUESTS).map(|i| write(&writer, h, &dst, FIRST_IMM + i, domain, len)).collect();
    for (i, rx) in pending.iter().enumerate() {
        match rx.recv_timeout(BOUND).expect("every request settles within its bound") {
            Err(FabricError::Timeout(_) | FabricError::PeerFenced(_)) => {}
            other => panic!("{provider}: request {i} to a stopped receiver: {other:?}"),
        }
    }
    // Re-admit while the receiver still sleeps: the handshake waits in its queues with the
    // requests that timed out; the receiver resumes during the handshake's bound.
    let (w, peer) = (writer.clone(), receiver.address.clone());
    let readmit = std::thread::spawn(move || {
        // A handshake the peer did not answer in time may be repeated (the same report comes back).
        let mut result = w.readmit_peer(&peer);
        for _ in 0..2 {
            match result {
                Err(FabricError::Timeout(_)) => result = w.readmit_peer(&peer),
                _ => break,
            }
        }
        result
    });
    std::thread::sleep(Duration::from_millis(300));
    receiver.signal(libc::SIGCONT);
    let readmission = readmit.join().unwrap().expect("the resumed receiver answers the handshake");
    assert!(readmission.fenced, "{provider}: the timeouts fenced the receiver");
    let counted = readmission.counted.expect("the provider carries epochs");

    let mut expected: HashMap<u32, u64> = HashMap::from([(1, warm_up)]);
    let mut resent = 0;
    for imm in FIRST_IMM..FIRST_IMM + REQUESTS {
        let n = counted.get(&imm).copied().unwrap_or(0);
        assert!(n <= 1, "{provider}: immediate {imm} counted {n} times before the retry");
        if n == 0 {
            resent += 1;
            write(&writer, h, &dst, imm, domain, len)
                .recv_timeout(BOUND)
                .unwrap()
                .expect("the re-admitted peer is served");
        }
        expected.insert(imm, 1);
    }
    assert_eq!(counted.get(&1), Some(&warm_up), "{provider}: the report covers the whole ended epoch");
    receiver.wait_counts(&expected);
    // Whatever of the ended epoch is still on its way must be dropped, not counted.
    std::thread::sleep(Duration::from_millis(500));
    for (&imm, &n) in &expected {
        assert_eq!(receiver.ask(&format!("count {imm}")), n, "{provider}: immediate {imm} counted twice");
    }
    let stale = receiver.ask("stale");
    eprintln!(
        "{provider} {domains:?}: {} of {REQUESTS} counted before the handshake, {resent} resent, {stale} late deliveries dropped",
        REQUESTS as usize - resent
    );
    assert!(stale <= resent as u64, "only requests missing from the report can arrive late");
    drop(writer);
    drop(src);
    stale
}

#[test]
fn tcp_timed_out_requests_count_once() {
    timed_out_requests_count_once("tcp", &[], 0, 4096);
}

/// Writes on the second domain, handshake on the first. The 100 MiB of writes cannot all wait
/// in the kernel's socket buffers while the receiver sleeps: most are still queued at the
/// writer when the handshake, already in the receiver's socket, ends their epoch, so they
/// arrive late whichever domain the resumed receiver polls first.
#[test]
fn tcp_two_domains_late_deliveries_are_dropped() {
    let stale = timed_out_requests_count_once("tcp", &["lo", "lo"], 1, BUFFER);
    assert!(stale > 0, "the writes on the second domain reached the receiver after the handshake");
}

#[test]
fn shm_timed_out_requests_count_once() {
    timed_out_requests_count_once("shm", &[], 0, 4096);
}

#[test]
fn udp_rxd_timed_out_requests_count_once() {
    timed_out_requests_count_once("udp;ofi_rxd", &[], 0, 4096);
}
