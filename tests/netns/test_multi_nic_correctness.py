"""One TransferEngine over all NICs of each host, across the network-namespace test bed: sharded
single writes (a ring: every rank writes to the next), pinned writes on every domain, a hypothesis
property over paged writes (random page lists, strides, offsets and sender/receiver pairs, drawn
by rank 0 and run by all ranks), scatter from rank 0 to all others (``shard_by`` "peer" and
"bytes"), barriers, bad input, and a traffic phase whose per-NIC byte counters prove that every
NIC carried its share; on 3 hosts x 2 NICs and 2 hosts x 4 NICs. Every byte and every immediate
count is checked exactly, and after each wait the counter must stay at 0 (no extra immediates).

Each host runs one rank (``multi_nic.on_hosts``). Needs root (network namespaces) and torch;
skips with the reason otherwise. Run alone with ``pytest tests/netns -k multi_nic``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import fabric_lib
import pytest
import torch
import torch.distributed as dist
from fabric_lib.distributed import exchange
from fabric_lib.testing import gather
from fabric_lib.testing import netns as tb
from fabric_lib.testing.netns import TestBed

from .multi_nic import (
    BUF,
    PREFIX,
    SIZES,
    WAIT,
    Ctx,
    check,
    check_bytes,
    delta,
    expect_exact,
    host_nics,
    nic_tx_rx,
    on_hosts,
    pattern,
)

pytestmark = [pytest.mark.netns, pytest.mark.usefixtures("multi_nic_requirements")]

TRAFFIC = 32 << 20  # bytes rank 0 sends to rank 1 in the counted traffic phase


# -- run in each host's rank ---------------------------------------------------------------------
def phase_single_writes(ctx: Ctx, src, dst, dst_buf, peers) -> dict:
    """Ring of sharded single writes (every rank to rank+1), then pinned writes on every domain."""
    e, k = ctx.engine, ctx.engine.num_domains
    nxt, prv = (ctx.rank + 1) % ctx.world, (ctx.rank - 1) % ctx.world
    shard_choices = sorted({None, 1, 2, k - 1, k}, key=lambda s: -1 if s is None else s)
    shard_choices = [s for s in shard_choices if s is None or 1 <= s <= k]
    cases: list[tuple[int, int | None, int | None, int, int]] = []
    dst_off = 0
    for i, size in enumerate(SIZES):
        for shard in shard_choices:
            src_off = (7 * len(cases) + 1) % 4096
            cases.append((size, shard, None, src_off, dst_off))
            dst_off += size + 3  # unaligned destination offsets, with gaps that must stay zero
    for d in range(k):  # the same 192 KiB write pinned to each domain in turn
        cases.append((192 << 10, None, d, 4096 + d, dst_off))
        dst_off += (192 << 10) + 5
    check(dst_off <= BUF, f"cases need {dst_off} bytes")
    counters = [e.imm_counter(1000 + i) for i in range(len(cases))]
    dist.barrier()
    futures = [
        e.submit_write(
            src,
            peers[nxt].descriptors[1],
            size,
            src_offset=so,
            dst_offset=do,
            imm=1000 + i,
            shard_domains=shard,
            domain=pin,
        )
        for i, (size, shard, pin, so, do) in enumerate(cases)
    ]
    for f in futures:
        f.result(timeout=WAIT)
    for i, c in enumerate(counters):
        expect_exact(c, 1, f"single write case {cases[i][:3]}")
        c.close()
    expected = torch.zeros(BUF, dtype=torch.uint8)
    theirs = pattern(prv)
    for size, _, _, so, do in cases:
        expected[do : do + size] = theirs[so : so + size]
    check_bytes(dst_buf, expected, f"ring single writes from rank {prv}")
    dst_buf.zero_()
    dist.barrier()
    return {
        "cases": len(cases),
        "bytes": sum(c[0] for c in cases),
        "shard_choices": [str(s) for s in shard_choices],
    }


def phase_paged_property(ctx: Ctx, src, dst, dst_buf, peers, examples: int) -> dict:
    """A hypothesis property over paged writes: rank 0 draws every example and broadcasts it;
    every rank runs it (sender writes, receiver verifies, others idle); results are gathered."""
    e = ctx.engine
    ran = [0]

    def run_example(p: dict[str, Any]) -> str | None:
        """Executed by every rank for one example; returns this rank's error or None."""
        try:
            counter = e.imm_counter(p["imm"]) if ctx.rank == p["dst_rank"] else None
            dist.barrier()  # receiver's buffer is zero and its counter is claimed
            if ctx.rank == p["src_rank"]:
                e.submit_paged_writes(
                    p["page_len"],
                    src,
                    p["src_pages"],
                    peers[p["dst_rank"]].descriptors[1],
                    p["dst_pages"],
                    src_stride=p["src_stride"],
                    src_offset=p["src_offset"],
                    dst_stride=p["dst_stride"],
                    dst_offset=p["dst_offset"],
                    imm=p["imm"],
                ).result(timeout=WAIT)
            if counter is not None:
                try:
                    expect_exact(counter, 1, "paged write")
                finally:
                    counter.close()
                theirs = pattern(p["src_rank"])
                expected = torch.zeros(BUF, dtype=torch.uint8)
                for s, d in zip(p["src_pages"], p["dst_pages"]):
                    so, do = s * p["src_stride"] + p["src_offset"], d * p["dst_stride"] + p["dst_offset"]
                    expected[do : do + p["page_len"]] = theirs[so : so + p["page_len"]]
                check_bytes(dst_buf, expected, "paged write")
                dst_buf.zero_()
            return None
        except Exception as ex:  # noqa: BLE001 - reported to rank 0, which fails the property
            return f"rank {ctx.rank}: {type(ex).__name__}: {ex}"

    def broadcast(params: dict | None) -> dict | None:
        box = [params]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gathered_errors(err: str | None) -> list[str]:
        out: list = [None] * ctx.world
        dist.all_gather_object(out, err)
        return [x for x in out if x]

    if ctx.rank != 0:
        while (params := broadcast(None)) is not None:
            gathered_errors(run_example(params))
        return {}

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    pairs = [(s, d) for s in range(ctx.world) for d in range(ctx.world) if s != d]

    @st.composite
    def examples_st(draw):
        src_rank, dst_rank = draw(st.sampled_from(pairs))
        page_len = draw(st.sampled_from([1, 100, 4096, 8192 + 3, 65536]))
        n = draw(st.integers(1, 64))
        src_pages = draw(st.lists(st.integers(0, 63), min_size=n, max_size=n))  # repeats allowed
        dst_pages = draw(st.permutations(range(64)))[:n]  # distinct: no overlapping pages
        return {
            "src_rank": src_rank,
            "dst_rank": dst_rank,
            "page_len": page_len,
            "src_pages": src_pages,
            "dst_pages": dst_pages,
            "src_stride": page_len + draw(st.integers(0, 100)),
            "dst_stride": page_len + draw(st.integers(0, 100)),
            "src_offset": draw(st.integers(0, 100)),
            "dst_offset": draw(st.integers(0, 100)),
        }

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(examples_st())
    def prop(params: dict[str, Any]) -> None:
        params["imm"] = 2000 + ran[0]
        ran[0] += 1
        broadcast(params)
        errors = gathered_errors(run_example(params))
        assert not errors, f"{errors} for {params}"

    try:
        prop()
    finally:
        broadcast(None)
    return {"paged_examples": ran[0]}


