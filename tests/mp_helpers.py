"""Helpers for multi-process tests: long-lived peer processes, each owning one TransferEngine,
driven by commands over a multiprocessing Pipe.

A peer is started with the "spawn" context (no fork of a process holding libfabric state),
opens an engine with ``poll_mode="adaptive"`` (CI machines have 2 cores), registers one uint8
numpy buffer (``register_memory``; peers do not import torch, which keeps start-up fast and RSS
small) and reports ``address``/``descriptor`` bytes. The test then calls handlers by name
(``peer.call("fill", seed=1)``); each handler bounds every wait by a timeout and reports errors
back as ``PeerError`` with the child's traceback. Children die with the test process
(``PR_SET_PDEATHSIG``) and are killed in ``Peer.close`` if they do not exit in time.

Deterministic data: ``pattern(seed, n)`` gives the same bytes in every process, so a receiver
reconstructs the exact buffer it expects from the plan and the seeds alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import itertools
import multiprocessing as mp
import os
import random
import signal
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

CTX = mp.get_context("spawn")
DEFAULT_TIMEOUT = 60.0
# Child processes only wait this long for a command before assuming the test is gone.
IDLE_EXIT_S = 600.0

# A write in a plan: (sender, src_offset, dst_offset, length, imm); length None = submit_imm.
WriteOp = tuple[int, int, int, "int | None", int]


# -- small utilities (both sides) ---------------------------------------------------------------
def rss_bytes() -> int:
    """This process's resident set size (VmRSS from /proc/self/status), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def pattern(seed: int, n: int):
    """``n`` pseudo-random bytes (a uint8 numpy array), identical in every process for one seed."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


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


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def expected_imm_counts(ops: Sequence[WriteOp]) -> dict[int, int]:
    return dict(Counter(op[4] for op in ops))


LOOPBACK_PROVIDERS = ["tcp", "udp;ofi_rxd", "shm"]


def provider_available(name: str) -> bool:
    import fabric_lib

    prefix = name.split(";")[0]
    return any(p.split(";")[0] == prefix for p, _ in fabric_lib.list_providers())


def provider_params(names: Sequence[str] = LOOPBACK_PROVIDERS) -> list[Any]:
    """pytest params for providers, each skipped with a reason where libfabric lacks it."""
    import pytest

    return [
        pytest.param(
            n,
            id=n.replace(";", "-"),
            marks=pytest.mark.skipif(
                not provider_available(n), reason=f"libfabric provider {n!r} not available"
            ),
        )
        for n in names
    ]


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (no orphans after a crash)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


# -- the parent's handle on a peer process ------------------------------------------------------
class PeerError(RuntimeError):
    """A handler raised in the peer process, or the peer died / did not answer in time."""


class Peer:
    """A child process with one engine and one registered buffer, driven over a Pipe.

    The constructor starts the process and returns at once; ``wait_ready`` blocks (bounded)
    until its engine is open. Use ``peers(...)`` to start several at once and always close them.
    """

    def __init__(
        self,
        provider: str,
        *,
        name: str = "peer",
        buf_size: int = 1 << 20,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.provider = provider
        self.name = name
        self.buf_size = buf_size
        self.engine_kwargs = dict(engine_kwargs or {})
        self.address: bytes = b""
        self.descriptor: bytes = b""
        self.info: dict[str, Any] = {}
        self._conn, child_conn = CTX.Pipe()
        self.proc = CTX.Process(
            target=_serve,
            args=(child_conn, provider, buf_size, self.engine_kwargs),
            name=f"fabric-{name}",
            daemon=True,
        )
        self.proc.start()
        child_conn.close()
        self._pending: list[str] = []
        self.broken: str | None = None

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def wait_ready(self, timeout: float = DEFAULT_TIMEOUT) -> Peer:
        self._pending.append("<startup>")
        self.info = self.result(timeout)
        self.address = self.info["address"]
        self.descriptor = self.info["descriptor"]
        return self

    def submit(self, cmd: str, /, **kwargs: Any) -> None:
        """Sends a command without waiting; collect its answer with ``result``."""
        if self.broken:
            raise PeerError(f"{self.name}: unusable after an earlier failure ({self.broken})")
        self._pending.append(cmd)
        self._conn.send((cmd, kwargs))

    def result(self, timeout: float = DEFAULT_TIMEOUT) -> Any:
        """The answer to the oldest submitted command; raises PeerError on error or timeout."""
        cmd = self._pending.pop(0) if self._pending else "?"
        try:
            ready = self._conn.poll(timeout)
        except (EOFError, OSError) as e:
            raise PeerError(f"{self.name}: connection lost waiting for {cmd!r}: {e}") from None
        if not ready:
            # A late answer would be taken for the next command's: the peer is out of sync.
            self.broken = f"no answer to {cmd!r} within {timeout:.1f}s"
            raise PeerError(f"{self.name}: {self.broken}")
        try:
            status, payload = self._conn.recv()
        except (EOFError, OSError):
            self.proc.join(1)
            self.broken = "died"
            raise PeerError(f"{self.name}: died (exit code {self.proc.exitcode}) during {cmd!r}") from None
        if status != "ok":
            raise PeerError(f"{self.name}: {cmd!r} failed in the peer:\n{payload}")
        return payload

    def call(self, cmd: str, /, *, wait_s: float = DEFAULT_TIMEOUT, **kwargs: Any) -> Any:
        """Runs handler ``cmd(**kwargs)`` in the peer; waits at most ``wait_s`` for the answer
        (``kwargs`` may hold the handler's own ``timeout``)."""
        self.submit(cmd, **kwargs)
        return self.result(wait_s)

    def kill(self) -> None:
        """SIGKILL, then reap (bounded)."""
        if self.proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self, timeout: float = 20.0) -> float | None:
        """Asks the peer to stop its engine and exit; kills it if it is busy, broken, or does not
        exit within ``timeout``. Returns the seconds its ``engine.stop()`` took, else None."""
        stop_s = None
        try:
            if self.proc.is_alive() and not self.broken:
                # Answers still owed (after a failed test) come first; skip those already there.
                while self._pending and self._conn.poll(0):
                    self._conn.recv()
                    self._pending.pop(0)
                if not self._pending:
                    self.submit("exit")
                    stop_s = self.result(timeout)
                    self.proc.join(timeout)
        except (OSError, ValueError, EOFError, PeerError):
            stop_s = None
        finally:
            if self.proc.is_alive():
                self.kill()
                stop_s = None
            self.proc.join(5)
            self._conn.close()
        return stop_s


