"""Multi-NIC paged-write throughput on the network-namespace test bed: 1 vs 2 vs 4 NICs per host.

    python -m benchmarks.bench_multi_nic [--hosts 2] [--nics 1 2 4] [--page-kib 64] [--pages 10000]
        [--iters 3] [--rounds 2] [--batch 1000] [--poll-mode busy] [--pin-workers CPU ...]
        [--json-out bench-results/bench_multi_nic.json]

Needs root (it builds a ``fabric_lib.testing.netns.TestBed`` of ``--hosts`` namespaces with K veth
NICs each, for every K of ``--nics``). On every host one rank opens ONE engine over all K NICs
(``TransferEngine("tcp", ["nic0", ..])``) and bootstraps over gloo. Rank 0 sends ``--pages`` pages
of ``--page-kib`` KiB per iteration with ``submit_paged_writes`` (random source pages, random
distinct destination pages, ``--batch`` pages per request, one immediate per request) to the other
hosts in turn; an iteration ends when every receiver has counted all its immediates. Both clocks
are the same CLOCK_MONOTONIC (the namespaces share one kernel), so the time is from the sender's
first submit to the last receiver's last immediate. Every K is run ``--rounds`` times, the Ks
interleaved (so drifting background load hits all alike); each run times ``--iters`` iterations
after one warm-up; the median of all timed iterations of a K is reported, with min and max.

Per NIC, the sender's tx byte counters (/sys/class/net/nicX/statistics inside its namespace, the
same as ``TestBed.nic_counters``) over each timed iteration give the wire throughput (payload plus
TCP/IP and provider headers) and the NIC's share of the traffic, from which its page rate is
estimated (share x pages / time). Total: payload throughput (Gbps), page rate (Mpages/s), and the
ratio to the 1-NIC run. Prints a table and writes JSON (``--json-out``).

All NICs of a host are veths into one kernel and the machine may have few cores, so absolute
numbers say little about real NICs; the point is that sharding over K NICs loses nothing and
that every NIC carries its share.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.report import write_result

REPO = Path(__file__).resolve().parent.parent
PREFIX = "flbench"
IMM_BASE = 50_000


# -- one rank per test-bed host ----------------------------------------------------------------


def _nic_counters(nics: list[str]) -> dict[str, dict[str, int]]:
    out = {}
    for nic in nics:
        base = Path("/sys/class/net") / nic / "statistics"
        out[nic] = {k: int((base / k).read_text()) for k in ("tx_bytes", "tx_packets", "rx_bytes")}
    return out


def worker(_state: None, a: argparse.Namespace) -> dict[str, Any] | None:
    """One host's rank; rank 0 returns its timed iterations."""
    import fabric_lib
    import torch
    import torch.distributed as dist
    from fabric_lib.distributed import exchange
    from fabric_lib.testing import init_process_group, netns

    torch.set_num_threads(1)
    init_process_group("gloo", timeout=120)
    rank, world = dist.get_rank(), dist.get_world_size()
    nics = os.environ[netns.ENV_NICS].split(",")
    page = a.page_kib << 10
    pool = min(a.pool_pages, a.pages)
    cpu = None if a.pin_workers is None else a.pin_workers[rank % len(a.pin_workers)]
    engine = fabric_lib.TransferEngine(
        "tcp", nics, poll_mode=a.poll_mode, transfer_timeout=60.0, worker_cpu=cpu
    )
    try:
        assert engine.domain_names == nics, (engine.domain_names, nics)
        buf = torch.full((pool * page,), rank + 1, dtype=torch.uint8)
        region = engine.register_tensor(buf)
        peers = exchange(engine, [region.descriptor])
        receivers = list(range(1, world))
        gen = torch.Generator().manual_seed(a.seed)
        # Requests of one iteration: (receiver, src pages, dst pages), receivers in turn.
        batches = []
        left, i = a.pages, 0
        while left > 0:
            n = min(a.batch, left, pool)
            dst_pages = torch.randperm(pool, generator=gen)[:n].tolist()
            src_pages = torch.randint(0, pool, (n,), generator=gen).tolist()
            batches.append((receivers[i % len(receivers)], src_pages, dst_pages))
            left -= n
            i += 1
        expected = {r: sum(1 for b in batches if b[0] == r) for r in receivers}
        iterations = []
        for it in range(a.iters + 1):  # iteration 0 is the warm-up
            imm = IMM_BASE + it
            counter = engine.imm_counter(imm) if rank != 0 else None
            dist.barrier()
            rec: dict[str, Any] = {}
            if rank == 0:
                before = _nic_counters(nics)
                rec["t_start"] = time.monotonic()
                futures = [
                    engine.submit_paged_writes(page, region, s, peers[r].descriptors[0], d, imm=imm)
                    for r, s, d in batches
                ]
                for f in futures:
                    f.result(timeout=120)
                rec["t_sent"] = time.monotonic()
                after = _nic_counters(nics)
                rec["nics"] = {n: {k: after[n][k] - before[n][k] for k in before[n]} for n in nics}
            else:
                assert counter is not None
                counter.wait(expected[rank], timeout=120)
                rec["t_done"] = time.monotonic()
                time.sleep(0.01)
                assert counter.value == 0, f"extra immediates: {counter.value}"
                counter.close()
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, rec)
            if rank == 0 and it > 0:
                t_done = max(g["t_done"] for g in gathered[1:])
                iterations.append(
                    {
                        "seconds": t_done - rec["t_start"],
                        "sender_s": rec["t_sent"] - rec["t_start"],
                        "nics": rec["nics"],
                    }
                )
        if rank != 0:  # the bytes landed: every destination page written holds the sender's value
            written = sorted({d for r, _, ds in batches if r == rank for d in ds})
            view = buf.view(pool, page)[written]
            assert bool((view == 1).all()), "destination pages do not hold the sender's bytes"
        dist.barrier()
        if rank == 0:
            return {"iterations": iterations, "requests": len(batches), "pool_pages": pool}
        return None
    finally:
        engine.stop()
        dist.destroy_process_group()


