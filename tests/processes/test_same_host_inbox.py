"""Same-host immediates through the receiver's shared-memory inbox, between OS processes.

Writers run with ``same_host_host_memory=True``: host writes to a receiver of this host go
through ``process_vm_writev`` and their immediates (and ``submit_imm``) into the receiver's
inbox, with nothing posted on a domain (``domain_stats`` says which path was taken). Checked:

- exact counts and bytes under concurrency: three writer processes, a thousand writes each per
  example (hypothesis over sizes and immediates), immediate-only requests mixed in;
- back-pressure: a stopped receiver's full ring holds writers back (nothing fails or is
  dropped while the transfer timeout allows) and times them out (typed) past it;
- the epoch filter: after a re-admission an entry of the writer's ended epoch is dropped;
- a writer killed mid-stream costs nothing to the other writers or the receiver;
- garbage written into the inbox is refused and counted, never crashes or miscounts;
- fallback: a receiver without an inbox gets the immediates over the provider.

``RawInbox`` plays a hostile (or curious) same-host process: it maps the inbox the way a writer
does and reads or forges slots (layout: ``provider/same_host/inbox.rs``).
"""

from __future__ import annotations

import mmap
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import fabric_lib
import numpy as np
import pytest
from fabric_lib.errors import FabricTimeoutError, PeerFencedError
from fabric_lib.testing import RankError, gather
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .peer import Peer, PeerState, WriteOp, check_plan, fill, imm_value, peers, sigstop, wait_imms, write_plan

WRITERS = 3
OPS_PER_WRITER = 1000
MAX_WRITE = 4096
SRC_SIZE = 1 << 20
DST_SIZE = WRITERS * OPS_PER_WRITER * MAX_WRITE
SRC_SEEDS = {w: 3001 + w for w in range(WRITERS)}
INIT_SEED = 77
WRITER_OPTIONS: dict[str, Any] = {"same_host_host_memory": True, "transfer_timeout": 30.0}
CONTROL_TAG = 2**32 - 1


class RawInbox:
    """An engine's inbox mapped from this process (needs the same access a writer needs)."""

    HEADER_WORDS = 16  # 128 bytes: magic, nonce, slots | tail
    TAIL = 8

    def __init__(self, address: fabric_lib.EngineAddress) -> None:
        inbox = address.same_host_inbox
        assert inbox is not None, "the engine announces no inbox"
        pid, fd, nonce, self.slots = inbox
        self._fd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        self._map = mmap.mmap(self._fd, 128 + 16 * self.slots)
        self.words = np.frombuffer(self._map, dtype=np.uint64)
        assert int(self.words[1]) == nonce

    def close(self) -> None:
        del self.words
        self._map.close()
        os.close(self._fd)

    def tail(self) -> int:
        return int(self.words[self.TAIL])

    def _index(self, position: int) -> int:
        return self.HEADER_WORDS + 2 * (position % self.slots)

    def entry(self, position: int) -> tuple[int, int, int]:
        """(sequence, tag, imm) of the slot of ``position``."""
        i = self._index(position)
        low, seq = int(self.words[i]), int(self.words[i + 1])
        return seq, low >> 32, low & 0xFFFFFFFF

    def forge(self, seq: int | None, tag: int, imm: int) -> None:
        """Writes an entry at the tail (``seq`` None: a well-formed one) and moves the tail on.
        The low word first: the owner never sees a half-written well-formed entry."""
        position = self.tail()
        i = self._index(position)
        self.words[i] = np.uint64((tag << 32) | imm)
        self.words[i + 1] = np.uint64(position + 1 if seq is None else seq)
        self.words[self.TAIL] = np.uint64(position + 1)


def _posted(engine: fabric_lib.TransferEngine) -> int:
    return sum(ops for ops, _ in engine.domain_stats())


# -- run in peers -------------------------------------------------------------------------------
def posted_ops(state: PeerState) -> int:
    return _posted(state.engine)


