"""Worker of tests/test_netns_multi_nic.py: one process per test-bed host, ONE engine over all of
the host's NICs (``TransferEngine("tcp", ["nic0", "nic1", ...])``), bootstrapped over gloo with
``fabric_lib.distributed.exchange``.

    python tests/netns_multi_nic_worker.py SCENARIO [options]

Scenarios (every one prints a single ``RESULT <json>`` line on success, and exits non-zero with a
traceback on any failed check):

* ``correctness`` - sharded single writes (ring: every rank writes to the next), pinned writes on
  every domain, a hypothesis property over paged writes (random page lists, strides, offsets and
  sender/receiver pairs, driven by rank 0 and executed by all ranks), scatter from rank 0 to all
  others (``shard_by`` "peer" and "bytes"), barriers, bad input, and a traffic phase whose
  per-NIC byte counters (read from /sys/class/net inside the namespace, what
  ``TestBed.nic_counters`` reads) prove that every NIC carried its share. Every byte and every
  immediate count is checked exactly, and after each wait the counter must stay at 0 (no extra
  immediates).
* ``mismatch`` - rank ``--single-nic-rank`` opens an engine over only its first NIC; descriptors
  and addresses of engines with a different domain count must be refused (InvalidDescriptorError).
* ``fault`` - rank 0 streams sharded writes to rank 1 (short ``transfer_timeout``) while the test
  driver takes one of rank 1's NICs down (coordinated through marker files in ``--sync-dir``);
  every request must settle (ok or TransferError/FabricTimeoutError) within a bound, and writes
  pinned to domain 0 must still arrive byte-exact.

Rank = host index; the test bed sets RANK/WORLD_SIZE, FABRIC_LIB_TESTBED_NICS,
FABRIC_LIB_TESTBED_BOOTSTRAP, MASTER_PORT and GLOO_SOCKET_IFNAME.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import fabric_lib
import torch
import torch.distributed as dist
from fabric_lib.distributed import exchange

WAIT = 30.0  # seconds for any single wait on a future or a counter
SETTLE = 0.05  # seconds to let stray immediates arrive before checking a counter is back at 0
BUF = 24 << 20  # bytes of each registered source/destination buffer

# Single-write sizes: tiny, around and across the 8 KiB shard alignment, and large non-multiples.
SIZES = [1, 4095, 8191, 8192, 8193, 16385, 3 * 8192 + 1, (1 << 20) + 3, (3 << 20) + 5]


# -- helpers -----------------------------------------------------------------------------------


def log(*args: object) -> None:
    print(f"[rank {os.environ.get('RANK')}]", *args, file=sys.stderr, flush=True)


def check(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(message)


@functools.cache
def pattern(rank: int, n: int = BUF) -> torch.Tensor:
    """The deterministic random source bytes of ``rank`` (every rank can recompute any rank's).
    Cached: never modify the result."""
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1000 + rank)
    )


def nic_tx_rx(nics: list[str]) -> dict[str, dict[str, int]]:
    """This host's per-NIC byte counters (the same files TestBed.nic_counters reads)."""
    out = {}
    for nic in nics:
        base = Path("/sys/class/net") / nic / "statistics"
        out[nic] = {k: int((base / k).read_text()) for k in ("tx_bytes", "rx_bytes", "tx_packets")}
    return out


def delta(before: dict, after: dict) -> dict[str, dict[str, int]]:
    return {nic: {k: after[nic][k] - before[nic][k] for k in before[nic]} for nic in before}


def expect_exact(counter: fabric_lib.ImmCounter, n: int, what: str) -> None:
    """Waits for exactly ``n`` arrivals: ``n`` arrive within WAIT, and none more after SETTLE."""
    counter.wait(n, timeout=WAIT)
    time.sleep(SETTLE)
    extra = counter.value
    check(extra == 0, f"{what}: {extra} extra arrivals of immediate {counter.imm} after the expected {n}")


def first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    idx = (a != b).nonzero()
    if len(idx) == 0:
        return "equal"
    i = int(idx[0])
    return f"{len(idx)} bytes differ, first at {i}: got {int(a[i])}, expected {int(b[i])}"


def check_bytes(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    check(torch.equal(got, expected), f"{what}: {first_diff(got, expected)}")


class Ctx:
    """One rank: its engine over every NIC, its buffers and everyone's descriptors."""

    def __init__(self, nics: list[str], **engine_kwargs: object) -> None:
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.nics = nics
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{os.environ['FABRIC_LIB_TESTBED_BOOTSTRAP']}:{os.environ['MASTER_PORT']}",
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=90),
        )
        self.engine = fabric_lib.TransferEngine("tcp", nics, **engine_kwargs)
        check(self.engine.domain_names == nics, f"domains {self.engine.domain_names} != {nics}")
        check(self.engine.provider.startswith("tcp"), f"provider {self.engine.provider}")

    def close(self) -> float:
        t = time.monotonic()
        self.engine.stop()
        stop_s = time.monotonic() - t
        dist.destroy_process_group()
        return stop_s


