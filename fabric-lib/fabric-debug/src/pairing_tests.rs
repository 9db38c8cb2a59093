//! Engine pairing without a GPU: two server engines and two client engines in host memory over
//! tcp, paired by index through the bootstrap's `Attach`, run their tests at once, and every
//! immediate is counted; a client with a different engine count is refused with a message.
use std::net::TcpListener;

use clap::Parser;

use crate::client::{run_pairs, ClientArgs};
use crate::gpu_list::Placement;
use crate::gpu_report::GpuRunReport;
use crate::server::{open_endpoints, serve_all, ServerArgs};

fn server_args() -> ServerArgs {
    match crate::Cli::parse_from(["fabric-debug", "server", "--provider", "tcp", "--adaptive", "--buffer-size", "1MiB"])
        .command
    {
        Some(crate::Command::Server(a)) => a,
        other => panic!("parsed {other:?}"),
    }
}

fn client_args(address: &str) -> ClientArgs {
    let argv = [
        "fabric-debug",
        "client",
        "--provider",
        "tcp",
        "--adaptive",
        "--connect",
        address,
        "--quiet",
        "--sizes",
        "4K,64K",
        "--reps",
        "1",
        "--bytes-per-rep",
        "256KiB",
        "--ops",
        "200",
        "--iters",
        "20",
        "--warmup-iters",
        "2",
        "--tests",
        "throughput,oprate,rtt,paged,read",
        "--page-sizes",
        "4K",
        "--page-counts",
        "8",
        "--read-sizes",
        "4K",
        "--stall-timeout",
        "30",
        "--connect-timeout",
        "10",
    ]; // fmt: skip
    match crate::Cli::parse_from(argv).command {
        Some(crate::Command::Client(a)) => a,
        other => panic!("parsed {other:?}"),
    }
}

#[test]
fn two_engine_pairs_run_at_once_and_are_verified() {
    let server = server_args();
    let placements = [Placement::Host, Placement::Host];
    let endpoints = open_endpoints(&server, &placements).expect("server engines");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let reports = std::thread::scope(|s| {
        let served = s.spawn(|| serve_all(&listener, &endpoints, &server.serve));
        let reports = run_pairs(&client_args(&address), &placements);
        served.join().unwrap().expect("server sessions");
        reports.expect("client sessions")
    });
    let total = GpuRunReport::new(reports).total;
    assert_eq!(total.gpus, 2);
    assert_eq!(total.throughput.len(), 2);
    assert!(total.throughput.iter().all(|t| t.gbytes_per_s > 0.0), "{total:?}");
    assert_eq!(total.read_throughput.len(), 1);
    assert!(total.op_rate_mops_per_s.unwrap() > 0.0);
    assert!(total.rtt_p50_us_worst.unwrap() > 0.0);
    // Per pair, window 16: throughput 4 KiB (64-write warm-up + 64) and 64 KiB (32 + 32), paged
    // (warm-up + 1 request), op rate (200-write warm-up + 200).
    let per_pair = (64 + 64) + (32 + 32) + 2 + (200 + 200);
    assert_eq!(total.immediates_verified, 2 * per_pair, "{total:?}");
}

#[test]
fn a_different_engine_count_is_refused_with_a_message() {
    let server = server_args();
    let endpoints = open_endpoints(&server, &[Placement::Host, Placement::Host]).expect("server engines");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let (served, client) = std::thread::scope(|s| {
        let served = s.spawn(|| serve_all(&listener, &endpoints, &server.serve));
        let client = run_pairs(&client_args(&address), &[Placement::Host]);
        (served.join().unwrap(), client)
    });
    let client = client.expect_err("one client engine against two server engines").0;
    assert!(client.contains("the server runs 2 engine(s), the client 1"), "{client}");
    assert!(served.expect_err("the server fails too").0.contains("list as many GPUs on both sides"));
}
