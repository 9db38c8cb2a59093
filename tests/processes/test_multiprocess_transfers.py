"""Transfers between separate OS processes over each loopback provider.

Per provider, three long-lived peer processes (two senders, one receiver; see ``peer``) are
started once and driven by:

- a hypothesis property test: random batches of writes (0 B .. 1 MiB, unaligned offsets, random
  32-bit immediates shared by several writes and by both senders, imm-only requests) where the
  receiver checks every byte of its buffer against the one it rebuilds from the plan and the
  seeds, and every imm count exactly (no missing, no extra arrivals);
- 100k small writes with immediates under a bounded window: exact counts, final bytes, and
  stable RSS in both processes;
- two-sided messages of random sizes up to ``max_message_size`` from both senders, all received
  intact (as a multiset: order is not assumed).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from fabric_lib.testing import RankError, gather
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from providers import provider_params

from .peer import (
    Peer,
    PeerState,
    WriteOp,
    cached_pattern,
    check_plan,
    digest,
    fill,
    peers,
    wait_imms,
    write_plan,
)

SRC_SIZE = 2 << 20  # each sender's buffer
DST_SIZE = 16 << 20  # the receiver's buffer
MAX_WRITE = 1 << 20
MAX_OPS = 12  # 12 * (1 MiB + gap) < DST_SIZE
SRC_SEEDS = {0: 1001, 1: 1002}
INIT_SEED = 2024
MAX_MESSAGE = 65536
MiB = 1 << 20


@pytest.fixture(scope="module", params=provider_params())
def trio(request: pytest.FixtureRequest) -> Iterator[tuple[Peer, Peer, Peer]]:
    """Two senders and a receiver on one provider, alive for the whole module."""
    with peers(
        request.param,
        ["tx0", "tx1", "rx"],
        buf_size=[SRC_SIZE, SRC_SIZE, DST_SIZE],
        engine_kwargs={"transfer_timeout": 30.0, "max_message_size": MAX_MESSAGE},
    ) as (tx0, tx1, rx):
        gather([tx0.submit(fill, seed=SRC_SEEDS[0]), tx1.submit(fill, seed=SRC_SEEDS[1])])
        yield tx0, tx1, rx


# -- run in the peers ---------------------------------------------------------------------------
def rss_bytes() -> int:
    """This process's resident set size (VmRSS from /proc/self/status), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def rss(state: PeerState) -> int:
    return rss_bytes()


def clear_imms(state: PeerState, imms: Sequence[int]) -> dict[int, int]:
    """Forgets the counters of ``imms``; returns the counts that were still there (stale ones)."""
    stale = {}
    for imm in imms:
        n = state.engine.remove_imm_count(imm)
        if n:
            stale[imm] = n
    return stale


def check_bytes(
    state: PeerState,
    offset: int,
    length: int,
    seed: int | None,
    seed_size: int = 0,
    src_offset: int = 0,
    value: int = 0,
) -> int:
    """Number of bytes of ``buf[offset:offset+length]`` that differ from
    ``pattern(seed, seed_size)[src_offset:...]`` (or from ``value`` when seed is None)."""
    got = state.buf[offset : offset + length]
    if seed is None:
        return int(np.count_nonzero(got != value))
    want = cached_pattern(seed, seed_size)[src_offset : src_offset + length]
    return int(np.count_nonzero(got != want))