def count_of(state: PeerState, imm: int) -> int:
    """Arrivals of ``imm`` counted and not yet consumed."""
    return imm_value(state.engine, imm)


def refused_immediates(state: PeerState) -> int:
    return int(state.engine.refused_immediates)


def stale_immediates(state: PeerState) -> int:
    return int(state.engine.stale_immediates)


def imm_flood(state: PeerState, peer: bytes, imm: int, count: int, timeout: float = 60.0) -> int:
    """``count`` ``submit_imm`` to an EngineAddress at once; the number that succeeded."""
    address = fabric_lib.EngineAddress.from_bytes(peer)
    futures = [state.engine.submit_imm(imm, address) for _ in range(count)]
    deadline = time.monotonic() + timeout
    ok = 0
    for f in futures:
        f.result(timeout=max(0.0, deadline - time.monotonic()))
        ok += 1
    return ok


def imm_stream(state: PeerState, peer: bytes, imm: int, count: int, window: int = 64) -> int:
    """``count`` ``submit_imm`` to an EngineAddress with at most ``window`` in flight; the number that succeeded."""
    address = fabric_lib.EngineAddress.from_bytes(peer)
    slots = threading.Semaphore(window)
    done = 0
    lock = threading.Lock()

    def finished(_: Future[None]) -> None:
        nonlocal done
        with lock:
            done += 1
        slots.release()

    for _ in range(count):
        assert slots.acquire(timeout=30)
        state.engine.submit_imm(imm, address).add_done_callback(finished)
    for _ in range(window):
        assert slots.acquire(timeout=30)
    return done


# -- 1. concurrency: every byte, every count, exactly once ------------------------------------
@pytest.fixture(scope="module")
def group() -> Iterator[list[Peer]]:
    """Three writers and a receiver (tcp), alive for the module."""
    names = [f"tx{w}" for w in range(WRITERS)] + ["rx"]
    with peers(
        "tcp", names, buf_size=[SRC_SIZE] * WRITERS + [DST_SIZE], engine_kwargs=WRITER_OPTIONS
    ) as all_peers:
        gather([all_peers[w].submit(fill, seed=SRC_SEEDS[w]) for w in range(WRITERS)])
        yield all_peers


@st.composite
def plans(draw: st.DrawFn) -> tuple[list[int], list[WriteOp]]:
    """Each writer's ``OPS_PER_WRITER`` ops: lengths cycle through a drawn list (None:
    ``submit_imm``), immediates through a drawn set shared by every writer; every op owns its
    destination range."""
    lengths = draw(st.lists(st.one_of(st.none(), st.integers(0, MAX_WRITE)), min_size=1, max_size=8))
    imms = draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=3, unique=True))
    src_shift = draw(st.integers(0, SRC_SIZE - MAX_WRITE))
    ops: list[WriteOp] = []
    for w in range(WRITERS):
        for k in range(OPS_PER_WRITER):
            length = lengths[k % len(lengths)]
            dst = (w * OPS_PER_WRITER + k) * MAX_WRITE
            ops.append((w, src_shift, dst, length, imms[(k + w) % len(imms)]))
    return imms, ops


@pytest.mark.timeout(600)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
@given(plan=plans())
def test_concurrent_same_host_writes_count_exactly_once(
    group: list[Peer], plan: tuple[list[int], list[WriteOp]]
) -> None:
    *writers, rx = group
    imms, ops = plan
    rx.call(fill, seed=INIT_SEED)
    results = gather(
        [w.submit(write_plan, dst=rx.descriptor, ops=ops, sender=i) for i, w in enumerate(writers)]
        + [rx.submit(check_plan, ops=ops, init_seed=INIT_SEED, src_seeds=SRC_SEEDS, src_size=SRC_SIZE)],
        timeout=300,
    )
    check = results[-1]
    assert check["mismatch"] is None, f"bytes differ: {check['mismatch']}"
    assert all(v == 0 for v in check["leftover"].values()), f"extra immediates: {check['leftover']}"
    assert [w.call(posted_ops) for w in writers] == [0] * WRITERS, "the provider was used"
    assert rx.call(refused_immediates) == 0