@contextlib.contextmanager
def peers(
    provider: str,
    names: Sequence[str],
    *,
    buf_size: int | Sequence[int] = 1 << 20,
    engine_kwargs: dict[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Iterator[list[Peer]]:
    """Starts one peer per name concurrently (``buf_size``: one size, or one per name), waits
    until all are ready, and always closes them."""
    sizes = [buf_size] * len(names) if isinstance(buf_size, int) else list(buf_size)
    started: list[Peer] = []
    try:
        for name, size in zip(names, sizes, strict=True):
            started.append(Peer(provider, name=name, buf_size=size, engine_kwargs=engine_kwargs))
        for p in started:
            p.wait_ready(timeout)
        yield started
    finally:
        for p in started:
            p.close()


def gather(calls: Sequence[tuple[Peer, str, dict[str, Any]]], timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
    """Submits every (peer, cmd, kwargs) first, then collects the answers in order."""
    for peer, cmd, kwargs in calls:
        peer.submit(cmd, **kwargs)
    deadline = time.monotonic() + timeout
    results, first_error = [], None
    for peer, _, _ in calls:
        try:
            results.append(peer.result(max(0.1, deadline - time.monotonic())))
        except PeerError as e:
            results.append(e)
            first_error = first_error or e
    if first_error is not None:
        raise first_error
    return results


# -- the child side ----------------------------------------------------------------------------
class PeerState:
    """What a peer process holds: its engine, buffer and region, plus received messages."""

    def __init__(self, engine: Any, buf: Any, region: Any) -> None:
        self.engine = engine
        self.buf = buf
        self.region = region
        self.extra: dict[str, Any] = {}
        self.msg_lock = threading.Condition()
        self.messages: list[bytes] = []  # digests of received messages

    def on_message(self, data: bytes) -> None:
        d = digest(data)
        with self.msg_lock:
            self.messages.append(d)
            self.msg_lock.notify_all()


HANDLERS: dict[str, Callable[..., Any]] = {}


def handler(fn: Callable[..., Any]) -> Callable[..., Any]:
    HANDLERS[fn.__name__] = fn
    return fn


def _serve(conn: Any, provider: str, buf_size: int, engine_kwargs: dict[str, Any]) -> None:
    _die_with_parent()
    try:
        import fabric_lib

        engine = fabric_lib.TransferEngine(provider, poll_mode="adaptive", **engine_kwargs)
        buf = np.zeros(buf_size, dtype=np.uint8)
        region = engine.register_memory(buf.ctypes.data, buf.nbytes, owner=buf)
        state = PeerState(engine, buf, region)
        engine.set_recv_callback(state.on_message)
        conn.send(
            (
                "ok",
                {
                    "address": engine.main_address.to_bytes(),
                    "descriptor": region.descriptor.to_bytes(),
                    "provider": engine.provider,
                    "pid": os.getpid(),
                },
            )
        )
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            if not conn.poll(IDLE_EXIT_S):
                break
            cmd, kwargs = conn.recv()
        except (EOFError, OSError):
            break
        if cmd == "exit":
            t0 = time.monotonic()
            engine.stop()
            with contextlib.suppress(OSError):
                conn.send(("ok", time.monotonic() - t0))
            return
        try:
            result = HANDLERS[cmd](state, **kwargs)
            reply = ("ok", result)
        except BaseException:  # noqa: BLE001 - reported to the parent
            reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except (OSError, ValueError):
            break
    engine.stop()


# -- handlers (run in the peer process) ---------------------------------------------------------
@handler
def ping(state: PeerState) -> int:
    return os.getpid()


@handler
def rss(state: PeerState) -> int:
    return rss_bytes()


@handler
def fill(state: PeerState, seed: int | None = None, value: int = 0) -> None:
    """Fills the buffer with ``pattern(seed)``, or with ``value`` when seed is None."""
    if seed is None:
        state.buf[:] = value
    else:
        state.buf[:] = cached_pattern(seed, state.buf.size)


_PATTERNS: dict[tuple[int, int], Any] = {}


def cached_pattern(seed: int, n: int):
    key = (seed, n)
    if key not in _PATTERNS:
        if len(_PATTERNS) > 8:
            _PATTERNS.clear()
        _PATTERNS[key] = pattern(seed, n)
    return _PATTERNS[key]


@handler
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


@handler
def clear_imms(state: PeerState, imms: Sequence[int]) -> dict[int, int]:
    """Forgets the counters of ``imms``; returns the counts that were still there (stale ones)."""
    stale = {}
    for imm in imms:
        n = state.engine.remove_imm_count(imm)
        if n:
            stale[imm] = n
    return stale


@handler
def wait_imms(
    state: PeerState, counts: dict[int, int], timeout: float = 30.0, settle: float = 0.05
) -> dict[int, int]:
    """Waits until each imm arrived exactly ``counts[imm]`` times: waits for the count, then
    checks (after ``settle`` seconds) that nothing more arrived. Returns leftover counts (all
    zero when exact)."""
    deadline = time.monotonic() + timeout
    for imm, n in counts.items():
        with state.engine.imm_counter(imm) as c:
            c.wait(n, timeout=max(0.0, deadline - time.monotonic()))
    if settle:
        time.sleep(settle)
    return {imm: imm_value(state.engine, imm) for imm in counts}


def imm_value(engine: Any, imm: int) -> int:
    """Arrivals of ``imm`` counted and not yet consumed."""
    with engine.imm_counter(imm) as c:
        return c.value


@handler
def write_plan(
    state: PeerState,
    dst: bytes,
    ops: Sequence[WriteOp],
    sender: int = 0,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """Submits this sender's ops of the plan (all at once) and waits for every future."""
    from fabric_lib import MrDescriptor

    engine, region = state.engine, state.region
    desc = MrDescriptor.from_bytes(dst)
    futures = []
    for who, src_off, dst_off, length, imm in ops:
        if who != sender:
            continue
        if length is None:
            futures.append(engine.submit_imm(imm, desc))
        else:
            futures.append(
                engine.submit_write(region, desc, length, src_offset=src_off, dst_offset=dst_off, imm=imm)
            )
    deadline = time.monotonic() + timeout
    for f in futures:
        f.result(timeout=max(0.0, deadline - time.monotonic()))
    return {"submitted": len(futures)}


def apply_plan(init, src_by_sender: dict[int, Any], ops: Sequence[WriteOp]):
    expected = init.copy()
    for who, src_off, dst_off, length, _imm in ops:
        if length:
            expected[dst_off : dst_off + length] = src_by_sender[who][src_off : src_off + length]
    return expected


@handler
def check_plan(
    state: PeerState,
    ops: Sequence[WriteOp],
    init_seed: int,
    src_seeds: dict[int, int],
    src_size: int,
    timeout: float = 30.0,
    span: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Receiver: waits for the exact imm counts of the plan, then compares every byte of the
    buffer (or of ``buf[span[0]:span[1]]``) with the one rebuilt from the seeds and the plan."""
    leftover = wait_imms(state, expected_imm_counts(ops), timeout=timeout)
    init = cached_pattern(init_seed, state.buf.size)
    srcs = {who: cached_pattern(seed, src_size) for who, seed in src_seeds.items()}
    expected = apply_plan(init, srcs, ops)
    lo, hi = span if span is not None else (0, state.buf.size)
    got, expected = state.buf[lo:hi], expected[lo:hi]
    mismatch = None
    if not np.array_equal(got, expected):
        bad = np.flatnonzero(got != expected)
        first = lo + int(bad[0])
        culprit = [i for i, op in enumerate(ops) if op[3] and op[2] <= first < op[2] + op[3]]
        mismatch = {"first": first, "count": int(bad.size), "ops": culprit}
    return {"leftover": leftover, "mismatch": mismatch}


@handler
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
    stats = {"ok": 0, "errors": 0, "first_error": None}

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


@handler
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


@handler
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
    want = Counter()
    for sender, count in counts.items():
        for i, size in enumerate(message_sizes(seed, sender, count, max_size)):
            want[digest(message_bytes(seed, sender, i, size))] += 1
    return {
        "received": received,
        "expected": total,
        "missing": sum((want - got).values()),
        "unexpected": sum((got - want).values()),
    }


@handler
def send_raw(state: PeerState, peer: bytes, size: int, timeout: float = 30.0) -> None:
    """Sends one message of ``size`` bytes (0xAB) and waits for its completion."""
    state.engine.submit_send(peer, b"\xab" * size).result(timeout=timeout)


@handler
def take_messages(state: PeerState, count: int, timeout: float = 30.0) -> list[bytes]:
    """Waits (bounded) for ``count`` received messages; returns and clears their digests."""
    deadline = time.monotonic() + timeout
    with state.msg_lock:
        while len(state.messages) < count and time.monotonic() < deadline:
            state.msg_lock.wait(max(0.0, deadline - time.monotonic()))
        got, state.messages = state.messages, []
    return got


@handler
def write_until_peer_dies(
    state: PeerState,
    victim: bytes,
    victim_pid: int,
    survivor: bytes,
    survivor_ops: Sequence[WriteOp],
    write_size: int = 1 << 20,
    window: int = 64,
    warmup: int = 8,
    stream_after_kill: float = 0.1,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """The peer-failure scenario, run in the writer (so the clock and futures are local):

    A. streams writes of ``write_size`` bytes (with imm, at most ``window`` outstanding) to
       ``victim``; once ``warmup`` completed, SIGKILLs the victim, records which requests were
       still pending, and goes on streaming for ``stream_after_kill`` seconds;
    B. right after that, submits a write, a zero-byte write, an imm and a message to the dead
       peer, and waits until every request to the victim has settled;
    C. submits ``survivor_ops`` to the live survivor, then one more write to the dead peer;
    then waits (bounded) for everything and times ``engine.stop()``.

    Reports per request to the victim ``(seconds from kill to completion, seconds from submission
    to completion, error class and message or None)``; None if it never completed.
    """
    from fabric_lib import MrDescriptor

    engine, region = state.engine, state.region
    vdesc = MrDescriptor.from_bytes(victim)
    sdesc = MrDescriptor.from_bytes(survivor)
    submitted: dict[str, float] = {}
    finished: dict[str, tuple[float, str | None]] = {}
    lock = threading.Lock()

    def track(key: str):
        submitted[key] = time.monotonic()

        def on_done(err: BaseException | None) -> None:
            with lock:
                finished[key] = (time.monotonic(), None if err is None else f"{type(err).__name__}: {err}")

        return on_done

    def wait_settled(keys: Sequence[str]) -> None:
        while time.monotonic() < deadline:
            with lock:
                if all(k in finished for k in keys):
                    return
            time.sleep(0.005)

    def to_survivor(ops: Sequence[WriteOp]) -> tuple[list[str], float]:
        t0 = time.monotonic()
        futures = []
        for _who, src_off, dst_off, ln, imm in ops:
            if ln is None:
                futures.append(engine.submit_imm(imm, sdesc))
            else:
                futures.append(
                    engine.submit_write(region, sdesc, ln, src_offset=src_off, dst_offset=dst_off, imm=imm)
                )
        errors = []
        for f in futures:
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001 - reported
                errors.append(repr(e))
        return errors, time.monotonic() - t0

    deadline = time.monotonic() + timeout
    # A. a stream of writes to the victim (at most ``window`` outstanding); the kill comes once
    # a few completed, and the stream goes on for ``stream_after_kill`` seconds after it.
    length = min(write_size, region.length, vdesc.length)
    slots = threading.Semaphore(window)
    stop_stream = threading.Event()
    killed = threading.Event()
    streamed: list[str] = []
    stream_error: list[str] = []

    def stream() -> None:
        i = 0
        while not stop_stream.is_set():
            if not slots.acquire(timeout=0.05):
                continue
            key = f"{'after_stream' if killed.is_set() else 'stream'}{i}"
            i += 1
            done = track(key)

            def on_done(err: BaseException | None, done=done) -> None:
                done(err)
                slots.release()

            streamed.append(key)
            try:
                engine.submit_write(region, vdesc, length, imm=0xDEAD, on_done=on_done)
            except Exception as e:  # noqa: BLE001 - reported
                streamed.pop()
                stream_error.append(repr(e))
                return

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    while time.monotonic() < deadline:
        with lock:
            if len(finished) >= warmup:
                break
        time.sleep(0.0002)
    else:
        raise TimeoutError("the writes to the victim did not get going before the kill")
    os.kill(victim_pid, signal.SIGKILL)
    t_kill = time.monotonic()
    killed.set()
    with lock:
        in_flight = [k for k in list(streamed) if k not in finished]
    time.sleep(stream_after_kill)
    stop_stream.set()
    streamer.join(5)
    after_stream = [k for k in streamed if k.startswith("after_stream")]

    # B. more requests to the dead peer; wait until every request to it has settled
    engine.submit_write(region, vdesc, 4096, imm=0xDEAD, on_done=track("after_write"))
    engine.submit_write(region, vdesc, 0, imm=0xDEAD, on_done=track("after_zero_write"))
    engine.submit_imm(0xDEAD, vdesc, on_done=track("after_imm"))
    engine.submit_send(vdesc.owner, b"hello?", on_done=track("after_send"))
    after = ["after_write", "after_zero_write", "after_imm", "after_send"]
    wait_settled(in_flight + after_stream + after)
    settled_s = time.monotonic() - t_kill

    # C. the live survivor, then the dead peer once more
    survivor_errors, survivor_s = to_survivor(survivor_ops)
    engine.submit_write(region, vdesc, 64, imm=0xDEAD, on_done=track("late_write"))
    wait_settled(["late_write"])
    with lock:
        outcomes = {
            k: (finished[k][0] - t_kill, finished[k][0] - submitted[k], finished[k][1])
            if k in finished
            else None
            for k in in_flight + after_stream + after + ["late_write"]
        }
    t0 = time.monotonic()
    engine.stop()
    stop_s = time.monotonic() - t0
    return {
        "in_flight_at_kill": in_flight,
        "after_kill_stream": after_stream,
        "stream_error": stream_error,
        "completed_before_kill": len(streamed) - len(in_flight) - len(after_stream),
        "outcomes": outcomes,
        "settled_s": settled_s,
        "survivor_errors": survivor_errors,
        "survivor_s": survivor_s,
        "stop_s": stop_s,
    }


@handler
def stream_writes(state: PeerState, dst: bytes, imm: int, size: int = 65536, max_inflight: int = 64) -> None:
    """Starts a background thread writing to ``dst`` forever (until this process dies)."""
    from fabric_lib import MrDescriptor

    engine, region = state.engine, state.region
    desc = MrDescriptor.from_bytes(dst)
    length = min(size, region.length, desc.length)
    window = threading.Semaphore(max_inflight)
    state.extra["streamed"] = 0
    outcomes: Counter[str] = Counter()
    state.extra["stream_outcomes"] = outcomes

    def on_done(err: BaseException | None) -> None:
        state.extra["streamed"] += 1
        outcomes["ok" if err is None else type(err).__name__] += 1
        window.release()

    def run() -> None:
        while True:
            window.acquire()
            try:
                engine.submit_write(region, desc, length, imm=imm, on_done=on_done)
            except Exception:  # noqa: BLE001 - engine stopped
                return

    threading.Thread(target=run, daemon=True).start()


@handler
def streamed(state: PeerState) -> int:
    return state.extra.get("streamed", 0)


@handler
def stream_outcomes(state: PeerState) -> dict[str, int]:
    return dict(state.extra.get("stream_outcomes", {}))


# -- bootstrap over torch.distributed (one process per rank) ------------------------------------
BOOT_STRIDE = 1 << 20  # each sender's slot in every receiver's region
BOOT_PIECES = 5  # writes per (sender, receiver), all with the sender's imm


def boot_len(rank: int) -> int:
    """Bytes rank sends to each peer (different per rank, unaligned)."""
    return (256 << 10) + 4093 * rank + 3


def bootstrap_rank(
    rank: int, world: int, port: int, providers: Sequence[str], results: Any, timeout: float = 60.0
) -> None:
    """One rank: joins a gloo process group, then for each provider in turn runs
    ``_bootstrap_round`` (engine, ``fabric_lib.distributed.exchange``, all-to-all writes, checks).
    Puts (rank, "ok", {provider: report}) on ``results``, or (rank, "error", text) at the first
    failure (the other ranks then fail on their bounded waits)."""
    _die_with_parent()
    done: dict[str, Any] = {}
    provider = None
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout),
        )
        for provider in providers:
            done[provider] = _bootstrap_round(rank, world, provider, timeout)
        dist.destroy_process_group()
        results.put((rank, "ok", done))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", f"provider {provider!r}:\n{traceback.format_exc()}"))


def _bootstrap_round(rank: int, world: int, provider: str, timeout: float) -> dict[str, Any]:
    """Engine on ``provider``; exchange; a write of ``boot_len(rank)`` bytes (in BOOT_PIECES
    pieces, imm 0x1000+rank) into every other rank's region at ``rank * BOOT_STRIDE``, plus an
    imm-only request to each peer's second descriptor; checks every inbound byte and count, and a
    subgroup exchange."""
    import fabric_lib
    import torch
    import torch.distributed as dist
    from fabric_lib.distributed import exchange

    engine = fabric_lib.TransferEngine(provider, poll_mode="adaptive", transfer_timeout=30.0)
    try:
        recv = torch.zeros(world * BOOT_STRIDE, dtype=torch.uint8)
        aux = torch.zeros(64, dtype=torch.uint8)
        src = torch.from_numpy(pattern(100 + rank, boot_len(rank)).copy())
        recv_region, aux_region = engine.register_tensor(recv), engine.register_tensor(aux)
        src_region = engine.register_tensor(src)

        infos = exchange(engine, [recv_region.descriptor, aux_region.descriptor])
        assert [i.rank for i in infos] == list(range(world)), infos
        assert infos[rank].address == engine.main_address
        assert infos[rank].descriptors == [recv_region.descriptor, aux_region.descriptor]
        assert len({i.address.to_bytes() for i in infos}) == world
        for info in infos:
            assert [d.length for d in info.descriptors] == [world * BOOT_STRIDE, 64]

        # Every rank writes to every other rank (all at once; nothing ordered).
        n = boot_len(rank)
        cuts = [n * k // BOOT_PIECES for k in range(BOOT_PIECES + 1)]
        futures = []
        for peer in infos:
            if peer.rank == rank:
                continue
            dst = peer.descriptors[0]
            for a, b in itertools.pairwise(cuts):
                futures.append(
                    engine.submit_write(
                        src_region,
                        dst,
                        b - a,
                        src_offset=a,
                        dst_offset=rank * BOOT_STRIDE + a,
                        imm=0x1000 + rank,
                    )
                )
            futures.append(engine.submit_imm(0x2000 + rank, peer.descriptors[1]))
        for f in futures:
            f.result(timeout=timeout)

        # Inbound: exact counts per sender, then every byte.
        for s in range(world):
            if s == rank:
                continue
            with engine.imm_counter(0x1000 + s) as c:
                c.wait(BOOT_PIECES, timeout=timeout)
            with engine.imm_counter(0x2000 + s) as c:
                c.wait(1, timeout=timeout)
        time.sleep(0.05)
        extra = {imm: imm_value(engine, imm) for s in range(world) for imm in (0x1000 + s, 0x2000 + s)}
        assert all(v == 0 for v in extra.values()), f"extra immediates: {extra}"
        got = recv.numpy()
        for s in range(world):
            slot = got[s * BOOT_STRIDE : (s + 1) * BOOT_STRIDE]
            if s == rank:
                assert not slot.any(), "a peer wrote into this rank's own slot"
                continue
            ln = boot_len(s)
            assert np.array_equal(slot[:ln], pattern(100 + s, ln)), f"bytes from rank {s} differ"
            assert not slot[ln:].any(), f"rank {s} wrote past its range"
        assert not aux.numpy().any(), "imm-only requests wrote bytes"

        # A subgroup exchange: ranks 0 and world-1 only (every rank must create the group).
        sub_ranks = [0, world - 1]
        sub = dist.new_group(sub_ranks)
        if rank in sub_ranks:
            sub_infos = exchange(engine, [aux_region.descriptor], group=sub)
            assert [i.address for i in sub_infos] == [infos[r].address for r in sub_ranks]
            assert [i.rank for i in sub_infos] == [0, 1]

        dist.barrier()  # nobody stops its engine while others may still write to it
    finally:
        t0 = time.monotonic()
        engine.stop()
        stop_s = time.monotonic() - t0
    return {"stop_s": stop_s, "provider": engine.provider}


def run_ranks(
    target: Callable[..., None], world: int, args: tuple[Any, ...], timeout: float = 90.0
) -> dict[int, Any]:
    """Starts ``target(rank, world, *args, results_queue)`` in ``world`` spawned processes,
    collects one result per rank (bounded), and always kills what is left."""
    results = CTX.Queue()
    procs = [
        CTX.Process(target=target, args=(r, world, *args, results), daemon=True, name=f"rank{r}")
        for r in range(world)
    ]
    out: dict[int, Any] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(out) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError(f"only ranks {sorted(out)} reported within {timeout}s")
            try:
                rank, status, payload = results.get(timeout=min(left, 1.0))
            except Exception:  # noqa: BLE001 - queue.Empty: check for dead ranks
                dead = [
                    (i, p.exitcode) for i, p in enumerate(procs) if p.exitcode is not None and i not in out
                ]
                if dead:
                    raise PeerError(f"ranks died without reporting: {dead}") from None
                continue
            if status != "ok":
                raise PeerError(f"rank {rank} failed:\n{payload}")
            out[rank] = payload
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        results.close()
    return out