def flood(
    state: PeerState,
    dst: bytes,
    count: int,
    size: int = 64,
    slots: int = 4096,
    imms: Sequence[int] = (1,),
    max_inflight: int = 512,
    timeout: float = 120.0,
) -> dict[str, Any]:
    """``count`` writes of ``size`` bytes with imm ``imms[i % len(imms)]``: write i copies slot
    ``i % slots`` of this buffer to the same slot of ``dst`` (so the final bytes are defined even
    though writes are unordered). At most ``max_inflight`` requests are outstanding; completions
    arrive through on_done callbacks. Returns errors and timings."""
    from fabric_lib import MrDescriptor

    engine, region = state.engine, state.region
    desc = MrDescriptor.from_bytes(dst)
    window = threading.Semaphore(max_inflight)
    lock = threading.Lock()
    done = threading.Event()
    stats: dict[str, Any] = {"ok": 0, "errors": 0, "first_error": None}

    def on_done(err: BaseException | None) -> None:
        with lock:
            if err is None:
                stats["ok"] += 1
            else:
                stats["errors"] += 1
                stats["first_error"] = stats["first_error"] or repr(err)
            if stats["ok"] + stats["errors"] == count:
                done.set()
        window.release()

    deadline = time.monotonic() + timeout
    t0 = time.monotonic()
    nimm = len(imms)
    for i in range(count):
        if not window.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"flood: window still full after {timeout}s at write {i}")
        off = (i % slots) * size
        engine.submit_write(
            region, desc, size, src_offset=off, dst_offset=off, imm=imms[i % nimm], on_done=on_done
        )
    if not done.wait(max(0.0, deadline - time.monotonic())):
        raise TimeoutError(f"flood: only {stats['ok'] + stats['errors']} of {count} completed in {timeout}s")
    return {**stats, "elapsed": time.monotonic() - t0, "rss": rss_bytes()}


def message_bytes(seed: int, sender: int, index: int, size: int) -> bytes:
    """The deterministic payload of message ``index`` of ``sender``."""
    return random.Random(seed * 1_000_003 + sender * 10_007 + index).randbytes(size)


def message_sizes(seed: int, sender: int, count: int, max_size: int) -> list[int]:
    """Random sizes in [0, max_size], always including the edges 0, 1 and max_size."""
    rng = random.Random(seed * 7 + sender)
    edges = [0, 1, max_size, max_size - 1]
    sizes = []
    for i in range(count):
        if i < len(edges):
            sizes.append(edges[i])
        else:
            r = rng.random()
            sizes.append(rng.randint(0, 256) if r < 0.3 else rng.randint(0, max_size))
    return sizes