# -- 2. back-pressure, the epoch filter, garbage ----------------------------------------------
@pytest.fixture
def small_inbox() -> Iterator[Peer]:
    """A receiver whose inbox holds 8 entries."""
    with peers("tcp", ["rx"], engine_kwargs={"same_host_inbox_slots": 8}) as (rx,):
        yield rx


@pytest.mark.timeout(120)
def test_full_ring_holds_writers_back_and_drops_nothing(small_inbox: Peer) -> None:
    rx = small_inbox
    peer = fabric_lib.EngineAddress.from_bytes(rx.address)
    with fabric_lib.TransferEngine("tcp", poll_mode="adaptive", **WRITER_OPTIONS) as e:
        e.submit_imm(1, peer).result(timeout=10)
        assert rx.call(wait_imms, {1: 1}) == {1: 0}  # the ring is empty
        sigstop(rx.pid)
        try:
            futures = [e.submit_imm(2, peer) for _ in range(200)]
            deadline = time.monotonic() + 10
            while sum(f.done() for f in futures) < 8 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.5)  # room for more, were the ring not full
            done = [f for f in futures if f.done()]
            assert len(done) == 8, "exactly a ring's worth is in before the receiver drains it"
            assert all(f.exception() is None for f in done)
        finally:
            os.kill(rx.pid, signal.SIGCONT)
        for f in futures:
            f.result(timeout=30)
        assert rx.call(wait_imms, {2: 200}, settle=0.2) == {2: 0}
        assert _posted(e) == 0


@pytest.mark.timeout(120)
def test_epoch_filter_drops_same_host_immediates_of_an_ended_epoch(small_inbox: Peer) -> None:
    """The ring fills while the receiver is stopped; the rest time out (typed) and fence it.
    Re-admission reports the 8 in the ring as counted; an entry forged with the ended epoch's
    tag afterwards is dropped as stale; new requests carry the new tag and count."""
    rx = small_inbox
    peer = fabric_lib.EngineAddress.from_bytes(rx.address)
    raw = RawInbox(peer)
    options: dict[str, Any] = {**WRITER_OPTIONS, "transfer_timeout": 1.5}
    try:
        with fabric_lib.TransferEngine("tcp", poll_mode="adaptive", **options) as e:
            e.submit_imm(5, peer).result(timeout=10)  # connects; one of the old epoch
            assert rx.call(wait_imms, {5: 1}) == {5: 0}
            sigstop(rx.pid)
            try:
                start = raw.tail()
                futures = [e.submit_imm(6, peer) for _ in range(20)]
                outcomes = []
                for f in futures:
                    try:
                        f.result(timeout=30)
                        outcomes.append("ok")
                    except (FabricTimeoutError, PeerFencedError):
                        outcomes.append("timeout")
                assert outcomes == ["ok"] * 8 + ["timeout"] * 12, outcomes
                seq, old_tag, imm = raw.entry(start)
                assert (seq, imm) == (start + 1, 6) and old_tag not in (0, CONTROL_TAG)
                with pytest.raises(PeerFencedError):
                    e.submit_imm(6, peer).result(timeout=10)
            finally:
                os.kill(rx.pid, signal.SIGCONT)
            readmission = e.readmit_peer(peer)
            assert readmission.fenced and readmission.counted == {5: 1, 6: 8}
            raw.forge(None, old_tag, 6)  # a late entry of the ended epoch
            e.submit_imm(7, peer).result(timeout=10)
            assert rx.call(wait_imms, {6: 8, 7: 1}, settle=0.3) == {6: 0, 7: 0}
            assert rx.call(stale_immediates) == 1
    finally:
        raw.close()


