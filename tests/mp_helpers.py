"""Helpers for multi-process tests: long-lived peer processes, each owning one TransferEngine,
driven by commands over a multiprocessing Pipe.

A peer is started with the "spawn" context (no fork of a process holding libfabric or torch
state), opens an engine with ``poll_mode="adaptive"`` (CI machines have 2 cores), registers one
uint8 buffer and reports ``address``/``descriptor`` bytes. The test then calls handlers by name
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
import multiprocessing as mp
import os
import random
import signal
import socket
import threading
import time
import traceback
from collections import Counter
from typing import Any, Callable, Iterator, Sequence

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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pattern(seed: int, n: int):
    """``n`` pseudo-random bytes (uint8 tensor), identical in every process for one seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


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
            marks=pytest.mark.skipif(not provider_available(n), reason=f"libfabric provider {n!r} not available"),
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

    ``start`` returns at once; ``wait_ready`` blocks (bounded) until the engine is open. Use
    ``peers(...)`` to start several at once and always close them.
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

    def submit(self, cmd: str, **kwargs: Any) -> None:
        """Sends a command without waiting; collect its answer with ``result``."""
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
            raise PeerError(f"{self.name}: no answer to {cmd!r} within {timeout:.1f}s")
        try:
            status, payload = self._conn.recv()
        except (EOFError, OSError):
            self.proc.join(1)
            raise PeerError(f"{self.name}: died (exit code {self.proc.exitcode}) during {cmd!r}") from None
        if status != "ok":
            raise PeerError(f"{self.name}: {cmd!r} failed in the peer:\n{payload}")
        return payload

    def call(self, cmd: str, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any) -> Any:
        self.submit(cmd, **kwargs)
        return self.result(timeout)

    def kill(self) -> None:
        """SIGKILL, then reap (bounded)."""
        if self.proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self, timeout: float = 20.0) -> float | None:
        """Asks the peer to stop its engine and exit; kills it if it does not within ``timeout``.

        Returns the seconds its ``engine.stop()`` took, or None if it was killed or dead.
        """
        stop_s = None
        try:
            if self.proc.is_alive():
                with contextlib.suppress(OSError, ValueError, BrokenPipeError):
                    self._pending.clear()
                    self.submit("exit")
                    with contextlib.suppress(PeerError):
                        stop_s = self.result(timeout)
                self.proc.join(timeout)
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
        self.msg_bytes = 0

    def on_message(self, data: bytes) -> None:
        d = digest(data)
        with self.msg_lock:
            self.messages.append(d)
            self.msg_bytes += len(data)
            self.msg_lock.notify_all()


HANDLERS: dict[str, Callable[..., Any]] = {}


def handler(fn: Callable[..., Any]) -> Callable[..., Any]:
    HANDLERS[fn.__name__] = fn
    return fn


def _serve(conn: Any, provider: str, buf_size: int, engine_kwargs: dict[str, Any]) -> None:
    _die_with_parent()
    try:
        import torch

        import fabric_lib

        torch.set_num_threads(1)
        engine = fabric_lib.TransferEngine(provider, poll_mode="adaptive", **engine_kwargs)
        buf = torch.zeros(buf_size, dtype=torch.uint8)
        region = engine.register_tensor(buf)
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
        state.buf.fill_(value)
    else:
        state.buf.copy_(cached_pattern(seed, state.buf.numel()))


_PATTERNS: dict[tuple[int, int], Any] = {}


def cached_pattern(seed: int, n: int):
    key = (seed, n)
    if key not in _PATTERNS:
        if len(_PATTERNS) > 8:
            _PATTERNS.clear()
        _PATTERNS[key] = pattern(seed, n)
    return _PATTERNS[key]


@handler
def check_bytes(state: PeerState, offset: int, length: int, seed: int | None, seed_size: int = 0,
                src_offset: int = 0, value: int = 0) -> int:
    """Number of bytes of ``buf[offset:offset+length]`` that differ from
    ``pattern(seed, seed_size)[src_offset:...]`` (or from ``value`` when seed is None)."""
    got = state.buf[offset : offset + length]
    if seed is None:
        return int((got != value).sum())
    want = cached_pattern(seed, seed_size)[src_offset : src_offset + length]
    return int((got != want).sum())


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
def wait_imms(state: PeerState, counts: dict[int, int], timeout: float = 30.0, settle: float = 0.05) -> dict[int, int]:
    """Waits until each imm arrived exactly ``counts[imm]`` times: waits for the count, then
    checks (after ``settle`` seconds) that nothing more arrived. Returns leftover counts (all
    zero when exact)."""
    deadline = time.monotonic() + timeout
    for imm, n in counts.items():
        with state.engine.imm_counter(imm) as c:
            c.wait(n, timeout=max(0.0, deadline - time.monotonic()))
    if settle:
        time.sleep(settle)
    return {imm: state.engine.imm_counter(imm).value for imm in counts}


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
            futures.append(engine.submit_write(region, desc, length, src_offset=src_off, dst_offset=dst_off, imm=imm))
    deadline = time.monotonic() + timeout
    for f in futures:
        f.result(timeout=max(0.0, deadline - time.monotonic()))
    return {"submitted": len(futures)}