def result(**values: object) -> None:
    print("RESULT " + json.dumps(values, sort_keys=True), flush=True)


# -- correctness -------------------------------------------------------------------------------


def phase_single_writes(ctx: Ctx, src, dst, dst_buf, peers) -> dict:
    """Ring of sharded single writes (every rank to rank+1), then pinned writes on every domain."""
    e, k = ctx.engine, ctx.engine.num_domains
    nxt, prv = (ctx.rank + 1) % ctx.world, (ctx.rank - 1) % ctx.world
    shard_choices = sorted({None, 1, 2, k - 1, k}, key=lambda s: -1 if s is None else s)
    shard_choices = [s for s in shard_choices if s is None or 1 <= s <= k]
    cases, dst_off = [], 0
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

    def run_example(params: dict | None) -> str | None:
        """Executed by every rank for one example; returns this rank's error or None."""
        p = params
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
    def prop(params: dict) -> None:
        params["imm"] = 2000 + ran[0]
        ran[0] += 1
        errors = gathered_errors(run_example(broadcast(params)))
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

    def refuses(name: str, exc: type, needle: str, fn) -> None:
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


def scenario_correctness(args: argparse.Namespace) -> None:
    nics = os.environ["FABRIC_LIB_TESTBED_NICS"].split(",")
    ctx = Ctx(nics, poll_mode="adaptive", shard_min_bytes=args.shard_min_bytes, transfer_timeout=30.0)
    try:
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
        out["paged"] = timed("paged", phase_paged_property, ctx, src, dst, dst_buf, peers, args.examples)
        out["scatter"] = timed("scatter", phase_scatter_barrier, ctx, src, dst, dst_buf, peers)
        out["bad_input"] = timed("bad_input", phase_bad_input, ctx, src, dst_buf, peers)
        out["traffic"] = timed("traffic", phase_traffic, ctx, src, dst, dst_buf, peers, args.traffic_bytes)
        out["timings"] = timings
        dist.barrier()
        out["stop_s"] = ctx.close()
        result(**out)
    except BaseException:  # noqa: BLE001 - any failure: print it and exit non-zero
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # don't wait in the engine's or gloo's teardown; the driver reports


# -- mismatch ----------------------------------------------------------------------------------