@pytest.mark.timeout(120)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    garbage=st.lists(
        st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
        min_size=1,
        max_size=4,
    )
)
def test_garbage_in_the_inbox_is_refused_and_counts_stay_exact(
    garbage_group: tuple[Peer, RawInbox], garbage: list[tuple[int, int, int]]
) -> None:
    """Forged slots at the head: a wild sequence or an impossible tag is refused and counted; a
    well-formed forgery is indistinguishable from a write (counted under its own value, never
    under the writers'); the writers' own immediates stay exact either way."""
    rx, raw = garbage_group
    peer = rx.address
    before = rx.call(refused_immediates)
    expect_refused = 0
    forged_counts: dict[int, int] = {}
    for seq, tag, imm in garbage:
        position = raw.tail()
        if seq == position:
            # A "free" sequence at the head stalls the ring (writers then time out, see the
            # module doc of inbox.rs): a denial of service the inbox does not try to prevent.
            seq += 2
        well_formed = seq == position + 1
        imm |= 1 << 31  # forged values never collide with the writers' (below 2^31)
        raw.forge(seq, tag, imm)
        if well_formed and tag not in (0, CONTROL_TAG):
            forged_counts[imm] = forged_counts.get(imm, 0) + 1
        else:
            expect_refused += 1
    assert rx.call(count_of, 11) == 0
    with fabric_lib.TransferEngine("tcp", poll_mode="adaptive", **WRITER_OPTIONS) as e:
        address = fabric_lib.EngineAddress.from_bytes(peer)
        for f in [e.submit_imm(11, address) for _ in range(50)]:
            f.result(timeout=10)
    assert rx.call(wait_imms, {11: 50, **forged_counts}, settle=0.1) == dict.fromkeys({11, *forged_counts}, 0)
    assert rx.call(refused_immediates) - before == expect_refused


@pytest.fixture(scope="module")
def garbage_group() -> Iterator[tuple[Peer, RawInbox]]:
    with peers("tcp", ["rx"], engine_kwargs={"same_host_inbox_slots": 16}) as (rx,):
        raw = RawInbox(fabric_lib.EngineAddress.from_bytes(rx.address))
        try:
            yield rx, raw
        finally:
            raw.close()


def test_explicit_garbage_entries_are_refused(garbage_group: tuple[Peer, RawInbox]) -> None:
    rx, raw = garbage_group
    before = rx.call(refused_immediates)
    raw.forge(12345, 9, 9)  # a sequence no writer produces
    raw.forge(None, 0, 9)  # tag 0 is never drawn
    raw.forge(None, CONTROL_TAG, 9)  # nor the control tag
    deadline = time.monotonic() + 10
    while rx.call(refused_immediates) - before < 3:
        assert time.monotonic() < deadline, "the receiver did not refuse the garbage"
        time.sleep(0.01)
    assert rx.call(refused_immediates) - before == 3
    assert rx.call(count_of, 9) == 0


# -- 3. a killed writer -------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_a_killed_writer_costs_the_others_nothing() -> None:
    with peers("tcp", ["victim", "survivor", "rx"], engine_kwargs=WRITER_OPTIONS) as (victim, survivor, rx):
        killed = victim.submit(imm_stream, peer=rx.address, imm=21, count=10**7)
        alive = survivor.submit(imm_stream, peer=rx.address, imm=22, count=20_000)
        # Killed mid-stream: once its immediates arrive (a loaded machine may take a while to
        # start the writer's process), not after a fixed delay.
        deadline = time.monotonic() + 60
        while rx.call(count_of, 21) == 0:
            assert time.monotonic() < deadline, "the victim never started writing"
            time.sleep(0.05)
        victim.kill()
        assert alive.result(timeout=120) == 20_000
        with pytest.raises(RankError):
            killed.result(timeout=10)
        assert rx.call(wait_imms, {22: 20_000}, settle=0.3) == {22: 0}
        assert rx.call(count_of, 21) > 0, "the victim was writing when it died"
        assert survivor.call(imm_flood, peer=rx.address, imm=23, count=100) == 100
        assert rx.call(wait_imms, {23: 100}) == {23: 0}
        assert rx.call(refused_immediates) == 0
        assert survivor.call(posted_ops) == 0