def apply_plan(init, src_by_sender: dict[int, Any], ops: Sequence[WriteOp]):
    expected = init.clone()
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
) -> dict[str, Any]:
    """Receiver: waits for the exact imm counts of the plan, then compares every byte of the
    buffer with the one rebuilt from the seeds and the plan."""
    leftover = wait_imms(state, expected_imm_counts(ops), timeout=timeout)
    init = cached_pattern(init_seed, state.buf.numel())
    srcs = {who: cached_pattern(seed, src_size) for who, seed in src_seeds.items()}
    expected = apply_plan(init, srcs, ops)
    mismatch = None
    if not bool((state.buf == expected).all()):
        bad = (state.buf != expected).nonzero().flatten()
        first = int(bad[0])
        culprit = [i for i, op in enumerate(ops) if op[3] and op[2] <= first < op[2] + op[3]]
        mismatch = {"first": first, "count": int(bad.numel()), "ops": culprit}
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
        engine.submit_write(region, desc, size, src_offset=off, dst_offset=off, imm=imms[i % nimm], on_done=on_done)
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
def stop_engine(state: PeerState) -> float:
    t0 = time.monotonic()
    state.engine.stop()
    return time.monotonic() - t0


@handler
def write_until_peer_dies(
    state: PeerState,
    victim: bytes,
    victim_pid: int,
    survivor: bytes,
    survivor_ops: Sequence[WriteOp],
    write_size: int = 1 << 20,
    batch: int = 256,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """The peer-failure scenario, run in the writer (so the clock and futures are local):

    1. submits ``batch`` writes of ``write_size`` bytes (with imm) to ``victim``; once the first
       one completed, SIGKILLs the victim and records which futures were still pending;
    2. right after the kill, submits writes, an imm and a message to the dead peer, and the
       ``survivor_ops`` plan to the live survivor;
    3. waits (bounded) for everything and reports, per future, the outcome and when it came
       (seconds after the kill), then times ``engine.stop()``.
    """
    from fabric_lib import MrDescriptor

    engine, region = state.engine, state.region
    vdesc = MrDescriptor.from_bytes(victim)
    sdesc = MrDescriptor.from_bytes(survivor)
    finished: dict[int, tuple[float, str | None]] = {}
    lock = threading.Lock()

    def track(key: int):
        def on_done(err: BaseException | None) -> None:
            with lock:
                finished[key] = (time.monotonic(), None if err is None else type(err).__name__ + ": " + str(err))

        return on_done

    # 1. writes in flight to the victim
    length = min(write_size, region.length, vdesc.length)
    for i in range(batch):
        engine.submit_write(region, vdesc, length, imm=0xDEAD, on_done=track(i))
    deadline = time.monotonic() + timeout
    while not finished and time.monotonic() < deadline:
        time.sleep(0.001)
    if not finished:
        raise TimeoutError("no write to the victim completed before the kill")
    os.kill(victim_pid, signal.SIGKILL)
    t_kill = time.monotonic()
    with lock:
        in_flight_at_kill = [i for i in range(batch) if i not in finished]

    # 2. more requests to the dead peer, and the survivor's plan
    after = list(range(batch, batch + 4))
    engine.submit_write(region, vdesc, 4096, imm=0xDEAD, on_done=track(after[0]))
    engine.submit_write(region, vdesc, 0, imm=0xDEAD, on_done=track(after[1]))
    engine.submit_imm(0xDEAD, vdesc, on_done=track(after[2]))
    engine.submit_send(vdesc.owner, b"hello?", on_done=track(after[3]))
    t_survivor = time.monotonic()
    survivor_futures = []
    for _who, src_off, dst_off, ln, imm in survivor_ops:
        if ln is None:
            survivor_futures.append(engine.submit_imm(imm, sdesc))
        else:
            survivor_futures.append(engine.submit_write(region, sdesc, ln, src_offset=src_off, dst_offset=dst_off, imm=imm))

    # 3. wait for everything (bounded)
    survivor_errors = []
    for f in survivor_futures:
        try:
            f.result(timeout=max(0.0, deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001 - reported
            survivor_errors.append(repr(e))
    survivor_s = time.monotonic() - t_survivor
    keys = in_flight_at_kill + after
    while time.monotonic() < deadline:
        with lock:
            if all(k in finished for k in keys):
                break
        time.sleep(0.01)
    with lock:
        outcomes = {k: (finished[k][0] - t_kill, finished[k][1]) if k in finished else None for k in keys}
    t0 = time.monotonic()
    engine.stop()
    stop_s = time.monotonic() - t0
    return {
        "in_flight_at_kill": in_flight_at_kill,
        "after_kill": after,
        "outcomes": outcomes,
        "survivor_errors": survivor_errors,
        "survivor_s": survivor_s,
        "stop_s": stop_s,
    }