# -- driver ------------------------------------------------------------------------------------


def run_once(a: argparse.Namespace, k: int) -> dict[str, Any]:
    """One test bed with ``k`` NICs per host, one rank per host; rank 0's timed iterations."""
    from fabric_lib.testing import RankError, gather, host_ranks, netns

    env = {"FI_TCP_IFACE": None, "OMP_NUM_THREADS": "1"}
    with netns.TestBed(hosts=a.hosts, nics=k, prefix=PREFIX) as bed:
        before = [bed.nic_counters(h) for h in range(a.hosts)]
        try:
            with host_ranks(bed, env=env, timeout=120) as ranks:
                raw = gather(ranks.submit_all(worker, a), timeout=a.timeout)[0]
        except RankError as e:
            raise SystemExit(f"bench_multi_nic: {k}-NIC run failed: {e}") from None
        after = [bed.nic_counters(h) for h in range(a.hosts)]
    # TestBed.nic_counters around the whole run (warm-up, gloo bootstrap and barriers included).
    raw["testbed_tx_bytes_host0"] = {n: after[0][n]["tx_bytes"] - before[0][n]["tx_bytes"] for n in after[0]}
    return dict(raw)


def summarise(a: argparse.Namespace, k: int, runs: list[dict]) -> dict:
    """Median over every timed iteration of every round; per-NIC figures from that iteration."""
    its = [it for r in runs for it in r["iterations"]]
    payload = a.pages * (a.page_kib << 10)
    med = sorted(its, key=lambda x: x["seconds"])[len(its) // 2]
    secs = med["seconds"]
    total_tx = sum(v["tx_bytes"] for v in med["nics"].values())
    per_nic = {}
    for nic, v in med["nics"].items():
        share = v["tx_bytes"] / total_tx if total_tx else 0.0
        per_nic[nic] = {
            "tx_bytes": v["tx_bytes"],
            "tx_packets": v["tx_packets"],
            "share": round(share, 4),
            "wire_gbps": round(v["tx_bytes"] * 8 / secs / 1e9, 3),
            "mpages_per_s": round(share * a.pages / secs / 1e6, 4),
        }
    gbps = [payload * 8 / x["seconds"] / 1e9 for x in its]
    return {
        "nics": k,
        "hosts": a.hosts,
        "requests_per_iter": runs[0]["requests"],
        "pool_pages": runs[0]["pool_pages"],
        "payload_bytes_per_iter": payload,
        "seconds_median": round(secs, 4),
        "payload_gbps": round(payload * 8 / secs / 1e9, 3),
        "payload_gbps_min": round(min(gbps), 3),
        "payload_gbps_max": round(max(gbps), 3),
        "payload_gbps_by_round": [
            [round(payload * 8 / x["seconds"] / 1e9, 3) for x in r["iterations"]] for r in runs
        ],
        "mpages_per_s": round(a.pages / secs / 1e6, 4),
        "wire_overhead": round(total_tx / payload, 4),
        "per_nic": per_nic,
        "testbed_tx_bytes_host0_by_round": [r["testbed_tx_bytes_host0"] for r in runs],
    }


def print_table(rows: list[dict], a: argparse.Namespace) -> None:
    print(
        f"\nmulti-NIC paged writes: {a.hosts} hosts, {a.pages} pages of {a.page_kib} KiB per iteration "
        f"({a.batch} pages per request), poll_mode={a.poll_mode}, "
        f"median of {a.iters} iterations x {a.rounds} rounds\n"
    )
    print(
        f"{'NICs':>4}  {'total Gbps':>10}  {'(min-max)':>13}  {'Mpages/s':>9}  {'vs 1 NIC':>8}  "
        f"{'best vs 1':>9}  {'wire/payload':>12}  "
        "per NIC (wire Gbps, Mpages/s, share of bytes)"
    )
    for r in rows:
        ratio = f"{r['ratio_vs_1nic']:.2f}x" if r.get("ratio_vs_1nic") is not None else "-"
        best = f"{r['best_ratio_vs_1nic']:.2f}x" if r.get("best_ratio_vs_1nic") is not None else "-"
        nics = "  ".join(
            f"{n}: {v['wire_gbps']:.2f} Gbps {v['mpages_per_s']:.4f} Mp/s {v['share'] * 100:.1f}%"
            for n, v in r["per_nic"].items()
        )
        span = f"{r['payload_gbps_min']:.2f}-{r['payload_gbps_max']:.2f}"
        print(
            f"{r['nics']:>4}  {r['payload_gbps']:>10.2f}  {span:>13}  {r['mpages_per_s']:>9.4f}  {ratio:>8}  "
            f"{best:>9}  {r['wire_overhead']:>12.3f}  {nics}"
        )
    print()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2, help="hosts (rank 0 sends to the others in turn)")
    p.add_argument("--nics", type=int, nargs="+", default=[1, 2, 4], help="NICs per host, one run each")
    p.add_argument("--page-kib", type=int, default=64, help="page size in KiB")
    p.add_argument("--pages", type=int, default=10000, help="pages per iteration")
    p.add_argument("--batch", type=int, default=1000, help="pages per submit_paged_writes request")
    p.add_argument(
        "--pool-pages", type=int, default=4096, help="pages in each host's buffer (random indices into it)"
    )
    p.add_argument("--iters", type=int, default=3, help="timed iterations per run (after one warm-up)")
    p.add_argument(
        "--rounds", type=int, default=2, help="runs of every K, interleaved (1, 2, 4, 1, 2, 4, ...)"
    )
    p.add_argument(
        "--poll-mode", choices=["busy", "adaptive"], default="busy", help="engine worker polling mode"
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the random page indices")
    p.add_argument(
        "--pin-workers",
        type=int,
        nargs="+",
        metavar="CPU",
        help="pin host i's engine worker thread to CPU i mod len (default: not pinned)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed for each K's run")
    p.add_argument(
        "--json-out",
        default=str(REPO / "bench-results" / "bench_multi_nic.json"),
        help="result file (shared format of benchmarks/report.py)",
    )
    a = p.parse_args(argv)
    if a.hosts < 2 or any(k < 1 for k in a.nics) or a.pages < 1 or a.batch < 1 or a.iters < 1 or a.rounds < 1:
        p.error("need --hosts >= 2 and positive --nics, --pages, --batch, --iters")
    from fabric_lib.testing import netns as tb

    ok, why = tb.available()
    if not ok:
        print(f"bench_multi_nic: the netns test bed is unavailable here: {why}", file=sys.stderr)
        return 2
    tb.cleanup_stale(PREFIX)
    runs: dict[int, list[dict]] = {k: [] for k in a.nics}
    load_before = os.getloadavg()
    for rnd in range(a.rounds):  # interleaved, so a change in background load hits every K alike
        for k in a.nics:
            t = time.monotonic()
            runs[k].append(run_once(a, k))
            payload_bits = a.pages * (a.page_kib << 10) * 8
            gbps = [round(payload_bits / x["seconds"] / 1e9, 2) for x in runs[k][-1]["iterations"]]
            took = time.monotonic() - t
            print(
                f"bench_multi_nic: round {rnd + 1}/{a.rounds}, {k} NIC(s): {gbps} Gbps ({took:.1f}s)",
                file=sys.stderr,
            )
    rows = [summarise(a, k, runs[k]) for k in a.nics]
    base = next((r for r in rows if r["nics"] == 1), None)
    for r in rows:
        r["ratio_vs_1nic"] = round(r["payload_gbps"] / base["payload_gbps"], 3) if base else None
        # Best iteration vs best iteration: less sensitive to other load on a shared machine.
        r["best_ratio_vs_1nic"] = round(r["payload_gbps_max"] / base["payload_gbps_max"], 3) if base else None
    print_table(rows, a)
    config = {k: v for k, v in vars(a).items() if k != "json_out"}
    results = {
        "rows": rows,
        "platform": platform.platform(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    write_result(Path(a.json_out), "bench_multi_nic", "tcp", config, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
