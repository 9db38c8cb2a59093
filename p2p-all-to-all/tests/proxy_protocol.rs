//! The proxy's protocol end to end on the CPU (see `host_ranks`): each rank's proxy on a real
//! engine (tcp, and udp;ofi_rxd, which delivers out of order), run by the engine's worker
//! unless a scenario says otherwise.
mod host_ranks;

use std::time::Instant;

use host_ranks::{all_ok, run, Scenario, MAX_TOKENS, WAIT};

#[test]
fn everything_remote_over_tcp_with_overflow() {
    // Quota 5 of 24 tokens: most pairs use both the private and the overflow write.
    let sc = Scenario {
        provider: "tcp",
        world: 3,
        nvlink: 1,
        private_tokens: 5,
        calls: 12,
        skew: false,
        dies: None,
        fence: true,
        scatter: false, // one write per remote rank (scatter_data off)
        ..Default::default()
    };
    all_ok(run(sc), 12);
}

#[test]
fn mixed_domains_and_skew_over_tcp() {
    // Two domains of two: each rank has one NVLink peer (counts only) and two remote ranks;
    // skewed routing sends every token to ranks 0 and 1 only. The proxy on the engine's worker
    // (the default) and on a thread of its own.
    for (skew, own_thread) in [(false, false), (true, false), (true, true)] {
        let sc = Scenario {
            own_thread,
            provider: "tcp",
            world: 4,
            nvlink: 2,
            private_tokens: 8,
            calls: 6,
            skew,
            dies: None,
            fence: false,
            scatter: true,
            ..Default::default()
        };
        all_ok(run(sc), 6);
    }
}

#[test]
fn more_than_thirty_two_ranks_in_nvlink_domains() {
    // 40 ranks in domains of 4 over shm: ranks 32-39 form a domain (high bits of every rank
    // set), and each rank has 36 remote ranks, most of them sent no private rows.
    let sc = Scenario {
        provider: "shm",
        world: 40,
        nvlink: 4,
        private_tokens: 4,
        calls: 3,
        scatter: true,
        ..Default::default()
    };
    all_ok(run(sc), 3);
}

#[test]
fn reordering_provider_exactly_once() {
    // udp;ofi_rxd completes writes out of order: completion is learnt from counts only.
    let sc = Scenario {
        provider: "udp;ofi_rxd",
        world: 3,
        nvlink: 1,
        private_tokens: 3,
        calls: 10,
        skew: false,
        dies: None,
        fence: false,
        scatter: true,
        ..Default::default()
    };
    all_ok(run(sc), 10);
}

#[test]
fn no_overflow_when_the_quota_covers_everything() {
    let sc = Scenario {
        provider: "tcp",
        world: 2,
        nvlink: 1,
        private_tokens: MAX_TOKENS,
        calls: 5,
        skew: true,
        dies: None,
        fence: false,
        scatter: true,
        ..Default::default()
    };
    all_ok(run(sc), 5);
}

#[test]
fn a_dead_peer_ends_in_a_timeout_not_a_hang() {
    let start = Instant::now();
    let sc = Scenario {
        provider: "tcp",
        world: 3,
        nvlink: 1,
        private_tokens: 4,
        calls: 4,
        skew: false,
        dies: Some((2, 3)),
        fence: false,
        scatter: true,
        ..Default::default()
    };
    let Some(results) = run(sc) else { return };
    assert_eq!(results[2].as_ref().map(|o| o.calls), Ok(2), "the dying rank finished two calls");
    for (r, res) in results.iter().enumerate().take(2) {
        let err = res.as_ref().expect_err("the survivors time out");
        assert!(err.contains("timed out"), "rank {r}: {err}");
    }
    // Bounded: the waits' timeout plus shutdown, never a hang.
    assert!(start.elapsed() < WAIT, "{:?}", start.elapsed());
}

#[test]
fn eager_first_targets_exactly_once_and_logged() {
    // A scatter to more than one target hands its first target to the engine alone, then the
    // rest: byte-exact and exactly once over a provider that reorders. Each engine logs its
    // commands' first posts: the split adds at least the count message's and the combine's
    // second request per call (the routing is the same in both runs).
    let calls = 6;
    let scenario = |eager_targets| Scenario {
        provider: "udp;ofi_rxd",
        world: 4,
        nvlink: 1,
        private_tokens: 3,
        calls,
        scatter: true,
        eager_targets,
        post_log: true,
        ..Default::default()
    };
    let Some(whole) = run(scenario(0)) else { return };
    let split = run(scenario(1)).expect("the provider was there a moment ago");
    for (r, (whole, split)) in whole.iter().zip(&split).enumerate() {
        let (whole, split) = (whole.as_ref().expect("rank finished"), split.as_ref().expect("rank finished"));
        assert_eq!((whole.calls, split.calls), (calls, calls), "rank {r}");
        let log = &split.post_log;
        assert!(
            log.len() as u64 >= whole.post_log.len() as u64 + 2 * calls,
            "rank {r}: {} / {}",
            log.len(),
            whole.post_log.len()
        );
        assert!(log.windows(2).all(|w| w[0].dequeued_ns <= w[1].dequeued_ns), "rank {r}: in the worker's order");
        assert!(log.iter().all(|p| p.dequeued_ns <= p.posted_ns), "rank {r}");
    }
}