def send_messages(
    state: PeerState,
    peer: bytes,
    seed: int,
    sender: int,
    count: int,
    max_size: int,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """Sends ``count`` messages of random sizes (deterministic from the seed) to ``peer``."""
    engine = state.engine
    futures = []
    for i, size in enumerate(message_sizes(seed, sender, count, max_size)):
        futures.append(engine.submit_send(peer, message_bytes(seed, sender, i, size)))
    deadline = time.monotonic() + timeout
    for f in futures:
        f.result(timeout=max(0.0, deadline - time.monotonic()))
    return {"sent": len(futures)}


def collect_messages(
    state: PeerState,
    seed: int,
    counts: dict[int, int],
    max_size: int,
    timeout: float = 60.0,
    settle: float = 0.1,
) -> dict[str, Any]:
    """Waits for every message of every sender, then compares the multiset of payloads (order is
    not assumed) with the one rebuilt from the seed. Clears the received list."""
    total = sum(counts.values())
    deadline = time.monotonic() + timeout
    with state.msg_lock:
        while len(state.messages) < total:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            state.msg_lock.wait(left)
    time.sleep(settle)
    with state.msg_lock:
        got = Counter(state.messages)
        received = len(state.messages)
        state.messages = []
    want: Counter[bytes] = Counter()
    for sender, count in counts.items():
        for i, size in enumerate(message_sizes(seed, sender, count, max_size)):
            want[digest(message_bytes(seed, sender, i, size))] += 1
    return {
        "received": received,
        "expected": total,
        "missing": sum((want - got).values()),
        "unexpected": sum((got - want).values()),
    }


def send_raw(state: PeerState, peer: bytes, size: int, timeout: float = 30.0) -> None:
    """Sends one message of ``size`` bytes (0xAB) and waits for its completion."""
    state.engine.submit_send(peer, b"\xab" * size).result(timeout=timeout)


def take_messages(state: PeerState, count: int, timeout: float = 30.0) -> list[bytes]:
    """Waits (bounded) for ``count`` received messages; returns and clears their digests."""
    deadline = time.monotonic() + timeout
    with state.msg_lock:
        while len(state.messages) < count and time.monotonic() < deadline:
            state.msg_lock.wait(max(0.0, deadline - time.monotonic()))
        got, state.messages = state.messages, []
    return got


# -- 1. property test: random write batches, every byte and every count ------------------------
sizes = st.one_of(
    st.just(0),
    st.integers(1, 64),
    st.integers(65, 64 << 10),
    st.integers((64 << 10) + 1, MAX_WRITE),
)


@st.composite
def write_plans(draw: st.DrawFn) -> tuple[list[int], list[WriteOp]]:
    """(imms, ops): ops are (sender, src_offset, dst_offset, length|None, imm) in submission
    order; destination ranges never overlap (overlapping writes are unordered, so their result
    would be undefined), sources may."""
    imms = draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=4, unique=True))
    n = draw(st.integers(1, MAX_OPS))
    laid_out: list[WriteOp] = []
    cursor = 0
    for _ in range(n):
        sender = draw(st.integers(0, 1))
        imm = draw(st.sampled_from(imms))
        if draw(st.integers(0, 9)) == 0:
            laid_out.append((sender, 0, 0, None, imm))  # imm only
            continue
        length = draw(sizes)
        src_off = draw(st.integers(0, SRC_SIZE - length))
        dst_off = cursor + draw(st.integers(0, 4095))
        laid_out.append((sender, src_off, dst_off, length, imm))
        cursor = dst_off + length
    if draw(st.booleans()):  # push the layout against the end of the region
        shift = DST_SIZE - cursor
        laid_out = [(s, so, do + shift if ln is not None else 0, ln, i) for s, so, do, ln, i in laid_out]
    order = draw(st.permutations(range(len(laid_out))))
    return imms, [laid_out[i] for i in order]


_last_imms: dict[str, list[int]] = {}


@pytest.mark.timeout(300)
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
@given(plan=write_plans())
def test_random_write_batches_land_exactly(
    trio: tuple[Peer, Peer, Peer], plan: tuple[list[int], list[WriteOp]]
) -> None:
    tx0, tx1, rx = trio
    imms, ops = plan
    assert all(op[3] is None or op[2] + op[3] <= DST_SIZE for op in ops)
    # Nothing may have arrived since the previous example was checked (late duplicates).
    stale = rx.call(clear_imms, imms=sorted(set(_last_imms.pop(rx.provider, [])) | set(imms)))
    assert stale == {}, f"immediates arrived after their example was checked: {stale}"
    rx.call(fill, seed=INIT_SEED)
    results = gather(
        [
            tx0.submit(write_plan, dst=rx.descriptor, ops=ops, sender=0),
            tx1.submit(write_plan, dst=rx.descriptor, ops=ops, sender=1),
            rx.submit(
                check_plan, ops=ops, init_seed=INIT_SEED, src_seeds=SRC_SEEDS, src_size=SRC_SIZE, timeout=30.0
            ),
        ],
        timeout=90,
    )
    check = results[2]
    assert check["mismatch"] is None, f"bytes differ: {check['mismatch']} (ops {ops})"
    assert all(v == 0 for v in check["leftover"].values()), f"extra immediates: {check['leftover']}"
    _last_imms[rx.provider] = imms


# -- 2. 100k small writes: exact counts, bytes, stable memory -----------------------------------
FLOOD_IMMS = list(range(0xF100, 0xF110))
FLOOD_SIZE = 64
FLOOD_SLOTS = 4096