def phase_scatter_barrier(ctx: Ctx, src, dst, dst_buf, peers) -> dict:
    """Rank 0 scatters to every other rank with both shardings, then barriers: rank 0's group,
    then all-to-all barriers from every rank."""
    e = ctx.engine
    others = [r for r in range(ctx.world) if r != ctx.rank]
    group = e.add_peer_group([peers[r].address for r in others])
    counters = {imm: e.imm_counter(imm) for imm in (3000, 3001, 3002, 3003)}
    half = BUF // 2
    lengths = {r: (1 << 20) + 77 * r + 3 for r in range(ctx.world)}

    def targets(region_off: int) -> list:
        return [
            (lengths[r], 4096 * r + 1, peers[r].descriptors[1], region_off + 13 * r)
            for r in range(1, ctx.world)
        ]

    dist.barrier()
    if ctx.rank == 0:
        e.submit_scatter(src, targets(0), imm=3000, group=group, shard_by="peer").result(timeout=WAIT)
        e.submit_scatter(src, targets(half), imm=3001, shard_by="bytes").result(timeout=WAIT)  # no group
        e.submit_barrier(3002, group).result(timeout=WAIT)
    e.submit_barrier(3003, group).result(timeout=WAIT)  # every rank to every other rank
    if ctx.rank != 0:
        for imm in (3000, 3001, 3002):
            expect_exact(counters[imm], 1, f"scatter/barrier imm {imm}")
        expected = torch.zeros(BUF, dtype=torch.uint8)
        theirs, r = pattern(0), ctx.rank
        for off in (0, half):
            expected[off + 13 * r : off + 13 * r + lengths[r]] = theirs[
                4096 * r + 1 : 4096 * r + 1 + lengths[r]
            ]
        check_bytes(dst_buf, expected, "scatter")
        dst_buf.zero_()
    expect_exact(counters[3003], ctx.world - 1, "all-to-all barrier")
    for c in counters.values():
        c.close()
    dist.barrier()
    return {"scatter_targets": ctx.world - 1}