def scenario_mismatch(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    nics = os.environ["FABRIC_LIB_TESTBED_NICS"].split(",")
    mine = nics[:1] if rank == args.single_nic_rank else nics
    ctx = Ctx(mine, poll_mode="adaptive", shard_min_bytes=0, transfer_timeout=10.0)
    try:
        buf = torch.zeros(1 << 20, dtype=torch.uint8)
        region = ctx.engine.register_tensor(buf)
        peers = exchange(ctx.engine, [region.descriptor])
        outcomes = {}
        e = ctx.engine
        for r in range(ctx.world):
            if r == ctx.rank:
                continue
            desc, addr = peers[r].descriptors[0], peers[r].address
            same = (r == args.single_nic_rank) == (ctx.rank == args.single_nic_rank)
            attempts = {
                "write": lambda d=desc: e.submit_write(region, d, 4096, imm=9).result(timeout=WAIT),
                "paged": lambda d=desc: e.submit_paged_writes(1024, region, [0, 1], d, [1, 0]).result(
                    timeout=WAIT
                ),
                "imm": lambda d=desc: e.submit_imm(9, d).result(timeout=WAIT),
                "peer_group": lambda a=addr: e.add_peer_group([a]),
            }
            for name, fn in attempts.items():
                try:
                    fn()
                    outcomes[f"{r}:{name}"] = "ok"
                except fabric_lib.InvalidDescriptorError as ex:
                    outcomes[f"{r}:{name}"] = f"InvalidDescriptorError: {ex}"
                if not same:
                    check(
                        outcomes[f"{r}:{name}"].startswith("InvalidDescriptorError"),
                        f"{name} to rank {r} ({len(mine)} vs other domain count): {outcomes[f'{r}:{name}']}",
                    )
        dist.barrier()
        result(rank=ctx.rank, domains=mine, outcomes=outcomes, stop_s=ctx.close())
    except BaseException:  # noqa: BLE001 - any failure: print it and exit non-zero
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


# -- fault -------------------------------------------------------------------------------------


def wait_file(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


STREAM_IMM = 100_000  # stream request i carries immediate STREAM_IMM + i
STREAM_CHUNK = 256 << 10
STREAM_MAX = 400  # requests at most (each has its own destination slot)


def try_unregister(e: fabric_lib.TransferEngine, region) -> str:
    try:
        e.unregister_memory(region)
        return "ok"
    except fabric_lib.FabricError as ex:
        return f"{type(ex).__name__}: {ex}"


def late_bytes(dst: torch.Tensor, src: torch.Tensor, failed: list[int], slot_src) -> dict[str, int]:
    """How many failed requests' destination slots hold all, some or none of their bytes (after
    the link came back, bytes of timed-out writes may still land: no immediate announces them)."""
    out = {"complete": 0, "partial": 0, "none": 0}
    for i in failed:
        got = dst[i * STREAM_CHUNK : (i + 1) * STREAM_CHUNK]
        want = src[slot_src(i) : slot_src(i) + STREAM_CHUNK]
        same = int((got == want).sum())
        out["complete" if same == STREAM_CHUNK else "none" if bool((got == 0).all()) else "partial"] += 1
    return out


def scenario_fault(args: argparse.Namespace) -> None:
    """Rank 0 streams sharded writes to rank 1 while the driver takes a NIC of rank 1 down.

    Each stream request i writes its own 256 KiB destination slot with its own immediate; rank 1
    checks the slot's bytes in the immediate callback, i.e. at the moment the immediate arrives
    (an immediate must never arrive before its data, on whichever NIC the data went).
    Protocol with the driver (marker files in --sync-dir): rank 0 touches ``streaming`` once 32
    requests succeeded; the driver takes the link down and writes ``link_down`` (its
    time.monotonic(), the clock all processes share); rank 0 keeps streaming for
    transfer_timeout + 2 s, lets every request settle, then writes pinned to domain 0 (the link
    still down) and rank 1 checks them; rank 0 touches ``pinned_done``; the driver brings the link
    back and writes ``link_up``; rank 0 then writes sharded again (recovery, reported).
    """
    sync = Path(args.sync_dir)
    nics = os.environ["FABRIC_LIB_TESTBED_NICS"].split(",")
    tt = args.transfer_timeout
    ctx = Ctx(nics, poll_mode="adaptive", shard_min_bytes=0, transfer_timeout=tt)
    try:
        e = ctx.engine
        src_buf = pattern(0, 8 << 20)
        slots = 8 << 20 // STREAM_CHUNK

        def slot_src(i: int) -> int:
            return (i % slots) * STREAM_CHUNK + (i % 7)

        stream_dst = torch.zeros(STREAM_MAX * STREAM_CHUNK, dtype=torch.uint8)
        other_dst = torch.zeros(8 << 20, dtype=torch.uint8)
        arrivals: dict[int, list[bool]] = {}  # stream request -> data present at each arrival
        strays: list[int] = []

        def on_imm(imm: int) -> None:
            i = imm - STREAM_IMM
            if not 0 <= i < STREAM_MAX:
                strays.append(imm)
                return
            got = stream_dst[i * STREAM_CHUNK : (i + 1) * STREAM_CHUNK]
            arrivals.setdefault(i, []).append(
                torch.equal(got, src_buf[slot_src(i) : slot_src(i) + STREAM_CHUNK])
            )

        if ctx.rank == 1:
            e.set_imm_callback(on_imm)
        src = e.register_tensor(src_buf)
        stream_src = e.register_tensor(src_buf.clone())  # the stream's own, to try unregistering it
        regions = [e.register_tensor(stream_dst), e.register_tensor(other_dst)]
        pinned_c, after_c = e.imm_counter(11), e.imm_counter(12)
        peers = exchange(e, [r.descriptor for r in regions])
        out: dict = {"rank": ctx.rank}
        dist.barrier()
        if ctx.rank == 0:
            records: list[dict] = []  # one per stream request

            def make_done(rec: dict):
                def done(err: BaseException | None) -> None:
                    rec["t_done"] = time.monotonic()
                    rec["outcome"] = "ok" if err is None else type(err).__name__
                    if err is not None:
                        rec["message"] = str(err)[:300]

                return done

            window, t_down, marked = 8, None, False
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and len(records) < STREAM_MAX:
                pending = sum(1 for r in records if "outcome" not in r)
                if pending < window:
                    i = len(records)
                    rec = {"i": i, "t_submit": time.monotonic()}
                    records.append(rec)
                    try:
                        e.submit_write(
                            stream_src,
                            peers[1].descriptors[0],
                            STREAM_CHUNK,
                            src_offset=slot_src(i),
                            dst_offset=i * STREAM_CHUNK,
                            imm=STREAM_IMM + i,
                            on_done=make_done(rec),
                        )
                    except fabric_lib.FabricError as ex:  # refused at submission (queue full, ...)
                        rec.update(
                            t_done=time.monotonic(),
                            outcome="submit:" + type(ex).__name__,
                            message=str(ex)[:300],
                        )
                time.sleep(0.004)  # ~250 requests/s at most: the slots last until well after the fault
                ok = sum(1 for r in records if r.get("outcome") == "ok")
                if not marked and ok >= 32:
                    (sync / "streaming").touch()
                    marked = True
                if t_down is None and (sync / "link_down").exists():
                    t_down = float((sync / "link_down").read_text())
                if t_down is not None and time.monotonic() > t_down + tt + 2.0:
                    break  # kept streaming well past one transfer timeout with the NIC down
            check(marked, "stream never got going")
            check(t_down is not None, f"driver never took the link down ({len(records)} requests)")
            # Every request settles: no hang. Requests run out after the transfer timeout.
            settle_deadline = time.monotonic() + tt + 5.0
            while any("outcome" not in r for r in records) and time.monotonic() < settle_deadline:
                time.sleep(0.01)
            unsettled = [r["i"] for r in records if "outcome" not in r]
            check(not unsettled, f"requests never completed: {unsettled[:20]} (of {len(records)})")
            outcomes: dict[str, int] = {}
            for r in records:
                outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
            failed = [r for r in records if r["outcome"] != "ok"]
            bad_kinds = {r["outcome"] for r in failed} - {"TransferError", "FabricTimeoutError", "PeerFencedError"}
            check(
                not bad_kinds,
                f"unexpected failure kinds {bad_kinds}: {[r.get('message') for r in failed][:3]}",
            )
            check(failed, "no request failed although a NIC of the receiver went down mid-stream")
            latency = [r["t_done"] - r["t_submit"] for r in failed]
            after_down_ok = [r for r in records if r["outcome"] == "ok" and r["t_submit"] > t_down + 0.5]
            out.update(
                submitted=len(records),
                outcomes=outcomes,
                ok_ids=[r["i"] for r in records if r["outcome"] == "ok"],
                fail_latency_max=round(max(latency), 3),
                fail_latency_min=round(min(latency), 3),
                first_failure_after_down=round(min(r["t_done"] for r in failed) - t_down, 3),
                last_ok_after_down=round(
                    max(r["t_done"] for r in records if r["outcome"] == "ok") - t_down, 3
                ),
                ok_submitted_after_down=len(after_down_ok),
                messages=sorted({r["message"] for r in failed})[:4],
            )
            check(max(latency) <= tt + 3.0, f"a failed request took {max(latency):.2f}s (timeout {tt}s)")
            out["unregister_while_down"] = try_unregister(e, stream_src)
            # The timeouts fenced the receiver; the application knows what it lost and lifts it.
            out["was_fenced"] = e.readmit_peer(peers[1].address)
            # Writes pinned to the NIC that is still up work (with the other one still down).
            t = time.monotonic()
            pins = [
                e.submit_write(
                    src,
                    peers[1].descriptors[1],
                    1 << 20,
                    src_offset=(1 << 20) * j + j,
                    dst_offset=(1 << 20) * j,
                    imm=11,
                    domain=0,
                )
                for j in range(4)
            ]
            for f in pins:
                f.result(timeout=tt + 5.0)
            out["pinned_s"] = round(time.monotonic() - t, 3)
        dist.barrier()  # stream settled, pinned writes done
        if ctx.rank == 1:
            expect_exact(pinned_c, 4, "pinned writes with the other NIC down")
            expected = torch.cat([src_buf[(1 << 20) * j + j : (1 << 20) * (j + 1) + j] for j in range(4)])
            check_bytes(other_dst[: 4 << 20], expected, "pinned writes with the other NIC down")
            other_dst.zero_()
            out["imms_before_restore"] = len(arrivals)
        dist.barrier()
        if ctx.rank == 0:
            (sync / "pinned_done").touch()
            # Recovery (reported): once the driver brought the link back, sharded writes again.
            out["restore_attempts"] = []
            if wait_file(sync / "link_up", 30):
                t = time.monotonic()
                for _ in range(4):
                    try:
                        e.submit_write(src, peers[1].descriptors[1], 2 << 20, imm=12).result(timeout=tt + 5.0)
                        out["restore_attempts"].append("ok")
                        break
                    except fabric_lib.FabricError as ex:
                        out["restore_attempts"].append(f"{type(ex).__name__}: {str(ex)[:120]}")
                out["restore_s"] = round(time.monotonic() - t, 3)
            # The timed-out operations still hold the stream's source registration until their
            # provider completions arrive (after the link is back, if ever); report when it frees.
            if out["unregister_while_down"] != "ok":
                t = time.monotonic()
                while (res := try_unregister(e, stream_src)) != "ok" and time.monotonic() - t < 10:
                    time.sleep(0.1)
                out["unregister_after_restore"] = res
                out["unregister_after_restore_s"] = round(time.monotonic() - t, 3)
        gathered: list = [None] * ctx.world
        dist.all_gather_object(gathered, out)
        if ctx.rank == 1:
            sent = gathered[0]
            ok_ids = set(sent["ok_ids"])
            if sent["restore_attempts"][-1:] == ["ok"]:
                expect_exact(after_c, 1, "sharded write after the link came back")
                check_bytes(
                    other_dst[: 2 << 20], src_buf[: 2 << 20], "sharded write after the link came back"
                )
            # Every successful request's immediate arrives (those stuck behind the dead link once
            # it is back), exactly once, and never before its data; no others but failed ones.
            deadline = time.monotonic() + 15
            while not ok_ids <= set(arrivals) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)
            arrived = dict(arrivals)
            missing = sorted(ok_ids - set(arrived))
            check(not missing, f"immediates of successful requests never arrived: {missing}")
            dup = {i: len(v) for i, v in arrived.items() if len(v) != 1}
            check(not dup, f"immediates arrived more than once: {dup}")
            early = sorted(i for i, v in arrived.items() if not all(v))
            check(not early, f"immediates arrived before their data: {early}")
            unknown = sorted(set(arrived) - set(range(sent["submitted"])))
            check(not unknown and not strays, f"immediates of requests never made: {unknown} {strays}")
            out.update(
                imms_arrived=len(arrived),
                imms_of_failed_requests=sorted(set(arrived) - ok_ids),
                failed_slots_bytes=late_bytes(
                    stream_dst, src_buf, sorted(set(range(sent["submitted"])) - ok_ids), slot_src
                ),
            )
        dist.barrier()
        out["stop_s"] = round(ctx.close(), 3)
        out.pop("ok_ids", None)
        result(**out)
    except BaseException:  # noqa: BLE001 - any failure: print it and exit non-zero
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", choices=["correctness", "mismatch", "fault"])
    p.add_argument("--examples", type=int, default=12, help="hypothesis examples of the paged property")
    p.add_argument("--shard-min-bytes", type=int, default=0)
    p.add_argument("--traffic-bytes", type=int, default=32 << 20)
    p.add_argument("--single-nic-rank", type=int, default=1)
    p.add_argument("--sync-dir")
    p.add_argument("--transfer-timeout", type=float, default=3.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    {"correctness": scenario_correctness, "mismatch": scenario_mismatch, "fault": scenario_fault}[
        args.scenario
    ](args)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