def _flood(tx: Peer, rx: Peer, count: int) -> dict[str, Any]:
    per_imm = {
        imm: count // len(FLOOD_IMMS) + (1 if i < count % len(FLOOD_IMMS) else 0)
        for i, imm in enumerate(FLOOD_IMMS)
    }
    sent, leftover = gather(
        [
            tx.submit(
                flood,
                dst=rx.descriptor,
                count=count,
                size=FLOOD_SIZE,
                slots=FLOOD_SLOTS,
                imms=FLOOD_IMMS,
                max_inflight=512,
                timeout=120.0,
            ),
            rx.submit(wait_imms, counts=per_imm, timeout=120.0, settle=0.2),
        ],
        timeout=150,
    )
    assert sent["errors"] == 0 and sent["ok"] == count, sent
    assert leftover == {imm: 0 for imm in FLOOD_IMMS}, f"extra immediates: {leftover}"
    return sent


@pytest.mark.timeout(240)
def test_100k_small_writes_exact_counts_and_stable_memory(trio: tuple[Peer, Peer, Peer]) -> None:
    tx0, _, rx = trio
    assert rx.call(clear_imms, imms=FLOOD_IMMS) == {}
    rx.call(fill, value=0)
    start_tx, start_rx = tx0.call(rss), rx.call(rss)
    _flood(tx0, rx, 10_000)  # warm-up: connections, buffers, allocator pools
    base_tx, base_rx = tx0.call(rss), rx.call(rss)
    sent = _flood(tx0, rx, 100_000)
    end_tx, end_rx = tx0.call(rss), rx.call(rss)
    span = FLOOD_SLOTS * FLOOD_SIZE
    assert rx.call(check_bytes, offset=0, length=span, seed=SRC_SEEDS[0], seed_size=SRC_SIZE) == 0
    assert rx.call(check_bytes, offset=span, length=MiB, seed=None, value=0) == 0
    growth = {"sender": (end_tx - base_tx) / MiB, "receiver": (end_rx - base_rx) / MiB}
    warmup = {"sender": (base_tx - start_tx) / MiB, "receiver": (base_rx - start_rx) / MiB}
    print(f"100k writes in {sent['elapsed']:.2f}s; RSS growth MiB: warm-up {warmup}, 100k {growth}")
    assert growth["sender"] < 50 and growth["receiver"] < 50, growth


# -- 3. two-sided messages ----------------------------------------------------------------------
@pytest.mark.timeout(180)
@pytest.mark.parametrize("seed", [7])
def test_messages_of_random_sizes_arrive_intact(trio: tuple[Peer, Peer, Peer], seed: int) -> None:
    tx0, tx1, rx = trio
    count = 400
    rx.call(take_messages, count=0, timeout=0)  # drain
    results = gather(
        [
            tx0.submit(
                send_messages, peer=rx.address, seed=seed, sender=0, count=count, max_size=MAX_MESSAGE
            ),
            tx1.submit(
                send_messages, peer=rx.address, seed=seed, sender=1, count=count, max_size=MAX_MESSAGE
            ),
            rx.submit(
                collect_messages, seed=seed, counts={0: count, 1: count}, max_size=MAX_MESSAGE, timeout=60.0
            ),
        ],
        timeout=120,
    )
    got = results[2]
    assert got == {"received": 2 * count, "expected": 2 * count, "missing": 0, "unexpected": 0}, got


@pytest.mark.timeout(120)
def test_message_size_limit_between_processes(trio: tuple[Peer, Peer, Peer]) -> None:
    tx0, _, rx = trio
    rx.call(take_messages, count=0, timeout=0)  # drain
    with pytest.raises(RankError, match="InvalidArgumentError"):
        tx0.call(send_raw, peer=rx.address, size=MAX_MESSAGE + 1)
    tx0.call(send_raw, peer=rx.address, size=MAX_MESSAGE)
    assert rx.call(take_messages, count=1) == [digest(b"\xab" * MAX_MESSAGE)]