def phase_bad_input(ctx: Ctx, src, dst, peers) -> dict:
    """Invalid requests are refused before anything is posted (checked on every rank)."""
    e, peer = ctx.engine, peers[(ctx.rank + 1) % ctx.world].descriptors[1]
    refused = {}

    def refuses(name: str, exc: type[Exception], needle: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except exc as ex:
            check(needle in str(ex), f"{name}: {type(ex).__name__} without {needle!r}: {ex}")
            refused[name] = type(ex).__name__
            return
        except Exception as ex:
            raise AssertionError(f"{name}: expected {exc.__name__}, got {type(ex).__name__}: {ex}") from ex
        raise AssertionError(f"{name}: expected {exc.__name__}, nothing raised")

    page = 1 << 20
    n_pages = BUF // page
    refuses(
        "src page out of range",
        fabric_lib.InvalidArgumentError,
        f"page index {n_pages}",
        lambda: e.submit_paged_writes(page, src, [0, n_pages], peer, [0, 1]),
    )
    refuses(
        "dst page out of range",
        fabric_lib.InvalidArgumentError,
        "destination page index",
        lambda: e.submit_paged_writes(page, src, [0, 1], peer, [1, n_pages + 3]),
    )
    refuses(
        "page past end via offset",
        fabric_lib.InvalidArgumentError,
        "page index",
        lambda: e.submit_paged_writes(page, src, [n_pages - 1], peer, [0], src_offset=1),
    )
    refuses(
        "empty page list",
        fabric_lib.InvalidArgumentError,
        "empty page list",
        lambda: e.submit_paged_writes(page, src, [], peer, []),
    )
    refuses(
        "page count mismatch",
        fabric_lib.InvalidArgumentError,
        "destination pages",
        lambda: e.submit_paged_writes(page, src, [0, 1], peer, [0]),
    )
    refuses(
        "domain out of range",
        fabric_lib.InvalidArgumentError,
        "out of range",
        lambda: e.submit_write(src, peer, 16, domain=e.num_domains),
    )
    refuses(
        "write past end",
        fabric_lib.InvalidArgumentError,
        "",
        lambda: e.submit_write(src, peer, 16, dst_offset=BUF - 8),
    )
    # Nothing of the refused requests may have arrived anywhere.
    dist.barrier()
    check(bool((dst == 0).all()), "a refused request wrote bytes")
    dist.barrier()
    return {"refused": refused}


def phase_traffic(ctx: Ctx, src, dst, dst_buf, peers, payload: int) -> dict:
    """Rank 0 sends ``payload`` bytes to rank 1, half as 64 KiB paged writes of random pages
    (random subsets in random order, page i of the source to page i of the destination) and half
    as sharded single writes of the whole buffer; rank 0's per-NIC tx counters over exactly this
    phase are reported. Every write puts source byte x at destination byte x, so however the
    concurrent requests land, the destination must hold the source's bytes wherever any request
    wrote, and zeros elsewhere."""
    e = ctx.engine
    page = 64 << 10
    n_pages = BUF // page
    gen = torch.Generator().manual_seed(7)
    calls, singles = [], []
    remaining = payload // 2
    while remaining >= page:
        n = min(n_pages, remaining // page)
        calls.append(torch.randperm(n_pages, generator=gen)[:n].tolist())
        remaining -= n * page
    remaining = payload - sum(len(c) for c in calls) * page
    while remaining > 0:
        singles.append(min(BUF, remaining))
        remaining -= singles[-1]
    counter = e.imm_counter(4000) if ctx.rank == 1 else None
    dist.barrier()
    out: dict = {}
    if ctx.rank == 0:
        desc = peers[1].descriptors[1]
        before = nic_tx_rx(ctx.nics)
        t = time.monotonic()
        futures = [e.submit_paged_writes(page, src, pages, desc, pages, imm=4000) for pages in calls]
        futures += [e.submit_write(src, desc, n, imm=4000) for n in singles]
        for f in futures:
            f.result(timeout=WAIT)
        elapsed = time.monotonic() - t
        out = {
            "tx": delta(before, nic_tx_rx(ctx.nics)),
            "payload": payload,
            "seconds": round(elapsed, 3),
            "requests": len(futures),
        }
    if counter is not None:
        expect_exact(counter, len(calls) + len(singles), "traffic phase")
        counter.close()
        expected = torch.zeros(BUF, dtype=torch.uint8)
        theirs = pattern(0)
        for pages in calls:
            for q in pages:
                expected[q * page : (q + 1) * page] = theirs[q * page : (q + 1) * page]
        for n in singles:
            expected[:n] = theirs[:n]
        check_bytes(dst_buf, expected, "traffic phase")
        dst_buf.zero_()
    dist.barrier()
    return out


def scenario_correctness(
    _state: None, examples: int, traffic_bytes: int, shard_min_bytes: int = 0
) -> dict[str, Any]:
    ctx = Ctx(host_nics(), poll_mode="adaptive", shard_min_bytes=shard_min_bytes, transfer_timeout=30.0)
    src_buf, dst_buf = pattern(ctx.rank), torch.zeros(BUF, dtype=torch.uint8)
    src, dst = ctx.engine.register_tensor(src_buf), ctx.engine.register_tensor(dst_buf)
    peers = exchange(ctx.engine, [src.descriptor, dst.descriptor])
    timings: dict[str, float] = {}
    out: dict = {"rank": ctx.rank, "domains": ctx.engine.domain_names}

    def timed(name: str, fn, *a):
        t = time.monotonic()
        r = fn(*a)
        timings[name] = round(time.monotonic() - t, 3)
        return r

    out["single"] = timed("single", phase_single_writes, ctx, src, dst, dst_buf, peers)
    out["paged"] = timed("paged", phase_paged_property, ctx, src, dst, dst_buf, peers, examples)
    out["scatter"] = timed("scatter", phase_scatter_barrier, ctx, src, dst, dst_buf, peers)
    out["bad_input"] = timed("bad_input", phase_bad_input, ctx, src, dst_buf, peers)
    out["traffic"] = timed("traffic", phase_traffic, ctx, src, dst, dst_buf, peers, traffic_bytes)
    out["timings"] = timings
    dist.barrier()
    out["stop_s"] = ctx.close()
    return out


# -- the tests --------------------------------------------------------------------------------------
def _counters(bed: TestBed) -> list[dict[str, dict[str, int]]]:
    return [bed.nic_counters(h) for h in range(bed.hosts)]


def _check_spread(
    bed: TestBed, reports: list[dict[str, Any]], before: list[dict[str, Any]], after: list[dict[str, Any]]
) -> dict[str, float]:
    """The counted traffic phase (rank 0 -> rank 1, TRAFFIC bytes) went over every NIC evenly.

    Two views of rank 0's tx bytes per NIC: the worker's own reading of the counters around
    exactly that phase (tight: each NIC carried payload/K within -20%/+20%, TCP/IP headers
    included), and ``TestBed.nic_counters`` around the whole run (a lower bound: other phases
    and gloo's bootstrap on nic0 only add)."""
    k = bed.num_nics
    share = TRAFFIC / k
    phase = reports[0]["traffic"]
    assert phase["payload"] == TRAFFIC
    spread = {}
    for nic in bed.nics:
        tx = phase["tx"][nic]["tx_bytes"]
        whole = after[0][nic]["tx_bytes"] - before[0][nic]["tx_bytes"]
        received = after[1][nic]["rx_bytes"] - before[1][nic]["rx_bytes"]
        assert 0.8 * share <= tx <= 1.2 * share, f"{nic} sent {tx} bytes of the phase; fair share {share:.0f}"
        assert whole >= 0.8 * share, f"nic_counters: host 0 {nic} sent only {whole} bytes in the run"
        assert received >= 0.8 * share, f"nic_counters: host 1 {nic} received only {received} bytes"
        spread[nic] = round(tx / share, 3)
    return spread


def _check_correctness(bed: TestBed, reports: list[dict[str, Any]], examples: int) -> None:
    k = bed.num_nics
    for rank, rep in enumerate(reports):
        assert rep["rank"] == rank and rep["domains"] == bed.nics, rep
        assert rep["single"]["cases"] >= len(rep["single"]["shard_choices"]) * 9 + k
        assert rep["scatter"]["scatter_targets"] == bed.hosts - 1
        assert set(rep["bad_input"]["refused"]) >= {
            "src page out of range",
            "dst page out of range",
            "empty page list",
        }
        assert set(rep["bad_input"]["refused"].values()) == {"InvalidArgumentError"}
        assert rep["stop_s"] < 5, rep["stop_s"]
    assert reports[0]["paged"]["paged_examples"] == examples


@pytest.mark.timeout(150)
def test_one_engine_over_two_nics_three_hosts(bed3x2: TestBed) -> None:
    """Sharded/pinned single writes (ring), 12 hypothesis paged-write examples between random host
    pairs, scatter to 2 peers (both shardings), barriers, bad input; traffic over both NICs."""
    before = _counters(bed3x2)
    with on_hosts(bed3x2) as ranks:
        reports = gather(ranks.submit_all(scenario_correctness, examples=12, traffic_bytes=TRAFFIC), 120)
    after = _counters(bed3x2)
    _check_correctness(bed3x2, reports, 12)
    spread = _check_spread(bed3x2, reports, before, after)
    print(f"3x2: phase timings {reports[0]['timings']}, tx share per NIC {spread}")


@pytest.mark.timeout(150)
def test_one_engine_over_four_nics_two_hosts() -> None:
    """The same on 2 hosts x 4 NICs (shard_domains 1, 2, 3 and all; pinned on each of 4)."""
    with tb.TestBed(hosts=2, nics=4, prefix=PREFIX) as bed:
        before = _counters(bed)
        with on_hosts(bed) as ranks:
            reports = gather(ranks.submit_all(scenario_correctness, examples=8, traffic_bytes=TRAFFIC), 120)
        after = _counters(bed)
    _check_correctness(bed, reports, 8)
    assert reports[0]["single"]["shard_choices"] == ["None", "1", "2", "3", "4"]
    spread = _check_spread(bed, reports, before, after)
    print(f"2x4: phase timings {reports[0]['timings']}, tx share per NIC {spread}")