@pytest.mark.timeout(120)
def test_immediates_to_a_killed_receiver_fail_instead_of_landing_in_its_orphaned_inbox() -> None:
    """The writer's mapping keeps a dead receiver's inbox alive, so a push alone would succeed:
    the writer checks the owner process first and fails the request (typed), every time."""
    with peers("tcp", ["rx"]) as (rx,):
        peer = fabric_lib.EngineAddress.from_bytes(rx.address)
        with fabric_lib.TransferEngine("tcp", poll_mode="adaptive", **WRITER_OPTIONS) as e:
            for f in [e.submit_imm(51, peer) for _ in range(10)]:
                f.result(timeout=30)  # the inbox is mapped and used
            assert rx.call(wait_imms, {51: 10}) == {51: 0}
            rx.kill()
            assert rx.join(10) is not None, "the receiver is gone"
            for _ in range(3):
                with pytest.raises(fabric_lib.errors.TransferError, match="exited"):
                    e.submit_imm(52, peer).result(timeout=30)
            assert _posted(e) == 0, "nothing went over the provider"


# -- 4. fallback --------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_receiver_without_inbox_gets_immediates_over_the_provider() -> None:
    with peers("tcp", ["rx"], engine_kwargs={"same_host_inbox_slots": 0}) as (rx,):
        peer = fabric_lib.EngineAddress.from_bytes(rx.address)
        dst = fabric_lib.MrDescriptor.from_bytes(rx.descriptor)
        assert peer.same_host_inbox is None
        with fabric_lib.TransferEngine("tcp", poll_mode="adaptive", **WRITER_OPTIONS) as e:
            src = np.arange(4096, dtype=np.uint8)
            region = e.register_memory(src.ctypes.data, src.nbytes, src)
            futures = [e.submit_write(region, dst, 4096, imm=31) for _ in range(100)]
            futures += [e.submit_imm(32, peer) for _ in range(100)]
            for f in futures:
                f.result(timeout=30)
            assert rx.call(wait_imms, {31: 100, 32: 100}) == {31: 0, 32: 0}
            assert _posted(e) == 200, "each immediate is one zero-byte write over the provider"


@pytest.mark.timeout(60)
def test_without_the_option_host_writes_take_the_provider(small_inbox: Peer) -> None:
    rx = small_inbox
    peer = fabric_lib.EngineAddress.from_bytes(rx.address)
    with fabric_lib.TransferEngine("tcp", poll_mode="adaptive") as e:
        for f in [e.submit_imm(41, peer) for _ in range(20)]:
            f.result(timeout=30)
        assert rx.call(wait_imms, {41: 20}) == {41: 0}
        assert _posted(e) == 20


@pytest.mark.parametrize("slots", [1, 3, 2**21, -1])
def test_bad_inbox_sizes_are_typed_errors(slots: int) -> None:
    with pytest.raises(fabric_lib.errors.InvalidArgumentError):
        fabric_lib.TransferEngine("tcp", same_host_inbox_slots=slots)


def test_inbox_is_announced_and_travels_with_the_address() -> None:
    with fabric_lib.TransferEngine("tcp", poll_mode="adaptive", same_host_inbox_slots=64) as e:
        inbox = e.main_address.same_host_inbox
        assert inbox is not None and inbox[0] == os.getpid() and inbox[3] == 64
        again = fabric_lib.EngineAddress.from_bytes(e.main_address.to_bytes())
        assert again.same_host_inbox == inbox
